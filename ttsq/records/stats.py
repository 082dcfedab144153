"""Fleet statistics in Redis: per-minute job counters, worker heartbeats, launcher restarts.

Prometheus scrapes each worker; this is the view any host can read without Prometheus (``ttsq
stats``, ``ttsq.ops.fleet``): the counters every worker (and every producer, for its cache hits) adds to
``ttsq:minute:<unix minute>``, and the heartbeats of live workers. ``FleetObserver`` is the worker's
observer that feeds them. Nothing here holds request content.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from ttsq.constants import HEARTBEAT_TTL_S, MINUTE_PREFIX, MINUTE_STATS_TTL_S, RESTARTS_KEY, WORKER_PREFIX
from ttsq.observer import JobReport, Observer

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

#: Integer counters of a minute bucket.
COUNTS = ("synthesized", "cached_worker", "cached_producer", "invalid", "failed", "timeout")
#: Float sums of a minute bucket (seconds).
SECONDS = ("audio_s", "device_s")
#: How often a worker writes the counts of the jobs it finished (``FleetObserver``).
FLUSH_INTERVAL_S = 1.0


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
            if self._writer is None and not self._closed.is_set():
                self._writer = threading.Thread(target=self._write_every_second, name="ttsq-stats", daemon=True)
                self._writer.start()

    def flush(self) -> None:
        """Write what is pending now; what cannot be written stays pending (and is retried)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        failed: dict[int, dict[str, float]] = {}
        for minute, amounts in sorted(pending.items()):
            try:
                self.stats.record(now=minute * 60.0, **amounts)
            except Exception as exc:  # best effort: a Redis hiccup must not end the writer
                failed[minute] = amounts
                logger.debug("fleet statistics not written yet: %s", type(exc).__name__)
        if failed:
            with self._lock:
                for minute, amounts in failed.items():
                    bucket = self._pending.setdefault(minute, {})
                    for name, amount in amounts.items():
                        bucket[name] = bucket.get(name, 0) + amount

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
