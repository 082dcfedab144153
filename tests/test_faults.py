"""Fault injection against real processes: worker death, poison jobs, a stuck engine, a Redis
restart, a storage outage, deadlines. Each test fails if a job is lost, stored twice or left
without a result.

Faults come from ``tests/faulty_engine.py`` (espeak that crashes, hangs or dawdles on cue), loaded
by the workers through ``TTSQ_ENGINE=faulty_engine:FaultyEngine``; nothing in ttsq is mocked.
Waits are generous bounds, never timings.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from support import WorkerProcess, run_cli, s3_keys, wait_until

from ttsq.app import make_app
from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.constants import EXIT_ENGINE_STUCK
from ttsq.engines.base import EngineIdentity
from ttsq.errors import BrokerError, DeadlineExceeded, InvalidRequest, JobError, JobParked, StorageError
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key
from ttsq.ops.redis_server import RedisServer, free_port
from ttsq.records.owner import RedisOwner
from ttsq.records.stats import FLUSH_INTERVAL_S

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

StartWorker = Callable[..., WorkerProcess]
TESTS = Path(__file__).parent
#: Kombu's sweep for abandoned messages runs every second (``unacked_restore_interval``).
RESTORE_INTERVAL_S = 1
#: Slack on top of a documented bound, for a loaded CI machine: generous on purpose.
SLACK_S = 60


@pytest.fixture
def faulty(settings: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, faulty_engine: str) -> Settings:
    """Settings for workers running the faulty engine, with a visibility timeout short enough
    that redelivery happens within a test (and the worst hold of a healthy job still fits in it)."""
    monkeypatch.setenv("FAULTY_ENGINE_EVENTS", str(tmp_path / "batches.log"))
    monkeypatch.setenv("FAULTY_ENGINE_HOLD", str(tmp_path / "hold"))
    return settings.replace(
        engine=faulty_engine, visibility_timeout_s=25, job_timeout_s=12, storage_attempts=1, storage_timeout_s=2
    )


def batches_started(tmp_path: Path, pid: int) -> int:
    path = tmp_path / "batches.log"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum(1 for line in lines if line.split()[0] == str(pid))


def unacked(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return int(client.hlen("unacked"))
    finally:
        client.close()


def where_is(settings: Settings, task_id: str, workers: list[WorkerProcess]) -> str:
    """Where a job that never finished went: for a failure message."""
    broker = redis.Redis.from_url(settings.broker_url)
    queued = any(task_id.encode() in raw for raw in broker.lrange(settings.queue, 0, -1))
    held = any(task_id.encode() in raw for raw in broker.hvals("unacked"))
    seen = [w.hostname for w in workers if task_id in w.log()]
    logs = " | ".join(f"{w.hostname}: {w.log_path}" for w in workers)
    return f"queued={queued} unacked={held} seen by {seen}; logs {logs}"


def expected_key(client: Client, text: str) -> str:
    identity = client.identities().get("voice_design")
    assert isinstance(identity, EngineIdentity)
    return content_key(SynthesisRequest.from_dict({"text": text}), identity)


def test_sigkill_mid_batch_every_job_completes_once_on_another_worker(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    # max_batch 4: the worker holds 8 messages (concurrency 2 x 4): one batch in the engine, one
    # batch prefetched behind it; 4 more wait in the queue.
    w1 = start_worker(faulty, name="w1")
    assert w1.process is not None
    client = Client(faulty)
    texts = [f"[slow] Sentence number {i} of the kill test." for i in range(12)]
    jobs = [client.submit(text) for text in texts]
    wait_until(
        lambda: batches_started(tmp_path, w1.process.pid) >= 1 and unacked(faulty) >= 8,
        30,
        "a batch in flight with the next one prefetched",
    )
    held = unacked(faulty)
    w1.process.send_signal(signal.SIGKILL)
    w1.process.wait(10)
    killed_at = time.monotonic()
    assert held == 8 and batches_started(tmp_path, w1.process.pid) == 1  # nothing of it finished

    w2 = start_worker(faulty, name="w2")
    # Documented bound: a dead worker's jobs come back at most visibility timeout + restore interval
    # after their delivery (they were all delivered before the kill).
    bound = faulty.visibility_timeout_s + RESTORE_INTERVAL_S + SLACK_S
    results = [job.wait(timeout=max(1.0, killed_at + bound - time.monotonic())) for job in jobs]

    assert [r["key"] for r in results] == [expected_key(client, text) for text in texts]  # correct, and each its own
    assert all(not r["cached"] and r["duration_s"] > 1 for r in results)
    keys = s3_keys(faulty)
    assert len(keys) == len(set(keys)) == len(texts)  # one object per job
    # Each synthesized once, as `ttsq stats` counts it: the killed worker finished none of its batch.
    stats = RedisOwner(faulty, role="test").stats  # a worker writes its counts once a second
    wait_until(lambda: stats.window(30)["synthesized"] >= len(texts), 10, "every job counted")
    time.sleep(FLUSH_INTERVAL_S * 2)
    assert stats.window(30)["synthesized"] == len(texts)
    assert unacked(faulty) == 0 and w2.process is not None and w2.process.poll() is None
    client.close()


def test_a_job_that_kills_every_worker_is_parked_and_can_be_retried(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    armed = tmp_path / "armed"
    armed.write_text("")
    settings = faulty.replace(max_attempts=2)
    monkeypatch.setenv("FAULTY_ENGINE_ARMED", str(armed))
    client = Client(settings)
    deaths = 0
    worker = start_worker(settings, name="w0")
    poison = client.submit("[crash] This request crashes the engine.")
    neighbours = [client.submit(f"An innocent neighbour, number {i}.") for i in range(3)]
    # A supervisor's job, done by hand: restart a dead worker, until the poison job has an answer.
    give_up = time.monotonic() + settings.max_attempts * (settings.visibility_timeout_s + SLACK_S)
    while not client.async_result(poison.id or "").ready():
        assert time.monotonic() < give_up, "the poison job never got a result"
        assert worker.process is not None
        if worker.process.poll() is not None:
            assert worker.process.returncode == -signal.SIGKILL
            deaths += 1
            worker = start_worker(settings, name=f"w{deaths}")
        time.sleep(0.1)

    with pytest.raises(JobParked, match="retry"):
        poison.wait(timeout=10)
    assert deaths == settings.max_attempts  # it did not cycle forever
    assert [job.wait(timeout=SLACK_S)["duration_s"] > 0 for job in neighbours] == [True] * 3
    listed = run_cli("failed", "--json", settings=settings)
    assert listed.returncode == 0, listed.stderr
    parked = json.loads(listed.stdout)
    assert [(p["id"], p["attempts"]) for p in parked] == [(poison.id, 2)]
    assert b"crashes" not in listed.stdout  # the operator's list shows no input text

    armed.unlink()  # the operator fixes the engine, then retries the job
    retried = run_cli("retry", poison.id or "", settings=settings)
    assert retried.returncode == 0 and poison.id in retried.stdout.decode(), retried.stderr
    try:
        assert client.wait(poison.id or "", timeout=SLACK_S)["duration_s"] > 0
    except JobError as exc:  # what the worker did with it says why
        raise AssertionError(f"the retried job failed: {exc}; the worker's log ends: {worker.log()[-5000:]}") from exc
    assert json.loads(run_cli("failed", "--json", settings=settings).stdout) == []
    assert worker.process is not None and worker.process.poll() is None
    client.close()


def test_a_stuck_engine_exits_the_worker_for_its_supervisor_and_its_jobs_are_redelivered(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    settings = faulty.replace(batch_timeout_s=3, max_attempts=1)
    w1 = start_worker(settings, name="w1")
    client = Client(settings)
    stuck = client.submit("[hang] This request hangs the engine.")
    # Another group (its seed): it waits in the worker behind the stuck batch, never enters the engine.
    neighbour = client.submit("A neighbour held by the stuck worker.", seed=7)
    assert w1.process is not None
    w1.process.wait(SLACK_S)  # the watchdog ends the process; no one sent it a signal
    assert w1.process.returncode == EXIT_ENGINE_STUCK
    assert "past the per-batch limit of 3s" in w1.log()

    start_worker(settings, name="w2")  # what systemd / compose restart: / ttsq worker --devices do
    bound = settings.visibility_timeout_s + RESTORE_INTERVAL_S + SLACK_S
    assert neighbour.wait(timeout=bound)["duration_s"] > 0
    with pytest.raises(JobParked):
        stuck.wait(timeout=bound)
    client.close()


def test_redis_restart_mid_burst_loses_no_accepted_job_and_workers_consume_after(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    server = RedisServer(directory=str(tmp_path / "redis"), appendonly=True)
    os.makedirs(server.directory)
    server.start()
    url = server.url
    settings = faulty.replace(engine="espeak", broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2")
    workers: list[WorkerProcess] = []
    try:
        workers += [start_worker(settings, name="w1"), start_worker(settings, name="w2")]
        accepted: list[tuple[str, Job]] = []
        refused: list[BrokerError] = []
        restarted = threading.Event()

        def burst() -> None:
            with Client(settings) as producer:
                for i in range(80):
                    text = f"Burst sentence {i} sent across a Redis restart."
                    try:
                        accepted.append((text, producer.submit(text)))
                    except BrokerError as exc:  # the documented answer while Redis is down
                        refused.append(exc)
                    time.sleep(0.05)
                    if restarted.is_set() and i >= 60:
                        break

        producer = threading.Thread(target=burst)
        producer.start()
        wait_until(lambda: len(accepted) >= 20, 60, "the first part of the burst")
        server.stop(keep_data=True)
        time.sleep(2)
        server.start()
        restarted.set()
        producer.join(120)
        assert not producer.is_alive()
        assert refused, "the burst never met the outage"
        assert all("cannot reach" in str(exc) for exc in refused)

        # Every job the producers were told was accepted has its result: nothing lost.
        client = Client(settings)
        bound = settings.visibility_timeout_s + RESTORE_INTERVAL_S + SLACK_S
        give_up = time.monotonic() + bound
        for text, job in accepted:
            try:
                result = (
                    client.wait(job.id or "", timeout=max(1.0, give_up - time.monotonic()))
                    if job.result is None
                    else job.result
                )
            except Exception as exc:
                raise AssertionError(
                    f"accepted job {job.id} has no result ({exc}); {where_is(settings, job.id or '', workers)}"
                ) from exc
            assert result["key"] == expected_key(client, text)
        keys = s3_keys(settings)
        assert len(keys) == len(set(keys)) == len({text for text, _ in accepted})
        # The known Celery failure mode is a worker that reconnects but never consumes again: new
        # work after the restart must be done, by both workers' queue.
        fresh = [client.submit(f"After the restart, sentence {i}.") for i in range(8)]
        assert all(job.wait(timeout=SLACK_S)["duration_s"] > 0 for job in fresh)
        assert [w.process.poll() if w.process else "not started" for w in workers] == [None, None]
        client.close()
    finally:
        # The workers first, while their Redis is there: without it each rides out its patience on the way
        # out (30 s), and the fixture's stop waits it out twice.
        for worker in workers:
            worker.stop()
        server.stop()


def redis_of_its_own(faulty: Settings, tmp_path: Path, *, appendonly: bool) -> tuple[RedisServer, Settings]:
    """A Redis this test may stop and start (its folder kept across), and settings on it whose visibility
    timeout (600 s) outlasts the test: nothing comes back by kombu's restore within it."""
    server = RedisServer(directory=str(tmp_path / "redis"), appendonly=appendonly)
    os.makedirs(server.directory)
    server.start()
    url = server.url
    settings = faulty.replace(
        broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2", visibility_timeout_s=600
    )
    return server, settings


