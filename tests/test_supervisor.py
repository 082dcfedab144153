"""The launcher, ``ttsq worker --devices``, as a real process with real worker children.

Each test starts the launcher the way an operator does, submits real jobs through Redis, and kills or
signals real processes. Worker output goes to the launcher's log (the children inherit it).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from support import FAULTY, Launcher, queue_length, scrape, value

from ttsq.app import queues_for
from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.constants import ACCEPTED_PREFIX, RECEIVED_KEY, RESTARTS_KEY, UNSEEN_PREFIX
from ttsq.delivery.broker import held
from ttsq.errors import JobError
from ttsq.ops.redis_server import free_port
from ttsq.records.owner import RedisOwner

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow


@pytest.fixture
def launch(tmp_path: Path) -> Iterator[Callable[..., Launcher]]:
    started: list[Launcher] = []

    def start(settings: Settings, devices: str, **kwargs: object) -> Launcher:
        launcher = Launcher(settings, devices, tmp_path / f"launcher{len(started)}.log", **kwargs)  # type: ignore[arg-type]
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.stop()


def texts(n: int, tag: str) -> list[str]:
    """Distinct sentences long enough that a batch takes a moment (encode included)."""
    filler = "The quick brown fox jumps over the lazy dog while the workers keep the queue moving. "
    return [f"{tag} job number {i}. {filler}" for i in range(n)]


def wait_all(client: Client, jobs: list[Job], timeout: float = 120.0) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    return [dict(job.wait(timeout=max(1.0, deadline - time.monotonic()))) for job in jobs]


def unfinished(settings: Settings, client: Client, jobs: list[Job]) -> str:
    """The jobs without a final result: their state, their ledger record, and where their messages are."""
    with (
        redis.Redis.from_url(settings.cache_url, decode_responses=True) as cache,
        redis.Redis.from_url(settings.broker_url) as broker,
    ):
        return _unfinished(settings, client, jobs, cache, broker)


def _unfinished(settings: Settings, client: Client, jobs: list[Job], cache: redis.Redis, broker: redis.Redis) -> str:
    lines = []
    for job in jobs:
        task_id = job.id or ""
        state = client.async_result(task_id).state
        if state == "SUCCESS":
            continue
        record = cache.hgetall(ACCEPTED_PREFIX + task_id)
        record.pop("kwargs", None)
        unseen = [queue for queue in queues_for(settings.queue) if cache.zscore(UNSEEN_PREFIX + queue, task_id)]
        found = held(broker, {task_id}, queues_for(settings.queue))
        lines.append(
            f"{task_id}: {state}, record {record}, unseen {unseen}, received {cache.zscore(RECEIVED_KEY, task_id)},"
            f" message queued or held: {bool(found)}"
        )
    return f"{len(lines)} unfinished: " + "; ".join(lines)


def done_ids(client: Client, jobs: list[Job]) -> set[str]:
    return {job.id for job in jobs if job.id and client.async_result(job.id).state == "SUCCESS"}


def test_two_workers_share_a_burst_and_a_killed_one_loses_nothing(
    settings: Settings,
    launch: Callable[..., Launcher],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    # A short visibility timeout: the killed worker's jobs come back in seconds, not an hour. (Not
    # shorter: on a loaded machine a live worker's jobs would outlive it and run twice; harmless,
    # but slow.)
    # Config refuses a visibility timeout a healthy job could outlive (job timeout + storage tries).
    # The test engine (espeak, one second slower per batch on "[slow]") keeps each batch in flight long
    # enough to kill cpu1 while it holds messages and is not fetching: kombu's Redis transport pops a
    # message and then records it as unacked, and a process killed between the two loses that message
    # (celery/celery#7950; docs/guarantees.md names this limit).
    events = tmp_path / "batches.log"
    monkeypatch.setenv("FAULTY_ENGINE_EVENTS", str(events))
    settings = settings.replace(
        engine=faulty_engine,
        visibility_timeout_s=30,
        job_timeout_s=15,
        storage_attempts=1,
        storage_timeout_s=2,
        metrics_port=free_port_pair(),
    )
    launcher = launch(settings, "cpu:2")
    pids = launcher.wait_ready(["cpu0@test", "cpu1@test"])
    client = Client(settings)
    jobs = [client.submit(f"[slow] {text}", format="mp3") for text in texts(48, "burst")]

    def batches_of(pid: int) -> int:
        lines = events.read_text().splitlines() if events.exists() else []
        return sum(1 for line in lines if line.split()[0] == str(pid))

    # Kill cpu1 just after its second batch starts (its first is done), once both workers have refilled
    # their prefetch (8 held each): it holds unacked messages and has no fetch in flight.
    broker = redis.Redis.from_url(settings.broker_url)
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline, launcher.log()
        seen = batches_of(pids["cpu1@test"])
        while batches_of(pids["cpu1@test"]) == seen:
            assert time.monotonic() < deadline, launcher.log()
            time.sleep(0.005)
        started = time.monotonic()
        while broker.hlen("unacked") < 16 and time.monotonic() - started < 0.5:
            time.sleep(0.005)
        if seen >= 1 and broker.hlen("unacked") == 16 and time.monotonic() - started < 0.5:
            break
    waiting = queue_length(settings)
    unacked = broker.hlen("unacked")
    os.kill(pids["cpu1@test"], signal.SIGKILL)
    broker.close()
    assert waiting > 0 and unacked > 0, "the burst ended before the kill; the test proves nothing"

    try:
        results = wait_all(client, jobs)
    except JobError as exc:  # what the ledger and the workers did with the unfinished jobs says why
        seen = unfinished(settings, client, jobs)
        raise AssertionError(f"{exc}; {seen}; the log ends: {launcher.log()[-20000:]}") from exc
    assert len(results) == 48 and all(r["duration_s"] > 0 for r in results)  # type: ignore[operator]
    assert {r["worker"] for r in results} == {"cpu0@test", "cpu1@test"}
    log = launcher.log()
    assert f"cpu1@test (pid {pids['cpu1@test']}) died: killed by SIGKILL" in log
    assert "restart #1" in log
    assert "redelivered" in log  # the dead worker's unacked jobs ran again elsewhere
    # ... within seconds: the launcher marked it dead, and a worker gave back what it held.
    assert f"worker process cpu1@test#{pids['cpu1@test']} died (its launcher saw it exit)" in log
    # Every worker line names its worker: both write into the launcher's output.
    assert " INFO cpu0@test ttsq." in log and " INFO cpu1@test ttsq." in log
    assert int(redis.Redis.from_url(settings.cache_url).hget(RESTARTS_KEY, "cpu1@test") or 0) == 1
    # the restarted worker is back under the same name, with a new pid
    new_pids = launcher.wait_ready(["cpu0@test", "cpu1@test"])
    assert new_pids["cpu1@test"] != pids["cpu1@test"] and new_pids["cpu0@test"] == pids["cpu0@test"]
    assert queue_length(settings) == 0
    # Each worker serves its own metrics on base port + N, and cpu1's counts its restart.
    for index, node in enumerate(["cpu0@test", "cpu1@test"]):
        samples = scrape(settings.metrics_port + index)
        assert value(samples, "ttsq_worker_info", node=node, engine=FAULTY, model=results[0]["model"]) == 1
        assert value(samples, "ttsq_worker_restarts_total", node=node) == (1 if node == "cpu1@test" else 0)
    client.close()


def free_port_pair() -> int:
    """A port P with P + 1 free as well (the launcher's second worker takes P + 1)."""
    import socket

    while True:
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("0.0.0.0", port + 1))
                return port
            except OSError:
                continue


