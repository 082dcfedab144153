"""The soak benchmark, small: its script runs end to end and finds every job done once.

The full soak (10,000 jobs, ``python benchmarks/soak.py``) is run by hand; its figures are reported,
not asserted. This keeps the script working and its accounting honest.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "soak.py"


def test_a_small_soak_completes_every_job_once_and_reports_memory() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--jobs", "200", "--samples", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads(out.stdout)
    assert summary["ok"] is True
    assert summary["completed"] == summary["synthesized"] == summary["objects_stored"] == 200
    assert len(summary["rss_start_kib"]) == len(summary["rss_end_kib"]) == 2
    assert all(rss > 0 for rss in summary["rss_end_kib"])
