"""What a worker does with one job: re-check, batch, encode, store, index.

``WorkerRuntime`` lives once per worker process. Task threads call ``run``; the batcher thread is the
only one that touches the engine. The order of the stages is the delivery guarantee:

1. validate the kwargs again (a raw ``send_task`` never met the producer's checks);
2. re-check the cache: the message may be a redelivery of a job that already finished;
   then drop a job past its deadline, and park a job whose engine call has failed to return
   ``max_attempts`` times (it kills or hangs workers; see ``ttsq.records.attempts``);
3. synthesize in a batch (a job with an engine call that never returned runs alone);
4. encode and ``put`` the object (idempotent: same key, same audio);
5. write the index entry last, so the index never points at a missing object;
6. release the single-flight claim and return; Celery acks after the return.

A worker killed anywhere in 3-6 has its message redelivered, and the rerun is harmless.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import redis

from ttsq.app import queue_for
from ttsq.audio import encode, probe
from ttsq.batching.batcher import Batcher
from ttsq.batching.jobs import Expected
from ttsq.constants import HEARTBEAT_INTERVAL_S, WORKER_REDIS_PATIENCE_S
from ttsq.engines import create_engine
from ttsq.errors import DeadlineExceeded, InvalidRequest, JobParked, JobTimeout
from ttsq.job import JobResult, Limits, StoredAudio, SynthesisRequest, Timings, no_timings
from ttsq.keys import content_key, object_key
from ttsq.observer import JobReport, Observers
from ttsq.records.accepted import AcceptedJobs
from ttsq.records.attempts import Ledger, ParkedJob
from ttsq.records.cache import CacheIndex
from ttsq.records.connection import connect
from ttsq.records.queues import queue_depth
from ttsq.records.stats import FleetObserver, FleetStats, worker_info
from ttsq.redaction import redact_task_logs
from ttsq.results import Results
from ttsq.storage import open_storage
from ttsq.worker.health import Health
from ttsq.worker.metrics import Metrics
from ttsq.worker.sweeper import Sweeper
from ttsq.worker.watchdog import Watchdog

if TYPE_CHECKING:
    from ttsq.config import Settings

logger = logging.getLogger(__name__)

#: How long the batcher waits for Redis to say how many jobs are queued, and how long it then goes
#: without asking after Redis did not answer: a batch never waits on a broker that is down.
BACKLOG_TIMEOUT_S = 0.2
BACKLOG_RETRY_S = 5.0


class WorkerRuntime:
    """Engine, batcher, storage and cache index of one worker process."""

    def __init__(
        self, settings: Settings, *, node: str | None = None, device: str = "", gpus: list[str] | None = None
    ) -> None:
        self.settings = settings
        #: Celery node name; it names this worker in results, heartbeats and metrics.
        self.node = node or f"{settings.engine}@{socket.gethostname()}"
        #: The device this worker is pinned to ("" for CPU), as shown by ``ttsq stats``.
        self.device = device
        self.limits = Limits.from_settings(settings)
        self.engine = create_engine(settings)
        self.storage = open_storage(settings)
        # A worker rides out a Redis restart instead of failing the jobs it holds.
        self.cache = CacheIndex(settings.cache_url, ttl_s=settings.cache_ttl_s, patience_s=WORKER_REDIS_PATIENCE_S)
        self.ledger = Ledger(settings.cache_url, ttl_s=settings.inflight_ttl_s, patience_s=WORKER_REDIS_PATIENCE_S)
        #: What producers accepted: the gate marks jobs received, tasks finish them, the sweeper re-sends.
        self.accepted = AcceptedJobs(settings.cache_url, patience_s=WORKER_REDIS_PATIENCE_S)
        self.stats = FleetStats(settings.cache_url)
        self.results = Results(settings, lambda: self.storage, worker=self.node)
        self.metrics = Metrics(node=self.node, broker_url=settings.broker_url, cache_url=settings.cache_url, gpus=gpus)
        self.fleet = FleetObserver(self.stats, self.cache)
        #: Everything that counts or exports what happens to a job listens here (``ttsq.observer``).
        self.observer = Observers([self.metrics, self.fleet])
        # Read by the batcher thread while a batch that is not full decides whether to wait for more.
        self._broker = connect(settings.broker_url, socket_timeout=BACKLOG_TIMEOUT_S, connect_timeout=BACKLOG_TIMEOUT_S)
        self._backlog_failed_at = -BACKLOG_RETRY_S
        self.batcher = Batcher(
            self.engine,
            max_batch=settings.max_batch,
            max_wait_s=settings.max_wait_ms / 1000,
            observer=self.observer,
            backlog=self._backlog,
        )
        self._started_at = time.time()
        self.watchdog = Watchdog(self.batcher, limit_s=settings.batch_limit_s)
        self.sweeper = Sweeper(settings, self.accepted, self.observer, node=self.node)
        self._stopping = threading.Event()
        #: Set once the engine is loaded and warm and the worker is about to consume.
        self._warm = threading.Event()
        self._stats_beat = threading.Thread(target=self._beat, name="ttsq-beat", daemon=True)

    def _beat(self) -> None:
        """While this worker lives: keep its heartbeat fresh (``ttsq stats`` lists live workers from it)
        and re-announce its model (producers forget the modes of a worker that falls silent)."""
        while not self._stopping.is_set():
            self._quietly(self._send_heartbeat)
            self._quietly(lambda: self.cache.publish_identity(self.settings.queue, self.engine.identity.to_dict()))
            self._stopping.wait(HEARTBEAT_INTERVAL_S)

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
            redis_ok = bool(self._broker.ping())
        except redis.RedisError:
            redis_ok = False
        return Health(dead=dead, checks={"engine": dead is None, "redis": redis_ok, "accepting": not self.stopping})

    @property
    def stopping(self) -> bool:
        """Whether ``close`` has begun: a job failing now failed because of the shutdown, not itself."""
        return self._stopping.is_set()

    @property
    def queues(self) -> list[str]:
        """The queues of the modes this worker's model serves."""
        return [queue_for(self.settings.queue, mode) for mode in self.engine.identity.modes]

    def _backlog(self) -> int:
        """Jobs waiting in this worker's queues in Redis, for the batcher; 0 when Redis does not answer
        at once (the batcher then goes by the arrivals it has seen)."""
        if time.monotonic() - self._backlog_failed_at < BACKLOG_RETRY_S:
            return 0  # Redis did not answer a moment ago: no batch waits on it again so soon
        try:
            return sum(queue_depth(self._broker, queue) for queue in self.queues)
        except redis.RedisError:
            self._backlog_failed_at = time.monotonic()
            return 0

    def start(self) -> None:
        """Load and warm the engine (on the batcher thread), then announce the model to producers."""
        started = time.perf_counter()
        redact_task_logs()
        self.batcher.start()
        self.watchdog.start()
        identity = self.engine.identity
        self.cache.publish_identity(self.settings.queue, identity.to_dict())
        self.metrics.describe(engine=self.settings.engine, model=identity.model)
        self.metrics.watch_queues(self.queues)
        self._started_at = time.time()
        self._stats_beat.start()
        self.sweeper.start()
        self._warm.set()
        logger.info(
            "engine %s ready in %.2fs (model %s, revision %s, max_batch %d)",
            self.settings.engine,
            time.perf_counter() - started,
            identity.model,
            identity.revision,
            self.settings.max_batch,
        )

    def close(self) -> None:
        """Finish queued batches, release the engine and connections."""
        self._stopping.set()
        self.watchdog.stop()
        self.sweeper.stop()
        self.batcher.stop()
        if self._stats_beat.is_alive():
            self._stats_beat.join(timeout=HEARTBEAT_INTERVAL_S + 5)
        self._quietly(lambda: self.stats.forget(self.node))
        self.metrics.close()
        self.stats.close()
        self.cache.close()
        self.ledger.close()
        self.accepted.close()
        self._broker.close()

    def run(
        self, kwargs: dict[str, Any], *, task_id: str, queue_wait_s: float | None, claimed_key: str | None = None
    ) -> JobResult:
        """Run one job to a stored, indexed result.

        ``claimed_key`` is the key the producer claimed for this job; it is released however the job
        ends, even if this worker rejects the request or computes another key (another model).
        """
        key = claimed_key
        started = time.perf_counter()
        outcome, result, written = "failed", None, False
        self.observer.job_started(task_id)
        # A batch that is not full may wait for this job while it is checked (cache, ledger).
        expected = self.batcher.expect()
        try:
            request = SynthesisRequest.from_dict(kwargs, self.limits)
            self.engine.identity.check(request)  # a raw send_task may name a mode, speaker or language we lack
            key = content_key(request, self.engine.identity)
            stored = self.cache.get(key)
            self.observer.cache_checked(hit=stored is not None)
            if stored is not None:
                logger.info("job %s: cache hit %s", task_id, key[:12])
                timings = no_timings()
                timings["queue_wait_s"] = round(queue_wait_s or 0.0, 4)
                result = self.results.job(key, stored, cached=True, timings=timings)
                outcome = "cached"
            else:
                if request.expired():
                    raise DeadlineExceeded(
                        f"deadline passed {time.time() - (request.deadline or 0):.1f}s before "
                        "synthesis; the job was dropped"
                    )
                attempts = self.ledger.attempts(task_id)
                if attempts >= self.settings.max_attempts:
                    self._park(kwargs, request, task_id, attempts)
                result, written = self._synthesize(
                    request, key, task_id=task_id, queue_wait_s=queue_wait_s, isolated=attempts > 0, expected=expected
                )
                outcome = "synthesized"
            # Signed and ready: what is left (claim release, result store) belongs to the round trip.
            result["timings"]["worker_s"] = round(time.perf_counter() - started, 4)
            return result
        except InvalidRequest:
            outcome = "invalid"
            raise
        except JobTimeout:
            outcome = "timeout"
            raise
        finally:
            expected.done()  # it never reached the batcher (a cache hit, a refusal): nothing to wait for
            self.observer.job_finished(
                JobReport(task_id=task_id, outcome=outcome, queue_wait_s=queue_wait_s, result=result, written=written)
            )
            # Success or failure, this job no longer produces the key: let the next submit try.
            for claimed in {k for k in (key, claimed_key) if k is not None}:
                self.cache.release(claimed, task_id)

    def _park(self, kwargs: dict[str, Any], request: SynthesisRequest, task_id: str, attempts: int) -> None:
        error = (
            f"job {task_id} was in {attempts} engine calls that never returned (it crashed or hung its "
            f"worker each time); parked: `ttsq failed` lists it, `ttsq retry {task_id}` re-queues it"
        )
        queue = queue_for(self.settings.queue, request.mode)  # where `ttsq retry` sends it back
        self.ledger.park(
            ParkedJob(id=task_id, queue=queue, kwargs=kwargs, attempts=attempts, error=error, parked_at=time.time())
        )
        self.observer.job_parked(task_id)
        logger.error("job %s parked after %d unfinished attempts", task_id, attempts)
        raise JobParked(error)

    def _synthesize(
        self,
        request: SynthesisRequest,
        key: str,
        *,
        task_id: str,
        queue_wait_s: float | None,
        isolated: bool = False,
        expected: Expected | None = None,
    ) -> tuple[JobResult, bool]:
        """The job's result, and whether this run wrote its object (an earlier run may have)."""
        queued = time.perf_counter()
        # A job that was in an engine call that never returned runs alone: if it is the one that
        # crashes workers, it takes no neighbour down with it this time.
        future = self.batcher.submit(
            request,
            isolated=isolated,
            on_enter=lambda: self.ledger.charge(task_id),
            on_exit=lambda: self.ledger.refund(task_id),
        )
        if expected is not None:
            expected.done()  # after the hand-over, so the batcher always sees it on its way or arrived
        try:
            item = future.result(timeout=self.settings.job_timeout_s)
        except FutureTimeout:
            self.batcher.abandon(future)  # not waiting any more, nor holding a slot
            raise JobTimeout(f"no batch finished this job within {self.settings.job_timeout_s}s") from None

        started = time.perf_counter()
        # Everything in the batcher that was not the forward pass: filling, and waiting behind a batch.
        batch_wait_s = max(0.0, started - queued - item.synthesis_s)
        audio = encode(item.output.samples, item.output.sample_rate, request.format)
        encoded = time.perf_counter()
        target = object_key(key, request.format)
        written = self.storage.put(target, audio.data, audio.content_type)
        if not written:
            # An earlier run of this key stored its object first (a redelivery, or a claim that expired).
            # A sampling model does not repeat itself byte for byte: index what is stored, not this run.
            audio = probe(self.storage.get(target), request.format)
        uploaded = time.perf_counter()

        identity = self.engine.identity
        stored = StoredAudio(
            object_key=target,
            format=request.format,
            content_type=audio.content_type,
            sample_rate=audio.sample_rate,
            duration_s=audio.duration_s,
            bytes=len(audio.data),
            engine=identity.engine,
            model=identity.model,
            model_revision=identity.revision,
            truncated=item.output.truncated,
            ignored=list(item.output.ignored),
        )
        self.cache.put(key, stored)  # last: the index never points at an object that is not there
        indexed = time.perf_counter()
        logger.info(
            "job %s: synthesized %s in batch %d of %d (%.2fs audio)",
            task_id,
            key[:12],
            item.batch_id,
            item.batch_size,
            audio.duration_s,
        )
        timings = Timings(
            queue_wait_s=round(queue_wait_s or 0.0, 4),
            batch_wait_s=round(batch_wait_s, 4),
            synthesis_s=round(item.synthesis_s, 4),
            device_s=round(item.device_s, 4),
            encode_s=round(encoded - started, 4),
            upload_s=round(uploaded - encoded, 4),
            index_s=round(indexed - uploaded, 4),
            worker_s=0.0,
        )
        return self.results.job(key, stored, cached=False, batch_size=item.batch_size, timings=timings), written
