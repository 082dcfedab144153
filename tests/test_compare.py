"""``benchmarks/compare.py`` end to end in its tiny mode: every system starts, answers, and the printed
ratios are the ones the figures give. Speed is never asserted: the figures are for the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ttsq.ops.bench import STAGES

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent


def test_compare_tiny_runs_every_baseline_and_prints_its_ratios(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compare.py"), "--tiny", "--json", str(tmp_path / "compare.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    text = out.stdout.decode()
    data = json.loads((tmp_path / "compare.json").read_text())

    assert data["labels"] == {
        "batched": "ttsq, batching on",
        "unbatched": "ttsq, batching off",
        "bare": "bare Celery task",
    }
    assert len(data["rounds"]) == data["config"]["rounds"] == 1
    only = data["rounds"][0]
    for name in data["labels"]:
        assert only[name]["jobs_per_s"] > 0 and only[name]["audio_s_per_s"] > 0
        assert data["summary"][name]["jobs_per_s"]["median"] == only[name]["jobs_per_s"]
    # ttsq's workers report their batches; batching off means batches of one.
    assert only["unbatched"]["mean_batch_size"] == 1.0
    assert 1.0 <= only["batched"]["mean_batch_size"] <= data["config"]["max_batch"]
    assert only["bare"]["mean_batch_size"] is None
    for name in data["labels"]:  # CPU per job of the worker, Redis and the producer, read from /proc
        parts = [only[name][k] for k in ("worker_cpu_ms", "redis_cpu_ms", "producer_cpu_ms")]
        assert all(part >= 0 for part in parts) and only[name]["total_cpu_ms"] == pytest.approx(sum(parts))
        assert parts[0] > 0  # the worker did the synthesis

    ratios = data["ratios"]
    for key, (over, under) in {
        "batching_on_over_off": ("batched", "unbatched"),
        "ttsq_over_bare": ("batched", "bare"),
        "ttsq_unbatched_over_bare": ("unbatched", "bare"),
    }.items():
        expected = only[over]["jobs_per_s"] / only[under]["jobs_per_s"]
        assert ratios[key]["jobs_per_s"]["median"] == pytest.approx(expected)
        assert f"throughput x{expected:.2f}" in text
    cache = data["cache"]
    assert cache["first_over_cached"] == pytest.approx(
        cache["first_submit_ms"]["median"] / cache["cached_submit_ms"]["median"]
    )
    assert f"x{cache['first_over_cached']:.1f} faster" in text

    # The overhead table: every stage, for both ttsq configurations, adding up to the latency.
    for name in ("batched", "unbatched"):
        stages = data["overhead_ms"][name]
        assert list(stages) == [key for key, _ in STAGES if key != "send_delay"]
        assert all(stage["mean_ms"] is not None for stage in stages.values())
        own = sum(stage["mean_ms"] for key, stage in stages.items() if key not in ("synthesis", "batch_wait"))
        assert data["queue_overhead_ms"][name]["mean_ms"] == pytest.approx(own, rel=1e-6)
    for _, label in STAGES[1:]:
        assert label in text
