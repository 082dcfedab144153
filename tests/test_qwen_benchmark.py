"""The Qwen batching benchmark (also the GPU script, with ``--size full``) runs in CI on a tiny checkpoint.

Only its shape is checked: speed claims live in its printed table, not in a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def test_batching_benchmark_smoke(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "qwen_batching.py"),
            "--size",
            "tiny",
            "--batches",
            "1,2",
            "--frames",
            "4",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "b.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads((tmp_path / "b.json").read_text())
    assert [row["batch"] for row in figures["rows"]] == [1, 2]
    for row in figures["rows"]:
        # Every request produced its fixed frame count, both ways, and both rates are real numbers.
        assert row["audio_s"] == round(row["batch"] * 4 / 12.5, 2)
        assert row["ttsq_audio_s_per_s"] > 0 and row["one_by_one_audio_s_per_s"] > 0
        assert f"{row['batch']:>5} " in out.stdout
    assert "speedup" in out.stdout


def test_fast_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/qwen_fast.py (also the GPU script) on a tiny checkpoint: both engines, both runs."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "qwen_fast.py"),
            "--batches",
            "1,2",
            "--frames",
            "4",
            "--repeats",
            "1",
            "--jobs",
            "4",
            "--rate",
            "20",
            "--min-frames",
            "3",
            "--max-frames",
            "6",
            "--slots",
            "2",
            "--json",
            str(tmp_path / "f.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads((tmp_path / "f.json").read_text())
    assert [row["batch"] for row in figures["rows"]] == [1, 2]
    for row in figures["rows"]:
        assert row["audio_s"] == round(row["batch"] * 4 / 12.5, 2)
        assert row["stock_audio_s_per_s"] > 0 and row["fast_audio_s_per_s"] > 0 and row["codec_stock_s"] > 0
        assert row["codec_fast_s"] > 0
    assert set(figures["mixed"]) == {"stock", "fast"}
    assert all(run["jobs_per_s"] > 0 and run["p95_s"] >= run["p50_s"] for run in figures["mixed"].values())