def test_sigterm_finishes_the_batch_in_flight_and_requeues_the_rest(
    settings: Settings, launch: Callable[..., Launcher]
) -> None:
    launcher = launch(settings, "cpu:1")
    launcher.wait_ready(["cpu0@test"])
    client = Client(settings)
    jobs = [client.submit(text, format="mp3") for text in texts(40, "drain")]
    while not done_ids(client, jobs):  # the worker is busy: a batch is in flight
        time.sleep(0.02)
    launcher.signal(signal.SIGTERM)
    assert launcher.wait() == 0
    log = launcher.log()
    assert "draining: SIGTERM sent to 1 worker(s)" in log
    # Tasks finished after the signal: the batches in flight completed instead of being dropped.
    after_signal = log.split("Warm shutdown", 1)[1]
    assert "succeeded in" in after_signal

    done = done_ids(client, jobs)
    # Everything is accounted for: acked and done, or back on the queue at once; nothing in limbo.
    assert redis.Redis.from_url(settings.broker_url).hlen("unacked") == 0
    assert len(done) + queue_length(settings) == 40 and len(done) < 40

    # A fresh launcher finishes the rest, and no job runs twice.
    second = launch(settings, "cpu:1")
    results = wait_all(client, jobs)
    assert len({r["key"] for r in results}) == 40
    second.signal(signal.SIGTERM)
    assert second.wait() == 0  # and its log is complete
    window = RedisOwner(settings, role="test").stats.window(30)  # what `ttsq stats` counts
    assert window["synthesized"] == 40
    assert window["cached_worker"] == 0
    for job in jobs:
        assert (launcher.log() + second.log()).count(f"Task ttsq.synthesize[{job.id}] succeeded") == 1
    client.close()


def test_second_sigterm_stops_hard_and_the_jobs_come_back(settings: Settings, launch: Callable[..., Launcher]) -> None:
    settings = settings.replace(visibility_timeout_s=30, job_timeout_s=15, storage_attempts=1, storage_timeout_s=2)
    launcher = launch(settings, "cpu:1")
    launcher.wait_ready(["cpu0@test"])
    client = Client(settings)
    jobs = [client.submit(text, format="mp3") for text in texts(40, "hard")]
    while not done_ids(client, jobs):
        time.sleep(0.02)
    launcher.signal(signal.SIGTERM)
    while "draining" not in launcher.log():  # two signals at once would arrive as one
        time.sleep(0.02)
    launcher.signal(signal.SIGTERM)
    launcher.wait()
    assert "second signal: cold shutdown" in launcher.log()
    launch(settings, "cpu:1")
    assert len(wait_all(client, jobs)) == 40  # nothing lost
    client.close()


def test_a_worker_with_bad_settings_is_not_restarted_forever(
    settings: Settings, launch: Callable[..., Launcher]
) -> None:
    launcher = launch(settings.replace(engine="no-such-engine"), "cpu:2")
    assert launcher.wait(timeout=120) == 2
    log = launcher.log()
    assert "not restarting it" in log and "restart #" not in log


def test_no_gpu_means_one_cpu_worker_and_says_so(settings: Settings, launch: Callable[..., Launcher]) -> None:
    launcher = launch(settings, "all", env={"CUDA_VISIBLE_DEVICES": ""})
    launcher.wait_ready(["cpu0@test"])
    assert "no GPU found" in launcher.log()
    assert Client(settings).submit("One CPU worker.").wait(timeout=60)["worker"] == "cpu0@test"
    launcher.signal(signal.SIGTERM)
    assert launcher.wait() == 0
