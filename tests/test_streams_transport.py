"""``benchmarks/streams_transport.py`` in a smoke run: both paths move every message, the commands counted
are each path's own, and XAUTOCLAIM takes a dead consumer's messages and a silent live one's, never those
of a live one that renews them. Speed is never asserted: the figures are for the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Whole-file: a redis-server and consumer processes of its own; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent


def test_a_smoke_run_counts_each_paths_commands_and_claims_only_from_the_dead_or_silent(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    command = [sys.executable, str(ROOT / "benchmarks" / "streams_transport.py"), "--rounds", "1", "--messages", "50"]
    # Short enough for a test. The claimer's loop renews the live consumer's messages before each claim once a
    # beat is due, so a stalled loop delays both alike: a loaded machine slows the run, never flips a count.
    command += ["--min-idle", "2", "--beat", "0.2", "--look", "0.1", "--no-today"]
    command += ["--json", str(tmp_path / "streams.json")]
    out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    data = json.loads((tmp_path / "streams.json").read_text())

    kombu, streams = data["paths"]["kombu"], data["paths"]["streams"]
    for path in (kombu, streams):
        assert path["messages_per_s"] > 0 and path["rounds_per_s"] == [pytest.approx(path["messages_per_s"], abs=0.1)]
        assert path["round_trips_per_message"] > 0 and path["bytes_per_queued_message"] > 0
    # Each message once through each path's own commands, and none of the other's.
    assert kombu["commands"]["lpush"] == kombu["commands"]["hset"] == kombu["commands"]["zadd"] == 1
    assert kombu["commands"]["sadd"] == kombu["commands"]["srem"] == 1  # ttsq's HeldQoS: the worker's transport
    assert kombu["commands"]["brpop"] >= 1
    assert streams["commands"]["xadd"] == streams["commands"]["xack"] == streams["commands"]["xdel"] == 1
    assert not {"xadd", "xreadgroup"} & set(kombu["commands"]) and not {"lpush", "brpop"} & set(streams["commands"])

    recovery = data["recovery"]
    assert recovery["dead_back_after_s"] is not None  # all it held, claimed
    assert recovery["taken_from_live_with_heartbeat"] == 0
    assert recovery["taken_from_live_without_heartbeat"] == recovery["held"]
    assert recovery["today_measured_s"] is None  # --no-today: ttsq's own recovery takes its fixed 12-16 s

    sizes = data["code_lines"]
    assert all(n > 0 for kind in ("retired", "rewritten") for n in sizes[kind].values())
    assert 0 < sizes["kombu_transport_overrides"] <= sizes["fenced_overrides"]
    assert "recovery over Streams" in out.stdout.decode() and "today (ttsq.worker.recovery" in out.stdout.decode()
