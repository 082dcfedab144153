"""The Celery app definition: every Celery setting ttsq depends on, and which queue a job goes to.

One explicit app per settings object (no ``shared_task``, no ``current_app``). Producers send through
it by task name; a worker registers ttsq's tasks on it (``ttsq.worker.tasks``). Nothing here runs a job.

Each mode has its own queues (``queue_for``): ``ttsq`` for voice_design, the default, and
``ttsq.custom_voice`` / ``ttsq.voice_clone`` for the others, because a worker serves the mode of the
checkpoint it loaded and consumes only that mode's queues; and each mode's queue has a bulk lane
beside it, ``ttsq.bulk`` and so on, which workers give a guaranteed share (docs/scheduling.md).

``stored_result`` reads what the result backend holds for a job, through ttsq's one reader
(``ttsq.results.read_result``): producers and the worker's sweeper read a job's state that way.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import redis
from celery import Celery
from celery.backends.redis import RedisBackend, SentinelBackend

from ttsq.config import is_sentinel_url, parse_sentinel_url
from ttsq.constants import (
    DOCUMENT_TASK_NAME,
    TASK_NAME,
)
from ttsq.delivery.connection import AMQP
from ttsq.errors import BrokerError, CorruptRecord
from ttsq.job import BULK_SUFFIX, LANES, MODES, Lane
from ttsq.records.connection import SentinelConnection, sentinel_kwargs, socket_limits, unreachable
from ttsq.results import StoredResult, read_result

if TYPE_CHECKING:
    from ttsq.config import Settings


def queue_for(base: str, mode: str, lane: str = "interactive") -> str:
    """The queue of one mode and lane. voice_design, the default mode, keeps the plain name, and the
    interactive lane the mode's name, so a bare ``send_task(..., queue="ttsq")`` from a web backend
    keeps working."""
    queue = base if mode == "voice_design" else f"{base}.{mode}"
    return queue + BULK_SUFFIX if lane == "bulk" else queue


def queues_for(base: str, modes: Iterable[str] = MODES) -> list[str]:
    """Every queue of these modes, interactive lanes first (the order a worker consumes them in)."""
    modes = list(modes)
    return [queue_for(base, mode, lane) for lane in LANES for mode in modes]


def default_lane(task: str, *, stream: bool = False) -> Lane:
    """The lane of a job whose request names none: a document is bulk work unless someone listens to it
    as it is made (streamed); a single job is interactive. The one place this default is decided."""
    return "bulk" if task == DOCUMENT_TASK_NAME and not stream else "interactive"


def lane_for(task: str, fields: Any) -> Lane:
    """The lane a ``task`` with these request fields waits in: the one they name, else ``default_lane``.
    ``fields`` may be anything (a raw message's kwargs): a lane that is not one is no lane."""
    fields = fields if isinstance(fields, dict) else {}
    lane = fields.get("lane")
    return cast("Lane", lane) if lane in LANES else default_lane(task, stream=fields.get("stream") is True)


def make_app(settings: Settings, *, worker: bool = False) -> Celery:
    """The Celery app for these settings, with no task registered (``ttsq.worker.tasks`` adds them on a worker)."""
    app = Celery("ttsq", set_as_current=False, amqp=AMQP)
    app.conf.update(celery_config(settings, worker=worker))
    return app


#: ttsq's own Celery setting: whether the app's result backend listens for what it sends (``ResultBackend``).
LISTENS_OPTION = "ttsq_listens_for_results"


def celery_config(settings: Settings, *, worker: bool) -> dict[str, Any]:
    """Every Celery setting ttsq depends on, in one place."""
    visibility = settings.visibility_timeout_s
    # Workers ride out a Redis restart (about 20 s of reconnects before a result is given up);
    # producers report an unreachable result backend within a couple of seconds instead.
    result_retry = (
        {"max_retries": 20, "interval_start": 0, "interval_step": 1, "interval_max": 1}
        if worker
        else {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}
    )
    # Behind Sentinel, kombu and Celery ask the Sentinels (``master_name``, and ``sentinel_kwargs`` for
    # the Sentinels' own credentials and timeouts) for the primary on every new connection.
    broker_sentinel, results_sentinel = (
        _sentinel_options(settings) if is_sentinel_url(url) else {}
        for url in (settings.broker_url, settings.result_backend)
    )
    backend = "SentinelResultBackend" if results_sentinel else "ResultBackend"
    limits = socket_limits(settings)
    transport = {"broker_transport": "ttsq.delivery.connection:SentinelTransport"} if broker_sentinel else {}
    return {
        "broker_url": _for_celery(settings.broker_url),
        **transport,
        # Celery's Redis backend, through ``ResultBackend`` (``class+url``: Celery's own form for a backend class).
        "result_backend": f"{__name__}:{backend}+{_for_celery(settings.result_backend)}",
        LISTENS_OPTION: not worker,
        # JSON only: a pickled message would be code execution for anyone who can write to Redis.
        "task_serializer": "json",
        "result_serializer": "json",
        "event_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        # At-least-once: ack after the job is stored, so a worker that dies loses nothing.
        "task_acks_late": True,
        "worker_prefetch_multiplier": 1,
        # Flower sees every job: sent, received, started, succeeded/failed.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "result_expires": settings.result_ttl_s,
        "result_extended": False,  # extended results would copy the kwargs (the input text) into Redis
        # Redis redelivers unacked messages after the visibility timeout; set it everywhere Celery
        # reads it, and sweep for abandoned messages every second instead of every ~100 s.
        "broker_transport_options": {
            "visibility_timeout": visibility,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
            # A silent broker is given up within seconds (the default is to wait forever): a publish
            # then moves to the new primary. kombu checks its waiting BRPOP connection every
            # health-check interval and drops it once the reply is that overdue past the 1 s poll;
            # the poll itself is read only once readable, so the socket timeout never cuts it.
            **limits,
            **broker_sentinel,
        },
        "result_backend_transport_options": {
            "visibility_timeout": visibility,
            "retry_policy": result_retry,
            **results_sentinel,
        },
        # A worker storing a result while Redis restarts tries again (about 30 s, as for its own calls)
        # instead of failing a job it finished: without this, Celery stores that job as a FAILURE
        # (ConnectionError) once Redis is back, though its audio is stored.
        "result_backend_always_retry": worker,
        "result_backend_max_retries": 40,
        "result_backend_max_sleep_between_retries_ms": 1000,
        "visibility_timeout": visibility,
        # The result backend's client, as every other: a silent node given up within seconds, idle
        # connections pinged (its subscription is polled with a timeout of its own, never the socket's).
        "redis_socket_connect_timeout": limits["socket_connect_timeout"],
        "redis_socket_timeout": limits["socket_timeout"],
        "redis_backend_health_check_interval": limits["health_check_interval"],
        # A producer with the broker down fails within a few seconds instead of retrying for long.
        "task_publish_retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1},
        "broker_connection_timeout": limits["socket_connect_timeout"],
        "broker_connection_retry_on_startup": True,
        "task_default_queue": settings.queue,
        # apply_async/send_task through this app without a queue: the mode picks it.
        "task_routes": (functools.partial(_route_by_mode, settings.queue),),
        "worker_hijack_root_logger": False,
    }


def _sentinel_options(settings: Settings) -> dict[str, Any]:
    return {"master_name": settings.redis_master_name, "sentinel_kwargs": sentinel_kwargs(settings)}


def _for_celery(url: str) -> str:
    """A ``sentinel://`` URL written the way kombu and Celery read it (the database and the data nodes'
    credentials on every address: they read them from the first); any other URL as it is."""
    return parse_sentinel_url(url).for_celery() if is_sentinel_url(url) else url


def _route_by_mode(
    base: str, name: str, args: Any, kwargs: Any, options: Any, task: Any = None, **_: Any
) -> dict[str, str] | None:
    if name not in (TASK_NAME, DOCUMENT_TASK_NAME):
        return None
    mode = kwargs.get("mode") if isinstance(kwargs, dict) else None
    return {"queue": queue_for(base, mode if isinstance(mode, str) else "voice_design", lane_for(name, kwargs))}


class ResultBackend(RedisBackend):  # type: ignore[misc]
    """Celery's Redis result backend, except that a failure is stored with its type and message only:
    the worker's traceback (its file paths, its frames) is for the worker's log, not for every client
    that reads the result; and a worker's does not listen for results.

    Celery's Redis backend subscribes to the result channel of every task its process sends, and of
    every header task of a chord it sends, until it reads that result (celery/celery#3812, #4824). A
    worker sends chunks, stitches, released and swept jobs and never waits for any of them: each would
    stay subscribed, and referenced, for the life of the process. Producers (``ttsq.client``) listen.
    """

    @property
    def listens(self) -> bool:
        """Whether this app listens for the results of the tasks it sends (not a worker's). From the app's
        configuration: Celery makes a backend per thread, and a worker's task threads send."""
        return bool(self.app.conf.get(LISTENS_OPTION, True))

    def on_task_call(self, producer: Any, task_id: str) -> None:
        if self.listens:
            super().on_task_call(producer, task_id)

    def add_pending_result(self, result: Any, weak: bool = False, start_drainer: bool = True) -> Any:
        if not self.listens:
            return result  # a chord's barrier over its header results: nobody in a worker waits on it
        return super().add_pending_result(result, weak=weak, start_drainer=start_drainer)

    def mark_as_failure(
        self, task_id: str, exc: BaseException, traceback: Any = None, *args: Any, **kwargs: Any
    ) -> Any:
        return super().mark_as_failure(task_id, exc, None, *args, **kwargs)

    def mark_as_retry(self, task_id: str, exc: BaseException, traceback: Any = None, *args: Any, **kwargs: Any) -> Any:
        return super().mark_as_retry(task_id, exc, None, *args, **kwargs)


class SentinelResultBackend(ResultBackend, SentinelBackend):  # type: ignore[misc]
    """``ResultBackend`` behind Sentinel: Celery's Sentinel backend, which finds the primary through the
    Sentinels and follows it through a failover, on ttsq's ``SentinelConnection`` (a result stored on
    a dropped connection must not go to the old primary's address: restarted, it takes writes until
    the Sentinels demote it, and they are lost then)."""

    def _params_from_url(self, url: str, defaults: dict[str, Any]) -> dict[str, Any]:
        params: dict[str, Any] = super()._params_from_url(url, defaults)
        params["connection_class"] = SentinelConnection
        return params

    def exception_safe_to_retry(self, exc: BaseException) -> bool:
        # Just after a failover the new primary may refuse writes until its replicas are back
        # (NOREPLICAS, with min-replicas-to-write): a worker storing a result waits, as for a lost connection.
        return bool(super().exception_safe_to_retry(exc)) or unreachable(exc)


def stored_result(app: Celery, task_id: str) -> StoredResult:
    """What the result backend holds for ``task_id`` (PENDING when nothing), read by ``read_result``;
    ``BrokerError`` when the backend cannot be reached, ``CorruptRecord`` when the record is not ttsq's."""
    backend = app.backend
    try:
        raw = backend.get(backend.get_key_for_task(task_id))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
        raise BrokerError(f"cannot reach the result backend: {exc}") from exc
    except redis.exceptions.RedisError as exc:  # WRONGTYPE: something else is kept under the result's key
        raise CorruptRecord("result", f"of job {task_id[:80]} cannot be read: {type(exc).__name__}") from None
    return read_result(raw, task_id)