def test_a_job_held_across_a_redis_restart_is_acknowledged_once_it_is_done(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    """A worker finishes the job it held when its broker connection dropped, and that job's ack, which
    cannot go on the connection the message came on, is made on a new one: no entry is left in kombu's
    ``unacked`` hash to run the job again when the visibility timeout passes (here long after the test)."""
    server, settings = redis_of_its_own(faulty, tmp_path, appendonly=True)
    hold = tmp_path / "hold"
    hold.touch()
    worker: WorkerProcess | None = None
    try:
        worker = start_worker(settings)
        assert worker.process is not None
        with Client(settings) as client:
            job = client.submit("[held] A job in the engine while Redis restarts.")
        wait_until(lambda: batches_started(tmp_path, worker.process.pid) >= 1, 30, "the held batch")
        assert unacked(settings) == 1
        server.stop(keep_data=True)
        time.sleep(1)
        server.start()
        hold.unlink()
        with Client(settings) as client:
            assert client.wait(job.id or "", timeout=SLACK_S)["duration_s"] > 0
            wait_until(lambda: unacked(settings) == 0, 30, "the held message acknowledged on a new connection")
            # The worker consumes on its new connection, and acknowledges there as ever.
            assert client.submit("After the restart.").wait(timeout=SLACK_S)["duration_s"] > 0
        # Its ack follows its stored result by a moment (Celery acks a late-ack task after storing it).
        wait_until(lambda: unacked(settings) == 0, 30, "the job after the restart acknowledged")
        assert "acknowledged 1 message(s) on a new broker connection" in worker.log()
        assert len(s3_keys(settings)) == 2 and worker.process.poll() is None
    finally:
        hold.unlink(missing_ok=True)
        if worker is not None:
            worker.stop()
        server.stop()


def test_a_job_whose_result_and_ack_a_restart_lost_runs_again_at_once(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    """Redis comes back without the writes of its last moments (here: a crash after a snapshot taken
    while the job was held; in production, a failover to a replica that had not received them): the
    job's result and ack are among them, and its entry is back in kombu's ``unacked`` hash. The worker
    takes up, on its new connection, the acks it made lately: this one's job has no result, so its
    message goes back to the queue and the job runs again now, not when the visibility timeout passes
    (600 s here, an hour by default); an ack made blindly would have left it with neither."""
    server, settings = redis_of_its_own(faulty, tmp_path, appendonly=False)
    hold = tmp_path / "hold"
    hold.touch()
    worker: WorkerProcess | None = None
    broker = redis.Redis.from_url(settings.broker_url)
    try:
        worker = start_worker(settings)
        assert worker.process is not None
        with Client(settings) as client:
            job = client.submit("[held] A job acknowledged just before Redis lost its last writes.")
            wait_until(lambda: batches_started(tmp_path, worker.process.pid) >= 1, 30, "the held batch")
            assert unacked(settings) == 1
            broker.save()  # what Redis will come back with: the job held, not yet acknowledged
            hold.unlink()
            assert client.wait(job.id or "", timeout=SLACK_S)["duration_s"] > 0
            wait_until(lambda: unacked(settings) == 0, 30, "the job acknowledged")
        server.stop(keep_data=True, crash=True)
        server.start()
        assert unacked(settings) == 1  # the ack was lost with the last writes, and so was the result
        with Client(settings) as client:
            assert client.wait(job.id or "", timeout=SLACK_S)["duration_s"] > 0
        wait_until(lambda: unacked(settings) == 0, 30, "the job run again acknowledged")
        assert "1 message(s) acknowledged before Redis lost its last writes have no result" in worker.log()
        assert worker.process.poll() is None
    finally:
        broker.close()
        hold.unlink(missing_ok=True)
        if worker is not None:
            worker.stop()
        server.stop()


def test_storage_outage_retries_with_backoff_and_completes_when_the_store_is_back(
    settings: Settings, start_worker: StartWorker
) -> None:
    from moto.server import ThreadedMotoServer

    port = free_port()
    # A second moto server in this process shares the session server's buckets; stopping it is an
    # outage of the store as the worker sees it.
    store = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    store.start()
    patient = settings.replace(
        s3_endpoint_url=f"http://127.0.0.1:{port}",
        storage_attempts=6,
        storage_backoff_ms=1000,
        storage_timeout_s=2,
        job_timeout_s=20,
        visibility_timeout_s=240,
    )
    worker = start_worker(patient)
    client = Client(patient)
    client.submit("Warm the producer's view of the model.").wait(timeout=30)
    store.stop()
    try:
        texts = [f"Stored after the outage, number {i}." for i in range(3)]
        jobs = [client.submit(text) for text in texts]
        wait_until(lambda: "failed (try 2 of 6" in worker.log(), 60, "the worker to retry the store")
    finally:
        store = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
        store.start()
    try:
        results = [job.wait(timeout=SLACK_S) for job in jobs]
        index = RedisOwner(patient, role="test").cache_index
        import boto3

        bucket, _, prefix = patient.storage_url.removeprefix("s3://").partition("/")
        s3 = boto3.client("s3", endpoint_url=settings.s3_endpoint_url)
        for result in results:
            entry = index.get(result["key"])
            assert entry is not None and entry["object_key"] == result["object_key"]
            # The indexed object is whole: its size is the size the worker encoded.
            head = s3.head_object(Bucket=bucket, Key=f"{prefix}/{result['object_key']}")
            assert head["ContentLength"] == result["bytes"] == entry["bytes"]
        assert len(s3_keys(patient)) == len(texts) + 1
    finally:
        store.stop()
        client.close()


def test_storage_retries_run_out_with_a_clear_error_and_nothing_indexed(
    settings: Settings, start_worker: StartWorker
) -> None:
    gone = settings.replace(
        s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
        storage_attempts=3,
        storage_backoff_ms=100,
        visibility_timeout_s=240,
    )
    start_worker(gone)
    job = Client(settings).submit("Nowhere to put this, ever.")
    with pytest.raises(StorageError, match="gave up after 3 tries"):
        job.wait(timeout=SLACK_S)
    assert job.key is not None and RedisOwner(settings, role="test").cache_index.get(job.key) is None
    assert s3_keys(settings) == []


def test_a_deadline_in_the_past_is_refused_at_the_edge(settings: Settings) -> None:
    with pytest.raises(InvalidRequest) as info:
        Client(settings).submit("Too late already.", deadline=time.time() - 1)
    assert info.value.field == "deadline"
    with pytest.raises(InvalidRequest, match="UNIX time"):
        Client(settings).submit("Relative by mistake.", deadline=30)


def test_a_job_past_its_deadline_is_dropped_before_synthesis(
    faulty: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    worker = start_worker(faulty)
    assert worker.process is not None
    client = Client(faulty)
    # Straight onto the queue with an expired deadline (a producer whose clock ran out in transit).
    app = make_app(faulty)
    expired = app.send_task(
        "ttsq.synthesize", kwargs={"text": "Expired in the queue.", "deadline": time.time() - 5}, queue=faulty.queue
    )
    with pytest.raises(DeadlineExceeded, match="before synthesis"):
        expired.get(timeout=30)
    # A deadline that passes while the job waits behind a batch the engine holds: dropped, not run late.
    hold = tmp_path / "hold"
    hold.touch()
    slow = client.submit("[held] A batch that keeps the engine busy.")
    try:
        wait_until(lambda: batches_started(tmp_path, worker.process.pid) >= 1, 30, "the held batch")
        deadline = time.time() + 0.5
        late = client.submit("Wanted within half a second.", deadline=deadline)
        time.sleep(max(0.0, deadline - time.time()) + 0.2)  # past its deadline while it waits
    finally:
        hold.unlink()
    with pytest.raises(DeadlineExceeded, match="dropped"):
        late.wait(timeout=30)
    assert slow.wait(timeout=30)["duration_s"] > 0
    assert len(s3_keys(faulty)) == 1  # the dropped jobs made nothing
    client.close()
