"""The figures of one ``ttsq bench`` run: per-job outcomes, stage breakdown, throughput and latency
percentiles, batch fill; as plain JSON (``report``) and as the printed table (``format_report``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ttsq.ops.corpus import Plan

#: Version of the JSON report's shape.
REPORT_VERSION = 1


@dataclass
class Outcome:
    """One timed job."""

    index: int
    latency_s: float
    result: Mapping[str, Any] | None = None
    error: str | None = None
    #: Sender-side stage seconds (validation, publish, and in an open loop the wait for a sender).
    client: dict[str, float] = field(default_factory=dict)


#: Stages of one job, in the order it meets them: (report key, what it covers). They add up to the
#: end-to-end latency: the broker's share is what the others leave.
STAGES: tuple[tuple[str, str], ...] = (
    ("send_delay", "bench: arrival waited for a sender thread"),
    ("client_validate_hash", "client: validate + content key"),
    ("client_publish", "client: cache look-up, claim, publish"),
    ("broker_round_trip", "broker: to a worker thread, result back"),
    ("batch_wait", "worker: batch wait"),
    ("synthesis", "worker: synthesis (whole batch)"),
    ("encode", "worker: encode"),
    ("upload", "worker: upload"),
    ("index_write", "worker: index write"),
    ("worker_other", "worker: validate, cache re-check, sign URL"),
)


_NOT_QUEUE_OVERHEAD = frozenset({"send_delay", "batch_wait", "synthesis"})


QUEUE_OVERHEAD_LABEL = "queue's own cost (not synthesis, batch wait)"


def job_stages(outcome: Outcome) -> dict[str, float] | None:
    """Seconds per stage of one finished job, adding up to its latency.

    None if the result carries no stage timings (a target that is not ttsq). The broker round trip
    is the remainder: the time between the publish call returning and the task starting, plus the
    time from the task's return to the producer holding the result. (The worker's own queue-wait
    figure starts at a header stamped before the publish call, so it overlaps the publish.)
    """
    result = outcome.result
    timings = result.get("timings") if result is not None else None
    if not isinstance(timings, Mapping) or "worker_s" not in timings:
        return None
    stages = {name: outcome.client.get(name, 0.0) for name in ("send_delay", "client_validate_hash", "client_publish")}
    stages.update(
        batch_wait=timings["batch_wait_s"],
        synthesis=timings["synthesis_s"],
        encode=timings["encode_s"],
        upload=timings["upload_s"],
        index_write=timings["index_s"],
    )
    worker_parts = sum(stages[name] for name in ("batch_wait", "synthesis", "encode", "upload", "index_write"))
    stages["worker_other"] = max(0.0, timings["worker_s"] - worker_parts)
    stages["broker_round_trip"] = outcome.latency_s - sum(stages.values())
    return {name: stages[name] for name, _ in STAGES}


def _distribution(values: Iterable[float]) -> dict[str, float | None]:
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    return {
        "mean": float(data.mean()),
        "p50": float(np.percentile(data, 50)),
        "p95": float(np.percentile(data, 95)),
        "p99": float(np.percentile(data, 99)),
        "max": float(data.max()),
    }


def report(
    outcomes: Sequence[Outcome],
    wall_s: float,
    plan: Plan,
    *,
    config: Mapping[str, Any] | None = None,
    max_batch: int | None = None,
) -> dict[str, Any]:
    """The figures of one run as plain JSON (what ``format_report`` prints)."""
    ok = [o for o in outcomes if o.result is not None]
    results = [o.result for o in ok if o.result is not None]
    cached = [r for r in results if r.get("cached")]
    synthesized = [r for r in results if not r.get("cached")]
    audio_s = sum(float(r.get("duration_s", 0.0)) for r in results)
    fresh_timings = [r["timings"] for r in synthesized if isinstance(r.get("timings"), Mapping)]
    # Each job of a batch of b reports b; summing 1/b over jobs counts batches, so this is the mean
    # per batch, not the job-weighted mean that overstates fill.
    sizes = [int(r["batch_size"]) for r in synthesized if int(r.get("batch_size", 0)) > 0]
    batches = sum(1.0 / size for size in sizes)
    mean_batch = len(sizes) / batches if batches else None
    errors: dict[str, dict[str, Any]] = {}
    for outcome in outcomes:
        if outcome.error is not None:
            kind = outcome.error.split(":", 1)[0]
            entry = errors.setdefault(kind, {"count": 0, "example": outcome.error})
            entry["count"] += 1
    per_job = [stages for o in ok if (stages := job_stages(o)) is not None]
    stage_figures = {}
    for name, label in STAGES:
        values = [stages[name] * 1000 for stages in per_job]
        if name == "send_delay" and plan.rate is None:
            continue
        figures = _distribution(values)
        stage_figures[name] = {
            "label": label,
            "mean_ms": figures["mean"],
            "p50_ms": figures["p50"],
            "p95_ms": figures["p95"],
        }
    # What the queue itself costs a job: everything but the model's work and the batching policy's wait.
    own = _distribution(1000 * sum(v for k, v in stages.items() if k not in _NOT_QUEUE_OVERHEAD) for stages in per_job)
    return {
        "ttsq_bench": REPORT_VERSION,
        "config": {
            "mode": plan.mode,
            "jobs": plan.jobs,
            "loop": "closed" if plan.rate is None else "open",
            "concurrency": plan.concurrency if plan.rate is None else None,
            "rate_per_s": plan.rate,
            "warmup": plan.warmup,
            "format": plan.audio_format,
            "seed": plan.seed,
            "max_batch": max_batch,
            **(config or {}),
        },
        "jobs": {
            "sent": len(outcomes),
            "ok": len(ok),
            "errors": len(outcomes) - len(ok),
            "cached": len(cached),
            "synthesized": len(synthesized),
        },
        "wall_s": wall_s,
        "throughput": {
            "jobs_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "audio_s_per_s": audio_s / wall_s if wall_s > 0 else None,
            "audio_s": audio_s,
            # Wall time per second of audio delivered: below 1 is faster than real time.
            "real_time_factor": wall_s / audio_s if audio_s > 0 else None,
        },
        "latency_s": _distribution(o.latency_s for o in ok),
        "queue_wait_s": _distribution(float(t["queue_wait_s"]) for t in fresh_timings),
        "batch_wait_s": _distribution(float(t["batch_wait_s"]) for t in fresh_timings if "batch_wait_s" in t),
        "synthesis_s": _distribution(float(t["synthesis_s"]) for t in fresh_timings),
        "batch": {
            "mean_size": mean_batch,
            "batches": round(batches) if sizes else 0,
            "max_size_seen": max(sizes, default=None),
            "fill": mean_batch / max_batch if mean_batch is not None and max_batch else None,
        },
        "cache_hit_ratio": len(cached) / len(results) if results else None,
        "stages_ms": stage_figures,
        "queue_overhead_ms": {
            "label": QUEUE_OVERHEAD_LABEL,
            "mean_ms": own["mean"],
            "p50_ms": own["p50"],
            "p95_ms": own["p95"],
        },
        "stage_jobs": len(per_job),
        "errors": errors,
    }


def _fmt(value: Any, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def format_report(data: Mapping[str, Any]) -> str:
    """The report as an aligned text table."""
    config, jobs, throughput, batch = data["config"], data["jobs"], data["throughput"], data["batch"]
    loop = (
        f"closed loop, concurrency {config['concurrency']}"
        if config["loop"] == "closed"
        else f"open loop, Poisson arrivals at {config['rate_per_s']:g} jobs/s"
    )
    lines = [f"ttsq bench: {config['mode']}, {config['jobs']} jobs, {loop}"]
    if config.get("target"):
        lines.append(f"target: {config['target']}")
    rows: list[tuple[str, str]] = [
        ("jobs ok / errors", f"{jobs['ok']} / {jobs['errors']}"),
        ("wall time", _fmt(data["wall_s"], " s", 2)),
        ("jobs/s", _fmt(throughput["jobs_per_s"], "", 2)),
        ("audio seconds per second", _fmt(throughput["audio_s_per_s"], "", 2)),
        ("real-time factor (wall / audio)", _fmt(throughput["real_time_factor"], "", 4)),
        (
            "mean batch size (fill)",
            _fmt(batch["mean_size"], "", 2)
            + (f" ({batch['fill']:.0%} of {config['max_batch']})" if batch["fill"] is not None else ""),
        ),
        ("cache hit ratio", _fmt(data["cache_hit_ratio"], "", 3)),
    ]
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    lines.append("")
    lines.append(f"  {'seconds':<22}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}")
    for key, name in (
        ("latency_s", "end-to-end latency"),
        ("queue_wait_s", "queue wait"),
        ("batch_wait_s", "batch wait"),
        ("synthesis_s", "synthesis (batch)"),
    ):
        dist = data[key]
        lines.append(f"  {name:<22}" + "".join(f"{_fmt(dist[p], '', 3):>9}" for p in ("p50", "p95", "p99", "max")))
    if data["stage_jobs"]:
        lines.append("")
        lines.append(f"  {'where a job spends its time (ms)':<48}{'mean':>9}{'p50':>9}{'p95':>9}")
        total = 0.0
        for stage in data["stages_ms"].values():
            total += stage["mean_ms"] or 0.0
            lines.append(
                f"  {stage['label']:<48}"
                + "".join(f"{_fmt(stage[p], '', 2):>9}" for p in ("mean_ms", "p50_ms", "p95_ms"))
            )
        lines.append(f"  {'total (mean end-to-end latency)':<48}{total:>9.2f}")
        own = data["queue_overhead_ms"]
        lines.append(
            f"  {own['label']:<48}" + "".join(f"{_fmt(own[p], '', 2):>9}" for p in ("mean_ms", "p50_ms", "p95_ms"))
        )
    for kind, entry in data["errors"].items():
        lines.append(f"  error {kind} x{entry['count']}: {entry['example']}")
    return "\n".join(lines)
