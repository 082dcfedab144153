"""The composition root of one worker process: builds its collaborators, starts and stops them.

``WorkerRuntime`` lives once per worker process. It builds the engine, the batcher (whose one thread
is the only one that touches the engine), storage, the records in Redis, the observers and the job
``Pipeline`` (``ttsq.worker.pipeline``, which runs each job), then starts them, keeps the worker's
heartbeat, answers the health probes and closes everything in order. It runs no job itself.

Before it consumes, a worker makes sure of what it stands on: its object store exists (a missing bucket
ends the process with one line naming ``TTSQ_STORAGE_URL``, instead of failing every job), and its model
is the one the live workers on its queue serve (one queue, one model: ``FleetConflict`` otherwise).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import redis

import ttsq.tracing as tracing
from ttsq.app import queue_for, queues_for
from ttsq.batching.batcher import Batcher
from ttsq.constants import HEARTBEAT_INTERVAL_S, STORAGE_CHECK_INTERVAL_S, WORKER_REDIS_PATIENCE_S
from ttsq.delivery.broker import queued_within
from ttsq.engines import create_engine
from ttsq.engines.base import worst_batch_s
from ttsq.errors import ConfigError, FleetConflict, StorageError
from ttsq.job import Limits
from ttsq.observer import Observers
from ttsq.records.connection import within
from ttsq.records.owner import RedisOwner
from ttsq.records.stats import FleetObserver, worker_info
from ttsq.redaction import redact_task_logs
from ttsq.results import Results
from ttsq.storage import open_storage
from ttsq.worker.encoding import Encoders
from ttsq.worker.health import Health, Recheck
from ttsq.worker.lanes import Releaser
from ttsq.worker.metrics import Metrics
from ttsq.worker.pipeline import Pipeline
from ttsq.worker.sweeper import Sweeper
from ttsq.worker.watchdog import Watchdog

if TYPE_CHECKING:
    from celery import Celery

    from ttsq.config import Settings
    from ttsq.engines.base import Engine
    from ttsq.records.identities import Rival

logger = logging.getLogger(__name__)

#: How long the batcher (and a health probe) waits for Redis to say how many jobs are queued, and how
#: long the batcher then goes without asking after Redis did not answer: a batch never waits on a
#: broker that is down.
BACKLOG_TIMEOUT_S = 0.2
BACKLOG_RETRY_S = 5.0


class WorkerRuntime:
    """Builds, starts and stops everything one worker process runs on; ``pipeline`` runs its jobs."""

    def __init__(
        self, settings: Settings, *, node: str | None = None, device: str = "", gpus: list[str] | None = None
    ) -> None:
        self.settings = settings
        # Here, on the thread that starts the worker, not in ``worker_process_init`` (never fired
        # under the threads pool): OTEL_* decides whether this process traces (``ttsq.tracing``).
        tracing.setup("ttsq-worker")
        #: Celery node name; it names this worker in results, heartbeats and metrics.
        self.node = node or f"{settings.engine}@{socket.gethostname()}"
        #: The device this worker is pinned to ("" for CPU), as shown by ``ttsq stats``.
        self.device = device
        self.limits = Limits.from_settings(settings)
        self.engine = create_engine(settings)
        _check_batch_limit(settings, self.engine)
        self.storage = open_storage(settings)
        #: This process's one client per Redis database, and the records on them. A worker rides out a
        #: Redis restart instead of failing the jobs it holds.
        self.redis = RedisOwner(settings, role="worker", patience_s=WORKER_REDIS_PATIENCE_S)
        self.cache = self.redis.cache_index
        self.ledger = self.redis.attempts
        #: What producers accepted: the gate marks jobs received, tasks finish them, the sweeper re-sends.
        self.accepted = self.redis.accepted
        self.stats = self.redis.stats
        self.results = Results(settings, lambda: self.storage, worker=self.node)
        self.metrics = Metrics(
            node=self.node,
            broker=self.redis.broker,
            stats=self.stats,
            gpus=gpus,
            deferred=self.redis.accepted.deferred,
            in_flight=lambda: self.redis.accepted.in_flight(self.settings.queue),
        )
        self.fleet = FleetObserver(self.stats)
        #: Everything that counts or exports what happens to a job listens here (``ttsq.observer``).
        self.observer = Observers([self.metrics, self.fleet, *([tracing.TraceObserver()] if tracing.enabled() else [])])
        self._backlog_failed_at = -BACKLOG_RETRY_S
        #: Encodes finished audio; the batcher reads its backlog (``ttsq.worker.encoding``).
        self.encoders = Encoders(settings.encode_threads)
        self.batcher = Batcher(
            self.engine,
            max_batch=settings.max_batch,
            max_wait_s=settings.max_wait_ms / 1000,
            observer=self.observer,
            backlog=self._backlog,
            downstream=self.encoders.busy_s,
        )
        #: Runs each ``ttsq.synthesize`` job: re-check, batch, store, index (``ttsq.worker.pipeline``).
        self.pipeline = Pipeline(
            settings,
            limits=self.limits,
            engine=self.engine,
            batcher=self.batcher,
            storage=self.storage,
            cache=self.cache,
            ledger=self.ledger,
            results=self.results,
            observer=self.observer,
            streams=self.redis.streams,
            accepted=self.accepted,
            encoders=self.encoders,
        )
        #: The cache database, for what the document stitch keeps there (``ttsq.worker.documents``).
        self.documents_redis = self.redis.cache
        self._started_at = time.time()
        self.watchdog = Watchdog(self.batcher, limit_s=settings.batch_limit_s)
        #: Sends lost jobs again through the worker's own app, once it has one (``sweep``).
        self.sweeper: Sweeper | None = None
        self.releaser: Releaser | None = None
        self._stopping = threading.Event()
        #: Set once the engine is loaded and warm and the worker is about to consume.
        self._warm = threading.Event()
        #: Set while another model holds this worker's queue (it took over while this worker was silent).
        self._displaced = threading.Event()
        self._storage_ready = Recheck("storage", self.storage.check, every_s=STORAGE_CHECK_INTERVAL_S)
        self._stats_beat = threading.Thread(target=self._beat, name="ttsq-beat", daemon=True)

    def _beat(self) -> None:
        """While this worker lives: keep its heartbeat fresh (``ttsq stats`` lists live workers from it)
        and re-announce its model (producers forget the modes of a worker that falls silent)."""
        while not self._stopping.is_set():
            self._quietly(self._send_heartbeat)
            self._quietly(self._announce)
            self._stopping.wait(HEARTBEAT_INTERVAL_S)

    def _announce(self) -> None:
        """Re-announce the model, unless another model took the queue over while this worker was silent
        (past ``FLEET_LIVE_S``): then stay silent and unready, and say so once."""
        rival = self.redis.identities.claim(self.settings.queue, self.node, self.engine.identity.to_dict())
        if rival is None:
            if self._displaced.is_set():
                logger.info("this worker's model serves its queue again")
            self._displaced.clear()
        elif not self._displaced.is_set():
            self._displaced.set()
            logger.error("%s; stop this worker", self._conflict(rival))

    def _send_heartbeat(self) -> None:
        self.stats.heartbeat(
            self.node,
            worker_info(
                node=self.node,
                engine=self.settings.engine,
                model=self.engine.identity.model,
                device=self.device,
                started_at=self._started_at,
                jobs=self.fleet.jobs,
            ),
        )

    @staticmethod
    def _quietly(call: Any) -> None:
        """Statistics are best effort: a Redis hiccup must not fail a job or a shutdown."""
        try:
            call()
        except Exception as exc:
            logger.warning("could not update fleet statistics: %s", type(exc).__name__)

    def health(self) -> Health:
        """Alive and ready, for the probes on the metrics port (``ttsq.worker.health``)."""
        if not self._warm.is_set():
            # Loading: alive (a model load takes minutes), not ready. A load that fails ends the process.
            return Health(checks={"engine": False})
        dead = self.watchdog.check()
        if self.stopping and not self.batcher.alive:
            dead = None  # close() stopped it: a drain that has finished, not a death
        try:
            redis_ok = within(self.redis.broker, BACKLOG_TIMEOUT_S, ("PING",)) == ["PONG"]
        except redis.RedisError:
            redis_ok = False
        checks = {
            "engine": dead is None,
            "redis": redis_ok,
            "storage": self._storage_ready(),
            "fleet": not self._displaced.is_set(),
            "accepting": not self.stopping,
        }
        return Health(dead=dead, checks=checks)

    @property
    def stopping(self) -> bool:
        """Whether ``close`` has begun: a job failing now failed because of the shutdown, not itself."""
        return self._stopping.is_set()

    @property
    def queues(self) -> list[str]:
        """The queues of the modes this worker's model serves, every lane, interactive first."""
        return queues_for(self.settings.queue, self.engine.identity.modes)

    def _backlog(self) -> int:
        """Jobs waiting in this worker's queues in Redis, for the batcher; 0 when Redis does not answer
        at once (the batcher then goes by the arrivals it has seen)."""
        if time.monotonic() - self._backlog_failed_at < BACKLOG_RETRY_S:
            return 0  # Redis did not answer a moment ago: no batch waits on it again so soon
        try:
            return queued_within(self.redis.broker, self.queues, BACKLOG_TIMEOUT_S)
        except redis.RedisError:
            self._backlog_failed_at = time.monotonic()
            return 0

    def start(self) -> None:
        """Check the object store, load and warm the engine (on the batcher thread), then claim the
        queue for the model and announce it to producers. ``ConfigError`` when the store does not
        exist, ``FleetConflict`` when another model serves the queue: nothing was consumed."""
        started = time.perf_counter()
        redact_task_logs()
        try:
            self.storage.check()  # before minutes of loading weights; a missing bucket is ConfigError
        except StorageError as exc:  # unreachable for now: a worker rides out an outage, unready meanwhile
            logger.warning("storage unreachable at start, not ready until it answers: %s", exc)
        self.batcher.start()
        self.watchdog.start()
        identity = self.engine.identity
        rival = self.redis.identities.claim(self.settings.queue, self.node, identity.to_dict())
        if rival is not None:
            self._abandon()
            raise FleetConflict("TTSQ_QUEUE", self._conflict(rival))
        self.metrics.describe(engine=self.settings.engine, model=identity.model)
        self.metrics.watch_queues(self.queues)
        self._started_at = time.time()
        self._stats_beat.start()
        self._warm.set()
        logger.info(
            "engine %s ready in %.2fs (model %s, revision %s, max_batch %d)",
            self.settings.engine,
            time.perf_counter() - started,
            identity.model,
            identity.revision,
            self.settings.max_batch,
        )

    def _conflict(self, rival: Rival) -> str:
        """One line naming both models and what to do about it."""
        mine = self.engine.identity
        shared = [mode for mode in mine.modes if mode in rival.identity.get("modes", ())]
        queues = ", ".join(queue_for(self.settings.queue, mode) for mode in shared)
        return (
            f"queue {queues} is served by {_named(rival.identity)} on the live worker {rival.node}; "
            f"this worker runs {_named(mine.to_dict())}. One queue serves one model: give this worker "
            "another TTSQ_QUEUE, or stop every worker of the old model first (docs/deployment.md)"
        )

    def _abandon(self) -> None:
        """Undo a start that announced nothing: stop the threads it started, close its connections."""
        self._stopping.set()
        self.watchdog.stop()
        self.batcher.stop()
        self.metrics.close()
        self.redis.close()

    def sweep(self, app: Celery) -> None:
        """Start the sweeper (``ttsq.worker.sweeper``) and the releaser (``ttsq.worker.lanes``): lost jobs
        and released ones go out through ``app``, the worker's own."""
        self.sweeper = Sweeper(app, self.settings, self.redis, self.observer, node=self.node)
        self.sweeper.start()
        # Tenants' deferred jobs go into this worker's queues as they have room (``ttsq.worker.lanes``).
        self.releaser = Releaser(app, self.settings, self.accepted, self.queues)
        self.releaser.start()

    def close(self) -> None:
        """Finish queued batches, release the engine and connections."""
        self._stopping.set()
        self.watchdog.stop()
        if self.sweeper is not None:
            self.sweeper.stop()
        if self.releaser is not None:
            self.releaser.stop()
        self.batcher.stop()
        self.pipeline.close()
        self._quietly(self.ledger.flush_refunds)
        if self._stats_beat.is_alive():
            self._stats_beat.join(timeout=HEARTBEAT_INTERVAL_S + 5)
        self._quietly(self.fleet.close)
        self._quietly(lambda: self.stats.forget(self.node))
        self._quietly(lambda: self.redis.identities.leave(self.settings.queue, self.node))
        self.metrics.close()
        self.redis.close()
        tracing.flush()  # the last jobs' spans, before the process ends


def _check_batch_limit(settings: Settings, engine: Engine) -> None:
    """Refuse settings under which a full batch of the longest texts outlasts the per-batch limit: the
    watchdog would end a healthy worker as stuck, and its jobs, sent again, would end the next one."""
    worst = worst_batch_s(engine, settings.max_batch, settings.max_text_chars)
    if worst is not None and worst > settings.batch_limit_s:
        raise ConfigError(
            "TTSQ_BATCH_TIMEOUT_S",
            f"a full batch ({settings.max_batch} texts of up to {settings.max_text_chars} characters) takes up "
            f"to {worst:.1f} s on the {settings.engine} engine, past the per-batch limit of "
            f"{settings.batch_limit_s:.1f} s that ends a worker as stuck; raise TTSQ_JOB_TIMEOUT_S (the limit "
            "is half of it by default), or lower TTSQ_MAX_BATCH or TTSQ_MAX_TEXT_CHARS",
        )


def _named(identity: dict[str, Any]) -> str:
    """An identity as a person reads it: engine, model, revision and sample rate."""
    return (
        f"engine {identity.get('engine')}, model {identity.get('model')} "
        f"(revision {identity.get('revision')}, {identity.get('sample_rate')} Hz)"
    )
