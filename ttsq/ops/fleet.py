"""What the fleet is doing, for ``ttsq stats``: queues, workers online, throughput, cache hit ratio.

Read from Redis (the minute counters and heartbeats of ``ttsq.records.stats``, the broker's lists) by any
host, without Prometheus; workers are also pinged through Celery, to tell a live heartbeat from a
worker that still answers.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import redis

from ttsq.app import make_app, queue_for
from ttsq.delivery.broker import queue_depth, unacked, unacked_by_queue
from ttsq.errors import BrokerError
from ttsq.job import LANES, MODES
from ttsq.records.owner import RedisOwner
from ttsq.records.stats import tenant_waits

if TYPE_CHECKING:
    from ttsq.config import Settings

logger = logging.getLogger(__name__)


def snapshot(
    settings: Settings, *, minutes: int = 5, ping_timeout: float = 1.0, now: float | None = None
) -> dict[str, Any]:
    """What ``ttsq stats`` prints: queues, workers, throughput and cache hit ratio, as plain JSON.

    Workers are those with a live heartbeat in Redis; ``responding`` says whether each also
    answered a Celery ping within ``ping_timeout`` (0 skips the ping). Every queue of the deployment is
    listed, with ``served``: whether a live worker serves its mode (the table shows only those, and
    those that hold work).
    """
    now = time.time() if now is None else now
    owner = RedisOwner(settings, role="stats")
    try:
        in_flight = unacked_by_queue(owner.broker)
        served = owner.identities.modes_served(settings.queue)
        depths = []
        for lane in LANES:  # interactive lanes first, the order a worker consumes them in
            for mode in MODES:
                queue = queue_for(settings.queue, mode, lane)
                depths.append(
                    {
                        "queue": queue,
                        "lane": lane,
                        "mode": mode,
                        "served": mode in served,
                        "depth": queue_depth(owner.broker, queue),
                        "in_flight": in_flight.get(queue, 0),
                        # Jobs waiting in their tenants' places for release into the queue (fair shares).
                        "deferred": owner.accepted.deferred(queue),
                    }
                )
        unacked_messages = unacked(owner.broker)
        totals = owner.stats.window(minutes, now=now)
        # Per-tenant waits over the same minutes, and what each tenant has in flight under a cap.
        tenants = tenant_waits(owner.stats.waits(minutes, now=now), owner.accepted.in_flight(settings.queue))
        workers = owner.stats.workers()
    except redis.exceptions.RedisError as exc:
        raise BrokerError(f"cannot read statistics from Redis: {type(exc).__name__}: {exc}") from exc
    finally:
        owner.close()
    answered = _ping(settings, ping_timeout) if ping_timeout > 0 and workers else set()
    for worker in workers:
        worker["device"] = worker.get("device") or "cpu"  # as the table shows it (a heartbeat of an older worker)
        worker["responding"] = worker.get("node") in answered if ping_timeout > 0 else None
        worker["uptime_s"] = round(max(0.0, now - float(worker.get("started_at", now))), 1)

    # The window starts at the top of the oldest minute: the current minute is only partly over.
    window_s = (minutes - 1) * 60 + (now % 60)
    done = int(totals["synthesized"] + totals["cached_worker"])
    hits = int(totals["cached_worker"] + totals["cached_producer"])
    lookups = hits + int(totals["synthesized"])
    return {
        "queues": depths,
        "unacked": unacked_messages,
        "tenants": tenants,
        "tenant_max_in_flight": settings.tenant_max_in_flight,
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
    """``snapshot`` as the table ``ttsq stats`` prints: the queues of the modes live workers serve, and any
    other that holds work (waiting, deferred or in flight: jobs no live worker will take)."""
    lines = [f"{'QUEUE':<29} {'LANE':<11} {'DEPTH':>5} {'DEFERRED':>8} {'IN FLIGHT':>9}"]
    hidden = 0
    for q in snap["queues"]:
        deferred = q.get("deferred") or {}
        if not (q.get("served", True) or q["depth"] or q.get("in_flight") or sum(deferred.values())):
            hidden += 1
            continue
        lines.append(
            f"{q['queue']:<29} {q.get('lane', ''):<11} {q['depth']:>5} {sum(deferred.values()):>8} "
            f"{q.get('in_flight', 0):>9}"
        )
        lines += [f"  tenant {tenant:<20} {'':<11} {'':>5} {count:>8}" for tenant, count in sorted(deferred.items())]
    lines.append(f"{'(unacked, all queues)':<29} {'':<11} {snap['unacked']:>5}")
    if hidden:
        lines.append(
            f"({hidden} empty queue{'s' if hidden != 1 else ''} of modes no live worker serves: "
            "--json lists every queue)"
        )
    lines.append("")
    workers = snap["workers"]
    lines.append(f"WORKERS ONLINE: {len(workers)}")
    if workers:
        lines.append(
            f"{'NODE':<28} {'ENGINE':<8} {'DEVICE':<7} {'PID':>7} {'UPTIME':>8} {'JOBS':>6} {'RESTARTS':>8}  PING"
        )
        for w in workers:
            ping = {True: "ok", False: "no answer", None: "-"}[w.get("responding")]
            lines.append(
                f"{w.get('node', '?'):<28} {w.get('engine', '?'):<8} {w.get('device') or 'cpu':<7} "
                f"{w.get('pid', 0):>7} {_duration(w.get('uptime_s', 0.0)):>8} {w.get('jobs', 0):>6} "
                f"{w.get('restarts', 0):>8}  {ping}"
            )
    tenants = snap.get("tenants") or []
    if tenants:
        cap = snap.get("tenant_max_in_flight") or 0
        lines += [
            "",
            f"TENANTS, LAST {snap['window']['minutes']} MIN (waits: accept to a worker's start; in flight: "
            + (f"capped at {cap})" if cap else "no cap)"),
            f"{'TENANT':<28} {'JOBS':>8} {'WAIT P50':>9} {'WAIT P95':>9} {'IN FLIGHT':>9}",
        ]
        lines += [
            f"{t['tenant']:<28} {t['jobs']:>8} {t['wait_p50_s']:>8.3f}s {t['wait_p95_s']:>8.3f}s {t['in_flight']:>9}"
            for t in tenants
        ]
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
    app = make_app(settings)
    try:
        replies = app.control.ping(timeout=timeout) or []
    except Exception as exc:  # the table still shows the heartbeats
        logger.debug("ping failed: %s", exc)
        return set()
    finally:
        app.close()
    return {node for reply in replies for node in reply}
