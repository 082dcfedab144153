"""The Celery app and the public ``ttsq.synthesize`` task.

One explicit app per settings object (no ``shared_task``, no ``current_app``). The task is thin: it
hands its JSON kwargs to the worker runtime. Producers build the same app, without a runtime, to send.

Contract for web backends that do not import ttsq::

    celery.send_task("ttsq.synthesize", kwargs={"text": "...", "language": "korean"}, queue="ttsq")

Each mode has its own queue (``queue_for``): ``ttsq`` for voice_design, the default, and
``ttsq.custom_voice`` / ``ttsq.voice_clone`` for the others, because a worker serves the mode of the
checkpoint it loaded and consumes only that mode's queue.

returns a ``JobResult`` dict (see ``ttsq.request``) or fails with ``InvalidRequest`` / ``EngineError``.

``ttsq.document`` takes the same kwargs with a text of any length and returns a ``DocumentResult``
(see ``ttsq.document``); on a worker it becomes a chord of ``ttsq.synthesize`` jobs and ``ttsq.stitch``.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any

from celery import Celery, Task
from celery.exceptions import InvalidTaskError, Reject

from ttsq.constants import (
    CLAIM_HEADER,
    DOCUMENT_HEADER,
    DOCUMENT_TASK_NAME,
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_HEALTH_CHECK_INTERVAL_S,
    REDIS_SOCKET_TIMEOUT_S,
    SENT_AT_HEADER,
    STITCH_TASK_NAME,
    TASK_NAME,
)
from ttsq.errors import InvalidRequest

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.document import Documents
    from ttsq.request import JobResult
    from ttsq.worker import WorkerRuntime

logger = logging.getLogger(__name__)


def queue_for(base: str, mode: str) -> str:
    """The queue of one mode. voice_design, the default mode, keeps the plain name, so a bare
    ``send_task(..., queue="ttsq")`` from a web backend keeps working."""
    return base if mode == "voice_design" else f"{base}.{mode}"


def celery_config(settings: Settings, *, worker: bool) -> dict[str, Any]:
    """Every Celery setting ttsq depends on, in one place."""
    visibility = settings.visibility_timeout_s
    # Workers ride out a Redis restart (about 20 s of reconnects before a result is given up);
    # producers report an unreachable result backend within a couple of seconds instead.
    result_retry = {"max_retries": 20, "interval_start": 0, "interval_step": 1, "interval_max": 1} if worker \
        else {"max_retries": 2, "interval_start": 0, "interval_step": 0.5, "interval_max": 1}
    return {
        "broker_url": settings.broker_url,
        "result_backend": settings.result_backend,
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
            "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
            "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
            "health_check_interval": REDIS_HEALTH_CHECK_INTERVAL_S,
        },
        "result_backend_transport_options": {"visibility_timeout": visibility, "retry_policy": result_retry},
        "visibility_timeout": visibility,
        "redis_socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "redis_socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        # A producer with the broker down fails within a few seconds instead of retrying for long.
        "task_publish_retry_policy": {"max_retries": 2, "interval_start": 0, "interval_step": 0.5,
                                      "interval_max": 1},
        "broker_connection_timeout": REDIS_CONNECT_TIMEOUT_S,
        "broker_connection_retry_on_startup": True,
        "task_default_queue": settings.queue,
        # apply_async/send_task through this app without a queue: the mode picks it.
        "task_routes": (functools.partial(_route_by_mode, settings.queue),),
        "worker_hijack_root_logger": False,
    }


def _route_by_mode(base: str, name: str, args: Any, kwargs: Any, options: Any, task: Any = None,
                   **_: Any) -> dict[str, str] | None:
    if name not in (TASK_NAME, DOCUMENT_TASK_NAME):
        return None
    mode = kwargs.get("mode") if isinstance(kwargs, dict) else None
    return {"queue": queue_for(base, mode if isinstance(mode, str) else "voice_design")}


class GuardedTask(Task):  # type: ignore[misc]
    """A task whose messages are checked for shape before Celery builds a request from them.

    Celery 5.7 unpacks a protocol-2 body as ``args, kwargs, embed`` outside any handler: one message
    whose body is a JSON object or a number ends the whole worker ("Unrecoverable error"), and,
    never acknowledged, it ends the next worker too; kwargs that are not an object leave the task
    without any result. Here such a message becomes an ``InvalidTaskError``, which Celery's consumer
    logs and drops.
    """

    def start_strategy(self, app: Celery, consumer: Any, **kwargs: Any) -> Any:
        handle = super().start_strategy(app, consumer, **kwargs)

        def guarded(message: Any, body: Any, *args: Any, **kw: Any) -> Any:
            if "task" in (message.headers or {}):  # protocol 2; protocol 1 bodies are checked by Celery
                payload = message.payload
                if not (isinstance(payload, (list, tuple)) and len(payload) == 3
                        and isinstance(payload[0], (list, tuple)) and isinstance(payload[1], dict)
                        and isinstance(payload[2], (dict, type(None)))):
                    raise InvalidTaskError("message body is not [args, kwargs, embed]")
            return handle(message, body, *args, **kw)

        return guarded


def make_app(settings: Settings, *, runtime: WorkerRuntime | None = None) -> Celery:
    """The Celery app for these settings, with ``ttsq.synthesize`` registered.

    Producers pass no runtime. A worker builds and starts its ``WorkerRuntime`` first (engine loaded
    and warmed, so a broken model stops the process before it consumes anything) and passes it here.
    """
    app = Celery("ttsq", set_as_current=False)
    app.conf.update(celery_config(settings, worker=runtime is not None))

    # shared=False: Celery otherwise adds every task to every app made later in this process, and a
    # second app (tests, embedded mode) would run the first app's closure with the first runtime.
    # RedactedRequest: the worker's events (Flower) and inspect replies never carry the text or URL,
    # whatever repr the producer sent. GuardedTask: a message of the wrong shape is dropped, not fatal.
    @app.task(name=TASK_NAME, bind=True, acks_late=True, shared=False,  # type: ignore[untyped-decorator]
              Request="ttsq.events:RedactedRequest", base=GuardedTask)
    def synthesize(self: Any, *args: Any, **kwargs: Any) -> JobResult:
        if args:
            raise InvalidRequest("args", "ttsq.synthesize takes keyword arguments only (kwargs=...)")
        if runtime is None:
            raise RuntimeError("this Celery app was built for a producer; start workers with `ttsq worker`")
        sent_at = self.request.get(SENT_AT_HEADER)
        queue_wait = max(0.0, time.time() - float(sent_at)) if isinstance(sent_at, (int, float)) else None
        claim = self.request.get(CLAIM_HEADER)
        if (self.request.delivery_info or {}).get("redelivered"):
            # A worker died holding it (or it outlived the visibility timeout): the rerun is harmless.
            logger.info("job %s: redelivered", self.request.id)
        try:
            result = runtime.run(kwargs, task_id=self.request.id, queue_wait_s=queue_wait,
                                 claimed_key=claim if isinstance(claim, str) else None)
        except Exception as exc:
            if runtime.stopping:
                # A cold shutdown closed this worker's connections under the job: give the message
                # back (or leave it unacked for redelivery) instead of recording a failure.
                raise Reject(exc, requeue=True) from exc
            raise
        document = self.request.get(DOCUMENT_HEADER)
        if document is not None and documents is not None:
            try:
                documents.chunk_done(document, result, node=runtime.node)
            except Exception as exc:  # progress is for watching: the chunk itself is done and stored
                logger.warning("job %s: could not record document progress: %s", self.request.id, type(exc).__name__)
        return result

    documents = _register_document_tasks(app, runtime) if runtime is not None else None
    return app


def _register_document_tasks(app: Celery, runtime: WorkerRuntime) -> Documents:
    """``ttsq.document`` (fan out into a chord of chunk jobs) and ``ttsq.stitch`` (its body), on workers.
    Producers send ``ttsq.document`` by name and never run either."""
    from celery.signals import task_postrun

    from ttsq.document import Documents, stop_listening

    documents = Documents(app, runtime)

    @app.task(name=DOCUMENT_TASK_NAME, bind=True, acks_late=True, shared=False,  # type: ignore[untyped-decorator]
              Request="ttsq.events:RedactedRequest", base=GuardedTask)
    def document(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise InvalidRequest("args", "ttsq.document takes keyword arguments only (kwargs=...)")
        return documents.fan_out(self, kwargs)

    @task_postrun.connect(sender=app.tasks[TASK_NAME], weak=False)  # type: ignore[untyped-decorator]
    def after_chunk(task_id: str, task: Any, **_: Any) -> None:
        # The worker that finishes a document's last chunk sends the stitch job (Celery's chord
        # join, after the chunk returned), and would then listen for its result forever.
        document = task.request.get(DOCUMENT_HEADER) if task.request is not None else None
        if isinstance(document, dict) and isinstance(document.get("id"), str):
            stop_listening(app.backend, [document["id"]], unless_waited=True)

    @app.task(name=STITCH_TASK_NAME, bind=True, acks_late=True, shared=False,  # type: ignore[untyped-decorator]
              Request="ttsq.events:RedactedRequest", base=GuardedTask)
    def stitch(self: Any, results: Any = None, *, plan: dict[str, Any]) -> Any:
        return documents.stitch(self, results, plan)

    return documents

