"""``benchmarks/fleet_soak.py`` end to end in its tiny mode: a real Redis, a real ``ttsq worker`` on the
GPU stand-in, the real gateway with several tenants' keys, and every kind of producer and reader (whole
clips, ``Client.stream``, the gateway read at once, slowly and never). What is checked is the report's
shape and that every accepted job completed once; the memory figures are the benchmark's, never
asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Whole-file: real processes, about a minute on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.fleet_soak import KINDS, slope_per_min  # noqa: E402


def test_the_slope_is_the_least_squares_one_per_minute() -> None:
    assert slope_per_min([(0, 5.0), (60, 7.0), (120, 9.0)]) == pytest.approx(2.0)
    assert slope_per_min([(0, 1.0), (30, 3.0), (60, 1.0), (90, 3.0)]) == pytest.approx(0.8)


def test_fleet_soak_tiny_loses_nothing_and_makes_nothing_twice(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet_soak.py"), "--tiny", "--json", str(tmp_path / "soak.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    text = out.stdout.decode()
    data = json.loads((tmp_path / "soak.json").read_text())

    assert data["ttsq_fleet_soak"] == 1 and data["config"]["tenants"] > 1
    assert set(data["accepted_by_kind"]) == set(KINDS), data["accepted_by_kind"]  # every producer and reader
    assert data["errors"] == 0 and not data["refused"], data["first_errors"]
    assert data["accepted"] == data["arrivals"] > 0
    # Nothing lost: every accepted job's result is there; nothing twice: each synthesized once.
    assert data["lost"] == 0 and data["states"] == {"SUCCESS": data["accepted"]}, data["lost_jobs"]
    assert data["duplicated"] == 0 and data["syntheses"] == data["synthesized_jobs"] >= data["accepted"]
    assert all(data["processes_alive"].values())
    assert f"lost 0, duplicated 0 ({data['syntheses']} syntheses" in text

    samples = data["samples"]
    assert len(samples) >= 3 and samples == sorted(samples, key=lambda s: s["t_s"])
    for sample in samples:
        assert sample["redis_used_memory"] > 0 and sample["gateway_rss"] > 0
        assert len(sample["worker_rss"]) == data["config"]["workers"] and all(sample["worker_rss"])
        assert 0 <= sample["streams_ended"] <= sample["stream_keys"]
    assert max(s["stream_keys"] for s in samples) > 0 and max(s["open_http"] for s in samples) > 0
    slopes = data["slope_mb_per_min_after_warmup"]
    assert set(slopes) == {"redis_used_memory", "redis_rss", "gateway_rss", "worker0_rss"}
    assert "slope after warm-up, MB/min: redis_used_memory" in text
    # The streams' readers all timed their first audio; the silent ones never read it.
    assert set(data["first_audio"]) == {"pcm", "http", "http-slow"}
    for figures in data["first_audio"].values():
        assert 0 < figures["p50_ms"] <= figures["p95_ms"] and figures["count"] > 0
    # Redis's keys by pattern, before and after: the streams and the results are named.
    assert any(pattern.startswith("db2 ttsq:stream:") for pattern in data["redis_keys_after"])
