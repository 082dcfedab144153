"""Fleet statistics in Redis: per-minute job counters, worker heartbeats, launcher restarts.

Prometheus scrapes each worker; this is the view any host can read without Prometheus (``ttsq
stats``, ``ttsq.ops.fleet``): the counters every worker (and every producer, for its cache hits) adds to
``ttsq:minute:<unix minute>``, and the heartbeats of live workers. ``FleetObserver`` is the worker's
observer that feeds them. Nothing here holds request content.

Per-tenant waits (a job's accept to a worker's start, time waiting in its tenant's place included) are
kept the same way, per minute, as counts in log-spaced buckets per tenant (``ttsq:waits:<unix minute>``):
``ttsq stats`` and each worker's metrics read the p50 and p95 of the busiest tenants back from them
(``tenant_waits``), every other tenant folded into ``other``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ttsq.constants import (
    DEFAULT_TENANT,
    HEARTBEAT_TTL_S,
    MINUTE_PREFIX,
    MINUTE_STATS_TTL_S,
    RESTARTS_KEY,
    TENANT_PATTERN,
    WAITS_PREFIX,
    WORKER_PREFIX,
)
from ttsq.observer import JobReport, Observer

if TYPE_CHECKING:
    from collections.abc import Mapping

    import redis

logger = logging.getLogger(__name__)

#: Integer counters of a minute bucket.
COUNTS = ("synthesized", "cached_worker", "cached_producer", "invalid", "failed", "timeout")
#: Float sums of a minute bucket (seconds).
SECONDS = ("audio_s", "device_s")
#: How often a worker writes the counts of the jobs it finished (``FleetObserver``).
FLUSH_INTERVAL_S = 1.0
#: Wait buckets: bucket i counts waits up to ``WAIT_BASE_S * WAIT_GROWTH ** i`` seconds (bucket 0: up to
#: ``WAIT_BASE_S``), the last one anything longer: a quantile read back is within a fifth of the truth,
#: from a millisecond to about a day, in at most ``WAIT_BUCKETS`` fields per tenant and minute.
WAIT_BASE_S = 0.001
WAIT_GROWTH = 1.2
WAIT_BUCKETS = 100
#: Tenants a worker writes waits for by name in one minute; the rest count as ``OTHER_TENANT``, so a
#: minute's hash stays bounded whatever tenant names arrive.
WAIT_TENANTS_PER_MINUTE = 1000
#: Tenants ``ttsq stats`` and the metrics show by name, the busiest first; the rest are one row, ``other``.
TENANT_ROWS = 10
OTHER_TENANT = "other"


class FleetStats:
    """Reads and writes the fleet's statistics in the cache Redis."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    # Writing -----------------------------------------------------------------------------------

    def record(self, *, now: float | None = None, **amounts: float) -> None:
        """Add to this minute's counters (names from ``COUNTS`` and ``SECONDS``)."""
        key = MINUTE_PREFIX + str(int((now or time.time()) // 60))
        with self._redis.pipeline(transaction=False) as pipe:
            for name, amount in amounts.items():
                if name in COUNTS:
                    pipe.hincrby(key, name, int(amount))
                elif name in SECONDS:
                    pipe.hincrbyfloat(key, name, float(amount))
                else:
                    raise ValueError(f"unknown statistic {name!r}")
            pipe.expire(key, MINUTE_STATS_TTL_S)
            pipe.execute()

    def record_waits(self, counts: Mapping[str, int], *, now: float | None = None) -> None:
        """Add to this minute's wait buckets: ``counts`` maps ``"<bucket>|<tenant>"`` to jobs."""
        key = WAITS_PREFIX + str(int((now or time.time()) // 60))
        with self._redis.pipeline(transaction=False) as pipe:
            for field, jobs in counts.items():
                pipe.hincrby(key, field, int(jobs))
            pipe.expire(key, MINUTE_STATS_TTL_S)
            pipe.execute()

    def heartbeat(self, node: str, info: dict[str, Any]) -> None:
        """Announce a live worker; the entry expires unless renewed."""
        self._redis.set(WORKER_PREFIX + node, json.dumps(info, sort_keys=True), ex=HEARTBEAT_TTL_S)

    def forget(self, node: str) -> None:
        """A worker stopped cleanly: drop its heartbeat at once."""
        self._redis.delete(WORKER_PREFIX + node)

    def record_restart(self, node: str) -> int:
        """Count one launcher restart of ``node``; return its total."""
        return int(self._redis.hincrby(RESTARTS_KEY, node, 1))

    # Reading -----------------------------------------------------------------------------------

    def window(self, minutes: int, *, now: float | None = None) -> dict[str, float]:
        """Counters summed over the last ``minutes`` minutes (the current one included)."""
        current = int((now or time.time()) // 60)
        keys = [MINUTE_PREFIX + str(m) for m in range(current - minutes + 1, current + 1)]
        with self._redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hgetall(key)
            buckets: list[dict[str, str]] = pipe.execute()
        totals: dict[str, float] = {name: 0 for name in COUNTS}
        totals.update({name: 0.0 for name in SECONDS})
        for bucket in buckets:
            for name, value in bucket.items():
                if name in totals:
                    totals[name] += int(value) if name in COUNTS else float(value)
        return totals

    def waits(self, minutes: int, *, now: float | None = None) -> dict[str, dict[int, int]]:
        """Wait buckets per tenant over the last ``minutes`` minutes (the current one included): tenant ->
        bucket -> jobs. A field that is not one ttsq writes (a tenant name outside ``TENANT_PATTERN``
        among them: what is read back is printed) is skipped."""
        current = int((now or time.time()) // 60)
        with self._redis.pipeline(transaction=False) as pipe:
            for minute in range(current - minutes + 1, current + 1):
                pipe.hgetall(WAITS_PREFIX + str(minute))
            buckets: list[dict[str, str]] = pipe.execute()
        out: dict[str, dict[int, int]] = {}
        for bucket in buckets:
            for field, jobs in bucket.items():
                index, _, tenant = str(field).partition("|")
                try:
                    at, count = int(index), int(jobs)
                except ValueError:
                    continue
                if TENANT_PATTERN.fullmatch(tenant) and 0 <= at < WAIT_BUCKETS and count > 0:
                    per_tenant = out.setdefault(tenant, {})
                    per_tenant[at] = per_tenant.get(at, 0) + count
        return out

    def workers(self) -> list[dict[str, Any]]:
        """Heartbeats of the workers alive now, by node name."""
        keys = sorted(self._redis.scan_iter(match=WORKER_PREFIX + "*", count=500))
        values = self._redis.mget(keys) if keys else []
        restarts = self._redis.hgetall(RESTARTS_KEY)
        out = []
        for value in values:
            if value is None:  # expired between SCAN and MGET
                continue
            info = json.loads(value)
            info["restarts"] = int(restarts.get(info.get("node", ""), 0))
            out.append(info)
        return out

    def restarts(self) -> dict[str, int]:
        """Launcher restarts per node, since Redis was last emptied."""
        return {str(node): int(n) for node, n in self._redis.hgetall(RESTARTS_KEY).items()}

    def restarts_of(self, node: str) -> int:
        """Launcher restarts of one node."""
        return int(self._redis.hget(RESTARTS_KEY, node) or 0)


def wait_bucket(seconds: float) -> int:
    """The wait bucket ``seconds`` falls in (``WAIT_BASE_S``, ``WAIT_GROWTH``)."""
    if not seconds > WAIT_BASE_S:  # NaN too
        return 0
    return min(WAIT_BUCKETS - 1, math.ceil(math.log(seconds / WAIT_BASE_S) / math.log(WAIT_GROWTH) - 1e-9))


def wait_quantile(counts: Mapping[int, int], q: float) -> float:
    """The ``q`` quantile (0..1) of waits counted in buckets, interpolated inside its bucket as
    Prometheus's ``histogram_quantile`` does; 0.0 for no jobs."""
    total = sum(counts.values())
    if total <= 0:
        return 0.0
    rank = q * total
    seen = 0
    for at in sorted(counts):
        jobs = counts[at]
        if jobs > 0 and seen + jobs >= rank:
            lower = 0.0 if at == 0 else WAIT_BASE_S * WAIT_GROWTH ** (at - 1)
            upper = WAIT_BASE_S * WAIT_GROWTH**at
            return lower + (upper - lower) * max(0.0, rank - seen) / jobs
        seen += jobs
    return WAIT_BASE_S * WAIT_GROWTH ** max(counts)


def tenant_waits(
    waits: Mapping[str, Mapping[int, int]], in_flight: Mapping[str, int] | None = None, *, top: int = TENANT_ROWS
) -> list[dict[str, Any]]:
    """One row per tenant: jobs started, wait p50 and p95 (seconds) from ``waits`` and jobs in flight now
    (``in_flight``, as the cap counts them). The ``top`` busiest tenants (jobs plus jobs in flight) have
    a row of their own, the rest one ``other`` row, last: a bounded set whatever names the fleet has seen."""
    flying = dict(in_flight or {})
    tenants = set(waits) | set(flying)

    def volume(tenant: str) -> int:
        return sum(waits.get(tenant, {}).values()) + flying.get(tenant, 0)

    ranked = sorted(tenants, key=lambda tenant: (-volume(tenant), tenant))
    named = [tenant for tenant in ranked if tenant != OTHER_TENANT][:top]
    rest: dict[int, int] = {}
    rest_flying = 0
    for tenant in set(ranked) - set(named):
        for at, jobs in waits.get(tenant, {}).items():
            rest[at] = rest.get(at, 0) + jobs
        rest_flying += flying.get(tenant, 0)
    rows = [(tenant, dict(waits.get(tenant, {})), flying.get(tenant, 0)) for tenant in named]
    if rest or rest_flying:
        rows.append((OTHER_TENANT, rest, rest_flying))
    return [
        {
            "tenant": tenant,
            "jobs": sum(counts.values()),
            "wait_p50_s": round(wait_quantile(counts, 0.5), 4),
            "wait_p95_s": round(wait_quantile(counts, 0.95), 4),
            "in_flight": jobs_in_flight,
        }
        for tenant, counts, jobs_in_flight in rows
    ]


def worker_info(*, node: str, engine: str, model: str, device: str, started_at: float, jobs: int) -> dict[str, Any]:
    """The heartbeat a worker publishes (``device``: its GPUs, ``cpu`` if it has none)."""
    return {
        "node": node,
        "engine": engine,
        "model": model,
        "device": device or "cpu",
        "pid": os.getpid(),
        "started_at": started_at,
        "jobs": jobs,
    }


class FleetObserver(Observer):
    """Feeds a worker's finished jobs into the fleet's minute counters, and counts them for the worker's
    heartbeat.

    The counters are summed in the process and written once a second (``FLUSH_INTERVAL_S``) by a
    thread of their own, not one round trip per job: at espeak's speed that round trip was a tenth
    of the worker's CPU per job. A worker killed outright loses at most its last second of counts
    (statistics, not the jobs: their results are stored); a Redis that cannot be reached keeps
    them here until it can."""

    def __init__(self, stats: FleetStats) -> None:
        self.stats = stats
        self._jobs = 0
        self._lock = threading.Lock()
        #: Unwritten amounts per minute bucket (``time() // 60``).
        self._pending: dict[int, dict[str, float]] = {}
        #: Unwritten wait bucket counts per minute: ``"<bucket>|<tenant>"`` -> jobs; and the tenants named
        #: in each minute (at most ``WAIT_TENANTS_PER_MINUTE``).
        self._waits: dict[int, dict[str, int]] = {}
        self._wait_tenants: dict[int, set[str]] = {}
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._writer: threading.Thread | None = None

    @property
    def jobs(self) -> int:
        """Jobs this worker has finished, whatever their outcome (its heartbeat shows it)."""
        return self._jobs

    def job_finished(self, report: JobReport) -> None:
        outcome, result = report.outcome, report.result
        amounts: dict[str, float] = {"cached_worker" if outcome == "cached" else outcome: 1}
        if outcome == "synthesized" and result is not None:
            amounts.update(audio_s=result["duration_s"], device_s=result["timings"]["device_s"])
        minute = int(time.time() // 60)
        with self._lock:
            self._jobs += 1
            bucket = self._pending.setdefault(minute, {})
            for name, amount in amounts.items():
                bucket[name] = bucket.get(name, 0) + amount
            if report.queue_wait_s is not None:
                named = self._wait_tenants.setdefault(minute, set())
                tenant = report.tenant or DEFAULT_TENANT
                if tenant not in named and len(named) >= WAIT_TENANTS_PER_MINUTE:
                    tenant = OTHER_TENANT
                named.add(tenant)
                field = f"{wait_bucket(report.queue_wait_s)}|{tenant}"
                waits = self._waits.setdefault(minute, {})
                waits[field] = waits.get(field, 0) + 1
            if self._writer is None and not self._closed.is_set():
                self._writer = threading.Thread(target=self._write_every_second, name="ttsq-stats", daemon=True)
                self._writer.start()

    def flush(self) -> None:
        """Write what is pending now; what cannot be written stays pending (and is retried)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            waits, self._waits = self._waits, {}
            current = int(time.time() // 60)
            for minute in [m for m in self._wait_tenants if m < current - 1]:
                del self._wait_tenants[minute]  # that minute's names are written: no more come for it
        failed: dict[int, dict[str, float]] = {}
        failed_waits: dict[int, dict[str, int]] = {}
        for minute, amounts in sorted(pending.items()):
            try:
                self.stats.record(now=minute * 60.0, **amounts)
            except Exception as exc:  # best effort: a Redis hiccup must not end the writer
                failed[minute] = amounts
                logger.debug("fleet statistics not written yet: %s", type(exc).__name__)
        for minute, counts in sorted(waits.items()):
            try:
                self.stats.record_waits(counts, now=minute * 60.0)
            except Exception as exc:
                failed_waits[minute] = counts
                logger.debug("tenant waits not written yet: %s", type(exc).__name__)
        if failed or failed_waits:
            with self._lock:
                for minute, amounts in failed.items():
                    bucket = self._pending.setdefault(minute, {})
                    for name, amount in amounts.items():
                        bucket[name] = bucket.get(name, 0) + amount
                for minute, counts in failed_waits.items():
                    kept = self._waits.setdefault(minute, {})
                    for field, jobs in counts.items():
                        kept[field] = kept.get(field, 0) + jobs

    def close(self) -> None:
        """Stop the writer and write what is left (a worker that stops cleanly loses no count)."""
        self._closed.set()
        self._wake.set()
        writer = self._writer
        if writer is not None:
            writer.join(timeout=FLUSH_INTERVAL_S + 5)
        self.flush()

    def _write_every_second(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(FLUSH_INTERVAL_S)
            self.flush()
