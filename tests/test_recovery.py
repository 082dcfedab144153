"""Recovery in seconds: what a dead worker process held goes back to its queue at once, not after the
visibility timeout (an hour by default), and never what a live worker holds.

Workers run ``tests/faulty_engine.py`` (espeak that dawdles or kills itself on cue); the kill is a real
SIGKILL of a real worker process; Redis, Celery and the storage are the real ones.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from document_corpus import corpus
from support import WorkerProcess, run_cli, wait_until

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import HOLDER_TTL_S, REQUEUED_STATE
from ttsq.errors import JobError
from ttsq.records.holders import Holders, incarnation
from ttsq.records.owner import RedisOwner

#: Whole-file: real workers killed and recovered, a minute on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def faulty(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faulty_engine: str) -> Settings:
    """Faulty-engine workers with the default visibility timeout: nothing here may wait for it."""
    monkeypatch.setenv("FAULTY_ENGINE_EVENTS", str(tmp_path / "batches.log"))
    monkeypatch.setenv("FAULTY_ENGINE_DONE", str(tmp_path / "done.log"))
    return settings.replace(engine=faulty_engine, visibility_timeout_s=Settings().visibility_timeout_s)


def lines(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


def test_a_document_whose_worker_is_killed_completes_within_a_minute_and_nothing_twice(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    assert faulty.visibility_timeout_s == 3600
    doomed = start_worker(faulty, "doomed")
    survivor = start_worker(faulty, "survivor")
    assert doomed.process is not None and survivor.process is not None
    # Twenty-four paragraphs, one chunk each; every batch dawdles a second, so the doomed worker holds
    # chunks (in its engine and prefetched) when it is killed.
    text = "\n\n".join(
        f"Paragraph {i} [slow]. The ferry left the harbour at dawn, and the gulls followed it out to sea."
        for i in range(24)
    )
    with Client(faulty) as client:
        job = client.submit_document(text, language="english")
        deadline = time.monotonic() + 60
        while not any(pid == str(doomed.process.pid) for pid, _ in lines(tmp_path / "batches.log")):
            assert time.monotonic() < deadline, "the doomed worker never started a batch"
            time.sleep(0.05)
        doomed.process.send_signal(signal.SIGKILL)
        doomed.process.wait(timeout=10)
        killed_at = time.monotonic()
        try:
            result = job.wait(timeout=120)
        except JobError as exc:  # what the survivor did with the document says why
            status = client.status(job.id or "")
            raise AssertionError(f"{exc}; status {status}; the survivor's log ends: {survivor.log()[-20000:]}") from exc
        took = time.monotonic() - killed_at
    assert took < 60, f"the document took {took:.0f} s after the kill"
    assert result["document"]["chunks"] == 24
    # Nothing the survivor made was made twice. A batch the doomed worker finished in its engine may
    # have died with it before it was stored: that one alone is made again.
    survivor_pid = str(survivor.process.pid)
    done = Counter(digest for pid, digest in lines(tmp_path / "done.log") if pid == survivor_pid)
    assert done and max(done.values()) == 1, done.most_common(3)
    doomed_pid = str(doomed.process.pid)
    assert all(pid in (survivor_pid, doomed_pid) for pid, _ in lines(tmp_path / "done.log"))
    assert survivor.process.poll() is None
    # What it held went back through recovery (the survivor says so), and the dead process is forgotten.
    assert "went back to the queue" in survivor.log()
    owner = RedisOwner(faulty, role="test")
    try:
        assert incarnation("doomed@test", doomed.process.pid) not in owner.holders.states()
    finally:
        owner.close()


def test_ttsq_status_says_the_worker_died_and_the_job_waits_to_run_again(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    armed = tmp_path / "armed"
    armed.touch()
    monkeypatch.setenv("FAULTY_ENGINE_ARMED", str(armed))
    doomed = start_worker(faulty, "doomed")
    # A worker of another queue: it runs none of this queue's jobs, but gives back what dead ones held.
    start_worker(faulty.replace(queue=faulty.queue + "-other"), "bystander")
    with Client(faulty) as client:
        job = client.submit("[crash] The lighthouse keeper counted the ships.")
        assert doomed.process is not None
        doomed.process.wait(timeout=60)  # the engine killed its own process mid-batch
        armed.unlink()  # the bug is fixed: the job runs fine from now on
        deadline = time.monotonic() + HOLDER_TTL_S + 20
        while (status := client.status(job.id))["state"] != REQUEUED_STATE:
            assert status["state"] in ("PENDING", "STARTED"), status
            assert time.monotonic() < deadline, f"still {status['state']}"
            time.sleep(0.2)
        out = run_cli("status", job.id, "--json", settings=faulty)
        assert out.returncode == 0, out.stderr.decode()
        shown = json.loads(out.stdout)
        assert shown["state"] == REQUEUED_STATE
        human = run_cli("status", job.id, settings=faulty)
        assert "its worker doomed@test died; waiting to run again" in human.stdout.decode()
        # Back in its queue, not held: the next worker of the queue runs it.
        start_worker(faulty, "next")
        result = job.wait(timeout=60)
    assert result["duration_s"] > 0


def test_a_live_workers_messages_are_never_given_back(faulty: Settings, start_worker: StartWorker) -> None:
    owner = RedisOwner(faulty, role="test")
    try:
        holders: Holders = owner.holders
        worker = start_worker(faulty, "alive")
        assert worker.process is not None
        with Client(faulty) as client:
            jobs = [client.submit(f"[slow] Sentence number {i} for the live worker.") for i in range(6)]
            results = [job.wait(timeout=60) for job in jobs]
        assert all(r["duration_s"] > 0 for r in results)
        name = incarnation("alive@test", worker.process.pid)
        assert holders.states()[name] == "alive"
        # Every tag leaves the set with its ack, which follows the stored result by a moment (late acks).
        wait_until(lambda: holders.held(name) == [], 30, "every held tag gone with its ack")
        assert "went back to the queue" not in worker.log()
    finally:
        owner.close()


def test_a_stitch_longer_than_the_visibility_timeout_runs_once(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    """The worker keeps what it holds alive: kombu gives no message to a second worker while the first
    still works on it, however long (here an Opus stitch of 40 minutes of audio, past the smallest
    visibility timeout these settings allow).

    The smallest timeout comes from a short job timeout (8 s: 20 s of visibility; batches of four espeak
    chunks took 0.4 s at most against their 4-second limit), so a document of 12,000 characters is
    enough: its stitch took 31 s on an idle two-core machine (20,000 characters: 53 s), and longer beside
    the rest of the suite."""
    tight = settings.replace(job_timeout_s=8, storage_attempts=1, storage_timeout_s=2)
    tight = tight.replace(visibility_timeout_s=tight.min_visibility_timeout_s)
    first, second = start_worker(tight, "first"), start_worker(tight, "second")
    text = corpus(12_000)
    with Client(tight) as client:
        result = client.submit_document(text, format="ogg").wait(timeout=600)
    logs = first.log() + second.log()
    stitched = re.search(r"stitched \d+ chunks into \w+ \([\d.]+s audio\) in ([\d.]+)s", logs)
    assert stitched is not None, logs[-3000:]
    took = float(stitched.group(1))
    if took <= tight.visibility_timeout_s:
        pytest.skip(f"the stitch took {took:.0f} s, inside the visibility timeout ({tight.visibility_timeout_s} s)")
    # One delivery of the stitch message in all: kombu never gave it to the other worker (or back).
    assert len(re.findall(r"Task ttsq\.stitch\[[^\]]+\] received", logs)) == 1
    assert logs.count("stitched ") == 1
    assert result["format"] == "ogg" and result["duration_s"] > tight.visibility_timeout_s
