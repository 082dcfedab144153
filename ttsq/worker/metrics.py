"""A worker's Prometheus metrics: what its batches, jobs and device are doing.

Each worker process owns one ``Metrics`` (its own registry, no module-level state), served on
``TTSQ_METRICS_PORT``. It is an ``Observer``: the worker and its batcher report to it through the
observer hooks, never by touching the series themselves. Labels carry names chosen by the operator and
fixed outcome words, never request content. Every series, and what the batch series mean for a
continuous engine: docs/deployment.md, "Metrics".
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ttsq.constants import DEFAULT_TENANT
from ttsq.delivery.broker import queue_depth, unacked_by_queue
from ttsq.delivery.envelope import REASONS
from ttsq.observer import OUTCOMES, BatchReport, JobReport, Observer
from ttsq.records.stats import tenant_waits
from ttsq.worker.health import Health, with_health

if TYPE_CHECKING:
    from prometheus_client import Metric

    from ttsq.records.stats import FleetStats

logger = logging.getLogger(__name__)

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Tenants a worker labels its queue-wait series with; more are counted as "other" (bounded series).
MAX_TENANT_LABELS = 64
_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: The minutes of fleet-wide per-tenant waits the tenant series cover (``ttsq stats`` shows 5 too).
TENANT_WAIT_MINUTES = 5
_RTF_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 5)


class Metrics(Observer):
    """One worker's metrics. Recording is thread-safe; serving is optional (``serve``)."""

    def __init__(
        self,
        *,
        node: str = "",
        queues: Sequence[str] = (),
        broker: redis.Redis | None = None,
        stats: FleetStats | None = None,
        gpus: Sequence[str] | None = None,
        deferred: Callable[[str], dict[str, int]] | None = None,
        in_flight: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        """``deferred`` reads a queue's deferred jobs per tenant (``AcceptedJobs.deferred``), ``in_flight``
        the jobs in flight per tenant under the cap (``AcceptedJobs.in_flight``)."""
        self.node = node
        self.registry = CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram("ttsq_batch_size", "Jobs per engine call.", buckets=_BATCH_BUCKETS, registry=r)
        self.synthesis_seconds = Histogram(
            "ttsq_synthesis_seconds", "Engine time per batch, seconds.", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.queue_wait_seconds = Histogram(
            "ttsq_queue_wait_seconds",
            "From the producer's send to the worker's start, per job, by lane and tenant (time deferred counts).",
            ["lane", "tenant"],
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        #: Tenants this worker has labelled a series with: past ``MAX_TENANT_LABELS``, "other".
        self._tenants: set[str] = set()
        self.real_time_factor = Histogram(
            "ttsq_real_time_factor",
            "Engine seconds per second of audio, per batch (lower is faster).",
            buckets=_RTF_BUCKETS,
            registry=r,
        )
        self.time_to_first_audio = Histogram(
            "ttsq_time_to_first_audio_seconds",
            "From the producer's send to a streaming job's first audio in its stream, per job.",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.audio_seconds = Counter("ttsq_audio_seconds", "Seconds of audio synthesized.", registry=r)
        self.device_seconds = Counter("ttsq_device_seconds", "Engine seconds spent in batches.", registry=r)
        self.jobs = Counter("ttsq_jobs", "Jobs this worker finished, by outcome.", ["outcome"], registry=r)
        self.cache_lookups = Counter(
            "ttsq_cache_lookups", "The worker's cache re-check before synthesis.", ["result"], registry=r
        )
        self.truncated_items = Counter("ttsq_truncated_items", "Items the engine cut at the frame cap.", registry=r)
        self.oom_splits = Counter(
            "ttsq_oom_splits", "Batches split in two after a device out-of-memory error.", registry=r
        )
        self.dead_letters = Counter(
            "ttsq_dead_letters", "Messages the envelope gate refused, by reason.", ["reason"], registry=r
        )
        self.duplicates = Counter("ttsq_duplicate_deliveries", "Second copies of a received job, dropped.", registry=r)
        self.recovered = Counter("ttsq_recovered_jobs", "Lost jobs the sweeper sent again.", registry=r)
        self.requeued = Counter(
            "ttsq_requeued_messages", "Messages a dead worker process held, given back by this worker.", registry=r
        )
        self.parked = Counter(
            "ttsq_parked_jobs", "Jobs parked after too many engine calls that never returned.", registry=r
        )
        self.in_progress = Gauge("ttsq_jobs_in_progress", "Jobs this worker holds, waiting or in a batch.", registry=r)
        self._info = Gauge(
            "ttsq_worker_info", "This worker: its node name, engine and model.", ["node", "engine", "model"], registry=r
        )
        # Every label value exists from the start, so a rate() over a fresh worker is 0, not absent.
        for outcome in OUTCOMES:
            self.jobs.labels(outcome=outcome)
        for result in ("hit", "miss"):
            self.cache_lookups.labels(result=result)
        for reason in REASONS:
            self.dead_letters.labels(reason=reason)
        ProcessCollector(registry=r)
        self._queues: _QueueCollector | None = None
        if broker is not None:
            self._queues = _QueueCollector(broker, list(queues), deferred)
            r.register(self._queues)
        if stats is not None and node:
            r.register(_RestartCollector(stats, node))
        if stats is not None:
            r.register(_TenantCollector(stats, in_flight))
        nvml = _NvmlCollector.open(gpus)
        if nvml is not None:
            r.register(nvml)
        self._server: Any = None
        self._lock = threading.Lock()

    def describe(self, *, engine: str, model: str) -> None:
        """Name the engine and model once they are loaded (``worker_info``)."""
        self._info.clear()
        self._info.labels(node=self.node, engine=engine, model=model).set(1)

    def watch_queues(self, queues: Sequence[str]) -> None:
        """Export the depth of these queues (the worker knows them once its model is loaded)."""
        if self._queues is not None:
            self._queues.queues = list(queues)

    # Recording: the observer hooks ------------------------------------------------------------

    def message_refused(self, reason: str) -> None:
        self.dead_letters.labels(reason=reason if reason in REASONS else "celery").inc()

    def duplicate_dropped(self) -> None:
        self.duplicates.inc()

    def job_recovered(self) -> None:
        self.recovered.inc()

    def jobs_requeued(self, count: int) -> None:
        self.requeued.inc(count)

    def job_started(self, task_id: str) -> None:
        self.in_progress.inc()

    def cache_checked(self, *, hit: bool) -> None:
        self.cache_lookups.labels(result="hit" if hit else "miss").inc()

    def job_parked(self, task_id: str) -> None:
        self.parked.inc()

    def batch_finished(self, report: BatchReport) -> None:
        self.batch_size.observe(report.size)
        self.synthesis_seconds.observe(report.seconds)
        self.device_seconds.inc(report.seconds)
        self.audio_seconds.inc(report.audio_s)
        if report.audio_s > 0:
            self.real_time_factor.observe(report.seconds / report.audio_s)
        if report.truncated:
            self.truncated_items.inc(report.truncated)

    def batch_split(self) -> None:
        self.oom_splits.inc()

    def first_audio(self, seconds: float) -> None:
        self.time_to_first_audio.observe(seconds)

    def job_finished(self, report: JobReport) -> None:
        self.in_progress.dec()
        self.jobs.labels(outcome=report.outcome if report.outcome in OUTCOMES else "failed").inc()
        if report.queue_wait_s is not None:
            self.queue_wait_seconds.labels(lane=report.lane, tenant=self._tenant(report.tenant)).observe(
                report.queue_wait_s
            )

    def _tenant(self, tenant: str) -> str:
        """A tenant's label: its name (validated, never a secret) for the first ``MAX_TENANT_LABELS``."""
        name = tenant or DEFAULT_TENANT
        if name not in self._tenants and len(self._tenants) >= MAX_TENANT_LABELS:
            return "other"
        self._tenants.add(name)
        return name

    # Serving -----------------------------------------------------------------------------------

    def serve(self, port: int, address: str = "127.0.0.1", *, health: Callable[[], Health] | None = None) -> int:
        """Serve ``/metrics`` over HTTP on ``address``:``port`` (0: a free one), and with ``health``
        the probe paths of ``ttsq.worker.health``; return the port."""
        app = make_wsgi_app(self.registry)
        with self._lock:
            server = make_server(
                address,
                port,
                app if health is None else with_health(app, health),
                _IPv6Server if ":" in address else _Server,
                handler_class=_QuietHandler,
            )
            threading.Thread(target=server.serve_forever, name="ttsq-metrics", daemon=True).start()
            self._server = server
            return int(server.server_address[1])

    def close(self) -> None:
        """Stop serving."""
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None


class _Server(ThreadingMixIn, WSGIServer):
    """One thread per scrape or probe: a slow Redis read never holds up a liveness probe."""

    daemon_threads = True


class _IPv6Server(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes and probes come every few seconds; they are not news."""


class _QueueCollector(Collector):
    """Queue depth per queue and unacked messages, read from the broker at scrape time."""

    def __init__(
        self, broker: redis.Redis, queues: list[str], deferred: Callable[[str], dict[str, int]] | None
    ) -> None:
        self.queues = queues
        self._redis = broker
        self._deferred = deferred

    def collect(self) -> Iterable[Metric]:
        try:
            # Held first: a message taken between the two reads is then missed once, never counted twice.
            held = unacked_by_queue(self._redis)
            depths = {queue: queue_depth(self._redis, queue) for queue in self.queues}
            deferred = {queue: self._deferred(queue) if self._deferred else {} for queue in self.queues}
        except redis.exceptions.RedisError as exc:  # a scrape must not fail because Redis blinked
            logger.debug("queue depth unavailable: %s", type(exc).__name__)
            yield _broker_up(0)
            return
        yield _broker_up(1)
        depth = GaugeMetricFamily("ttsq_queue_depth", "Messages waiting in the queue.", labels=["queue"])
        outstanding = GaugeMetricFamily(
            "ttsq_outstanding_jobs",
            "Jobs of the queue not yet done: waiting in Redis (in the list or deferred) plus delivered to a worker "
            "and unacked. "
            "The series to scale workers on (every worker exports the same value: aggregate with max).",
            labels=["queue"],
        )
        waiting = GaugeMetricFamily(
            "ttsq_deferred_jobs",
            "Accepted jobs waiting in their tenant's place for release into the queue (fair shares).",
            labels=["queue", "tenant"],
        )
        for queue, value in depths.items():
            depth.add_metric([queue], value)
            outstanding.add_metric([queue], value + held.get(queue, 0) + sum(deferred[queue].values()))
            for tenant, count in sorted(deferred[queue].items()):
                waiting.add_metric([queue, tenant], count)
        yield depth
        yield outstanding
        yield waiting
        yield GaugeMetricFamily(
            "ttsq_unacked_messages",
            "Messages delivered to a worker and not yet acknowledged (all queues).",
            value=sum(held.values()),
        )


def _broker_up(value: int) -> GaugeMetricFamily:
    """Whether this scrape could read the broker's Redis: what an alert on an unreachable Redis watches."""
    return GaugeMetricFamily("ttsq_broker_up", "1 when this scrape could read the broker's Redis, else 0.", value=value)


class _RestartCollector(Collector):
    """How often the launcher restarted this node; the launcher counts it in Redis."""

    def __init__(self, stats: FleetStats, node: str) -> None:
        self.node = node
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        try:
            restarts = self._stats.restarts_of(self.node)
        except redis.exceptions.RedisError:
            return
        family = CounterMetricFamily("ttsq_worker_restarts", "Times the launcher restarted this node.", labels=["node"])
        family.add_metric([self.node], restarts)
        yield family


class _TenantCollector(Collector):
    """The fleet's per-tenant waits (p50, p95) and jobs in flight, read from Redis at scrape time: the
    busiest ``TENANT_ROWS`` tenants by name, the rest as ``other`` (``ttsq.records.stats.tenant_waits``),
    so the label set stays bounded. Every worker exports the same values: aggregate with max."""

    def __init__(self, stats: FleetStats, in_flight: Callable[[], dict[str, int]] | None) -> None:
        self._stats = stats
        self._in_flight = in_flight

    def collect(self) -> Iterable[Metric]:
        try:
            waits = self._stats.waits(TENANT_WAIT_MINUTES)
            flying = self._in_flight() if self._in_flight is not None else {}
        except redis.exceptions.RedisError as exc:  # a scrape must not fail because Redis blinked
            logger.debug("tenant waits unavailable: %s", type(exc).__name__)
            return
        minutes = f"the fleet's last {TENANT_WAIT_MINUTES} minutes"
        wait = GaugeMetricFamily(
            "ttsq_tenant_wait_seconds",
            f"Accept to a worker's start per tenant, {minutes}.",
            labels=["tenant", "quantile"],
        )
        jobs = GaugeMetricFamily("ttsq_tenant_jobs", f"Jobs started per tenant, {minutes}.", labels=["tenant"])
        in_flight = GaugeMetricFamily(
            "ttsq_tenant_in_flight_jobs", "Jobs per tenant sent and not finished, under the cap.", labels=["tenant"]
        )
        for row in tenant_waits(waits, flying):
            if row["jobs"]:
                wait.add_metric([row["tenant"], "0.5"], row["wait_p50_s"])
                wait.add_metric([row["tenant"], "0.95"], row["wait_p95_s"])
            jobs.add_metric([row["tenant"]], row["jobs"])
            in_flight.add_metric([row["tenant"]], row["in_flight"])
        yield from (wait, jobs, in_flight)


class _NvmlCollector(Collector):
    """GPU utilisation and memory through NVML, for the devices this worker is pinned to."""

    def __init__(self, nvml: Any, handles: list[tuple[str, Any]]) -> None:
        self._nvml = nvml
        self._handles = handles

    @classmethod
    def open(cls, gpus: Sequence[str] | None) -> _NvmlCollector | None:
        """A collector, or None where NVML (``nvidia-ml-py`` plus a driver) is not available."""
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            wanted = [str(i) for i in range(count)] if gpus is None else list(gpus)
            handles = [(device, _nvml_handle(pynvml, device)) for device in wanted]
        except Exception as exc:  # no driver, no GPU: NVML says so with its own error class
            logger.debug("NVML not available: %s", exc)
            return None
        return cls(pynvml, handles) if handles else None

    def collect(self) -> Iterator[Metric]:
        util = GaugeMetricFamily(
            "ttsq_gpu_utilization_ratio", "GPU busy fraction over the last sample (NVML).", labels=["device"]
        )
        used = GaugeMetricFamily("ttsq_gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["device"])
        total = GaugeMetricFamily("ttsq_gpu_memory_total_bytes", "GPU memory (NVML).", labels=["device"])
        for device, handle in self._handles:
            try:
                rates = self._nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = self._nvml.nvmlDeviceGetMemoryInfo(handle)
            except Exception:
                continue
            util.add_metric([device], rates.gpu / 100.0)
            used.add_metric([device], memory.used)
            total.add_metric([device], memory.total)
        yield from (util, used, total)


def _nvml_handle(pynvml: Any, device: str) -> Any:
    """CUDA_VISIBLE_DEVICES entries are indexes or UUIDs (``GPU-...``); NVML takes either."""
    if device.isdigit():
        return pynvml.nvmlDeviceGetHandleByIndex(int(device))
    return pynvml.nvmlDeviceGetHandleByUUID(device)
