"""Fleet statistics in Redis: per-minute job counters, worker heartbeats, launcher restarts.

Prometheus scrapes each worker; this module is the view any host can read without Prometheus:
``ttsq stats`` sums the last few minutes of counters that every worker (and every producer, for its
cache hits) adds to ``ttsq:minute:<unix minute>``, lists the workers whose heartbeat has not expired,
and reads queue depths from the broker. Nothing here holds request content.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import redis

from ttsq.constants import (
    HEARTBEAT_TTL_S,
    MINUTE_PREFIX,
    MINUTE_STATS_TTL_S,
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_SOCKET_TIMEOUT_S,
    RESTARTS_KEY,
    WORKER_PREFIX,
)
from ttsq.errors import BrokerError

if TYPE_CHECKING:
    from ttsq.config import Settings

logger = logging.getLogger(__name__)

#: Integer counters of a minute bucket.
COUNTS = ("synthesized", "cached_worker", "cached_producer", "invalid", "failed", "timeout")
#: Float sums of a minute bucket (seconds).
SECONDS = ("audio_s", "device_s")


class FleetStats:
    """Reads and writes the fleet's statistics in the cache Redis."""

    def __init__(self, url: str) -> None:
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                                           socket_timeout=REDIS_SOCKET_TIMEOUT_S, decode_responses=True)

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

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()


def snapshot(settings: Settings, *, minutes: int = 5, ping_timeout: float = 1.0,
             now: float | None = None) -> dict[str, Any]:
    """What ``ttsq stats`` prints: queues, workers, throughput and cache hit ratio, as plain JSON.

    Workers are those with a live heartbeat in Redis; ``responding`` says whether each also
    answered a Celery ping within ``ping_timeout`` (0 skips the ping).
    """
    from ttsq.metrics import queue_depth
    from ttsq.request import MODES
    from ttsq.tasks import queue_for

    now = time.time() if now is None else now
    queues = [queue_for(settings.queue, mode) for mode in MODES]
    stats = FleetStats(settings.cache_url)
    broker = redis.Redis.from_url(settings.broker_url, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
                                  socket_timeout=REDIS_SOCKET_TIMEOUT_S)
    try:
        depths = [{"queue": queue, "depth": queue_depth(broker, queue)} for queue in queues]
        unacked = int(broker.hlen("unacked"))
        totals = stats.window(minutes, now=now)
        workers = stats.workers()
    except redis.exceptions.RedisError as exc:
        raise BrokerError(f"cannot read statistics from Redis: {type(exc).__name__}: {exc}") from exc
    finally:
        stats.close()
        broker.close()
    answered = _ping(settings, ping_timeout) if ping_timeout > 0 and workers else set()
    for worker in workers:
        worker["responding"] = worker.get("node") in answered if ping_timeout > 0 else None
        worker["uptime_s"] = round(max(0.0, now - float(worker.get("started_at", now))), 1)

    # The window starts at the top of the oldest minute: the current minute is only partly over.
    window_s = (minutes - 1) * 60 + (now % 60)
    done = int(totals["synthesized"] + totals["cached_worker"])
    hits = int(totals["cached_worker"] + totals["cached_producer"])
    lookups = hits + int(totals["synthesized"])
    return {
        "queues": depths,
        "unacked": unacked,
        "workers": workers,
        "window": {
            "minutes": minutes,
            "seconds": round(window_s, 1),
            "jobs_done": done,
            "synthesized": int(totals["synthesized"]),
            "cache_hits": hits,
            "cache_hits_producer": int(totals["cached_producer"]),
            "failed": int(totals["failed"] + totals["invalid"] + totals["timeout"]),
            "jobs_per_minute": round(done / window_s * 60, 2) if window_s > 0 else 0.0,
            "audio_s": round(totals["audio_s"], 3),
            "device_s": round(totals["device_s"], 3),
            "cache_hit_ratio": round(hits / lookups, 4) if lookups else None,
        },
    }


def format_table(snap: dict[str, Any]) -> str:
    """``snapshot`` as the table ``ttsq stats`` prints."""
    lines = ["QUEUE                         DEPTH"]
    lines += [f"{q['queue']:<29} {q['depth']:>5}" for q in snap["queues"]]
    lines.append(f"{'(unacked, all queues)':<29} {snap['unacked']:>5}")
    lines.append("")
    workers = snap["workers"]
    lines.append(f"WORKERS ONLINE: {len(workers)}")
    if workers:
        lines.append(f"{'NODE':<28} {'ENGINE':<8} {'DEVICE':<7} {'PID':>7} {'UPTIME':>8} {'JOBS':>6} "
                     f"{'RESTARTS':>8}  PING")
        for w in workers:
            ping = {True: "ok", False: "no answer", None: "-"}[w.get("responding")]
            lines.append(f"{w.get('node', '?'):<28} {w.get('engine', '?'):<8} {w.get('device', '') or 'cpu':<7} "
                         f"{w.get('pid', 0):>7} {_duration(w.get('uptime_s', 0.0)):>8} {w.get('jobs', 0):>6} "
                         f"{w.get('restarts', 0):>8}  {ping}")
    win = snap["window"]
    ratio = "-" if win["cache_hit_ratio"] is None else f"{win['cache_hit_ratio']:.1%}"
    lines += [
        "",
        f"LAST {win['minutes']} MIN",
        f"  jobs done        {win['jobs_done']:>8}   ({win['jobs_per_minute']:.1f}/min)",
        f"  synthesized      {win['synthesized']:>8}",
        f"  cache hits       {win['cache_hits']:>8}   (hit ratio {ratio}; {win['cache_hits_producer']} at producers)",
        f"  failed           {win['failed']:>8}",
        f"  audio            {win['audio_s']:>8.1f} s",
        f"  device time      {win['device_s']:>8.1f} s",
    ]
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _ping(settings: Settings, timeout: float) -> set[str]:
    """Node names of the workers that answer a Celery ping."""
    from ttsq.tasks import make_app

    app = make_app(settings)
    try:
        replies = app.control.ping(timeout=timeout) or []
    except Exception as exc:  # the table still shows the heartbeats
        logger.debug("ping failed: %s", exc)
        return set()
    finally:
        app.close()
    return {node for reply in replies for node in reply}


def worker_info(*, node: str, engine: str, model: str, device: str, started_at: float, jobs: int) -> dict[str, Any]:
    """The heartbeat a worker publishes."""
    return {"node": node, "engine": engine, "model": model, "device": device, "pid": os.getpid(),
            "started_at": started_at, "jobs": jobs}
