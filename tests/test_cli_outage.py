"""``ttsq submit`` across a Redis restart (issue 26): the job id comes first, and the wait rides the
outage out the way ``Client.wait`` does, instead of exiting 1 at the first Redis error while the job
it was told about completes without it.

Real parts: a ``redis-server`` this test starts (with AOF, so the queued chunk messages survive its
restart), the suite's S3 server, a real ``ttsq worker`` process, ``ttsq submit`` as a subprocess.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
import soundfile
from support import WorkerProcess, run_cli, settings_env, wait_until

from ttsq.client import WAIT_RECHECK_S
from ttsq.config import Settings
from ttsq.ops.redis_server import RedisServer

#: Whole-file: real workers and a Redis restart; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

StartWorker = Callable[..., WorkerProcess]
#: How long Redis stays down: what a `systemctl restart redis` or a container restart takes.
OUTAGE_S = 2.0
#: Chunks in the test document; each one dawdles a second in the faulty engine, so the document is
#: still running when Redis goes down and comes back.
CHUNKS = 8
ACCEPTED = re.compile(r"ttsq: job (\S+) accepted")


class Lines:
    """A subprocess stream read line by line as it comes, each line with the moment it arrived."""

    def __init__(self, stream: IO[bytes] | None) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[bytes] | None) -> None:
        assert stream is not None  # the process was started with this stream piped
        for raw in iter(stream.readline, b""):
            self.lines.append((time.monotonic(), raw.decode(errors="replace").rstrip("\n")))

    def join(self) -> None:
        self._thread.join(30)

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)


@pytest.fixture
def own_redis(settings: Settings, tmp_path: Path) -> Iterator[Callable[[], tuple[RedisServer, Settings]]]:
    """A Redis server of this test's own, with AOF (queued messages survive its restart), and the
    test's settings pointed at it. Stopped when the test ends."""
    servers: list[RedisServer] = []

    def start() -> tuple[RedisServer, Settings]:
        (tmp_path / "redis").mkdir()
        server = RedisServer(directory=str(tmp_path / "redis"), appendonly=True).start()
        servers.append(server)
        url = server.url
        return server, settings.replace(broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2")

    yield start
    for server in servers:
        server.stop()


def test_submit_f_prints_the_job_id_first_and_rides_out_a_redis_restart(
    own_redis: Callable[[], tuple[RedisServer, Settings]],
    start_worker: StartWorker,
    faulty_engine: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = tmp_path / "batches.log"
    monkeypatch.setenv("FAULTY_ENGINE_EVENTS", str(events))
    server, settings = own_redis()
    # One chunk per batch: the document takes about CHUNKS seconds, the outage falls inside it.
    settings = settings.replace(engine=faulty_engine, max_batch=1)
    start_worker(settings)
    story = tmp_path / "story.txt"
    story.write_text(
        " ".join(
            f"Paragraph {i} [slow] of the story goes on for a while, long enough that each of its sentences "
            f"fills one chunk of the document on its own, and the worker takes its time over every one."
            for i in range(CHUNKS)
        ),
        encoding="utf-8",
    )
    out = tmp_path / "out.wav"
    process = subprocess.Popen(
        [sys.executable, "-m", "ttsq.cli.main", "submit", "-f", str(story), "-o", str(out), "--timeout", "240"],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = Lines(process.stdout), Lines(process.stderr)
    try:
        # The document is running: its first chunk reached the engine.
        wait_until(lambda: events.exists() and events.read_text() != "", 120, "the first chunk in the engine")
        accepted = [(at, match) for at, line in stderr.lines if (match := ACCEPTED.match(line))]
        assert accepted, f"no job id before the outage; stderr so far:\n{stderr.text()}"
        (printed_at, match), *_ = accepted
        assert not out.exists() and not stdout.lines  # before the audio and the result line
        down_at = time.monotonic()
        server.stop(keep_data=True)
        time.sleep(OUTAGE_S)
        server.start()
        assert printed_at < down_at
        process.wait(240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stdout.join()
        stderr.join()
    assert process.returncode == 0, stderr.text()
    assert len(events.read_text().splitlines()) >= CHUNKS  # the worker did go through the whole document
    assert [line for _, line in stdout.lines][-1].startswith(f"wrote {out}: "), stdout.text()
    assert f"{CHUNKS} chunks" in stdout.text()
    # The audio is complete: as long as the chunks the worker stitched, readable to its last frame.
    audio, rate = soundfile.read(out)
    assert rate > 0 and len(audio) / rate > CHUNKS * 3, len(audio) / rate
    assert match.group(1) in stderr.text()


def test_submit_of_one_job_names_it_and_waits_through_a_redis_restart(
    own_redis: Callable[[], tuple[RedisServer, Settings]], start_worker: StartWorker
) -> None:
    """The job waits in its queue while Redis restarts under the waiting command; a worker started after
    the restart answers it, and stdout holds its JSON alone."""
    server, settings = own_redis()
    process = subprocess.Popen(
        # No worker until after the restart: the submit is told to wait for one (it fails fast otherwise).
        [
            sys.executable,
            "-m",
            "ttsq.cli.main",
            "submit",
            "One job across a restart.",
            "--json",
            "--timeout",
            "240",
            "--wait-for-worker",
        ],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    stdout, stderr = Lines(process.stdout), Lines(process.stderr)
    try:
        wait_until(lambda: any(ACCEPTED.match(line) for _, line in stderr.lines), 60, "the job id")
        server.stop(keep_data=True)
        time.sleep(OUTAGE_S)
        server.start()
        time.sleep(WAIT_RECHECK_S + 1)  # the wait has met the restart on both its reads and its listening
        assert process.poll() is None, stderr.text()  # still waiting: not an exit at the first Redis error
        start_worker(settings)
        process.wait(240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        stdout.join()
        stderr.join()
    assert process.returncode == 0, stderr.text()
    result = json.loads(stdout.text())
    assert result["duration_s"] > 0 and not result["cached"]
    (match,) = [match for _, line in stderr.lines if (match := ACCEPTED.match(line))]
    assert json.loads(run_cli("status", match.group(1), "--json", settings=settings).stdout)["state"] == "SUCCESS"
