"""``benchmarks/fleet.py`` end to end in its tiny mode: a real Redis, a real ``ttsq worker`` on the GPU
stand-in, every workload and every baseline, and the printed ratios are the ones the figures give.
Speed is never asserted: the figures are for the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Whole-file: real processes, a minute on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent


def test_fleet_tiny_runs_every_workload_and_its_baseline(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "fleet.py"), "--tiny", "--json", str(tmp_path / "fleet.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    text = out.stdout.decode()
    data = json.loads((tmp_path / "fleet.json").read_text())

    assert data["config"]["workers"] == 1 and len(data["rounds"]) == data["config"]["rounds"] == 1
    (only,) = data["rounds"]
    assert set(only) == {"wav", "pcm", "mp3", "opus"}
    for workload, row in only.items():
        assert row["jobs"] > 0 and row["errors"] == 0, (workload, row["first_error"])
        assert row["audio_s_per_s"] == pytest.approx(row["jobs_per_s"] * row["audio_s_per_job"])
        assert 1 <= row["mean_batch"] <= data["config"]["max_batch"]
        assert row["worker_cpu_ms_per_job"] > 0  # read from /proc: the worker did the work
    stream = only["pcm"]  # a player at real time: when its first audio came, and how long it ran dry
    assert 0 < stream["first_audio_p50_ms"] <= stream["first_audio_p95_ms"]
    assert 0 <= stream["streams_with_underrun"] <= stream["jobs"] and stream["underrun_s_per_stream"] >= 0
    assert "first_audio_p50_ms" not in only["wav"]
    (baseline,) = data["baselines"]
    assert set(baseline) == {"wav", "mp3", "opus", "streamed"}
    summary = data["summary"]
    for workload in ("wav", "mp3", "opus"):
        expected = only[workload]["audio_s_per_s"] / baseline[workload]["audio_s_per_s"]
        assert summary[workload]["over_encoder_alone"] == pytest.approx(expected)
        assert f"through the queue / encoder alone {expected:.2f}" in text
    assert "over_encoder_alone" not in summary["pcm"]  # a stream is not encoded by the worker
    ratios = data["ratios"]
    expected = baseline["opus"]["cpu_ms_per_audio_s"] / baseline["mp3"]["cpu_ms_per_audio_s"]
    assert ratios["opus_over_mp3_cpu_stored"] == pytest.approx(expected)
    assert f"opus_over_mp3_cpu_stored: {expected:.2f}" in text
    assert ratios["mp3_batch_over_wav_batch"] == pytest.approx(only["mp3"]["mean_batch"] / only["wav"]["mean_batch"])
