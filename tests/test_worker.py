"""The worker's side of a job, through real ``ttsq worker`` processes: re-check, store, index, logs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from support import WorkerProcess, queue_length, s3_keys, wait_until

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.errors import InvalidRequest, StorageError
from ttsq.records.deadletters import DeadLetters
from ttsq.records.owner import RedisOwner

StartWorker = Callable[..., WorkerProcess]


def test_a_redelivered_job_is_answered_from_the_cache(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings)
    client = Client(settings)
    first = client.submit("Delivered twice.").wait(timeout=30)
    stats = RedisOwner(settings, role="test").stats
    # What `ttsq stats` counts; a worker writes its counts once a second.
    wait_until(lambda: stats.window(5)["synthesized"] >= 1, 10, "the first job counted")
    before = stats.window(5)
    # The same message again, as Redis would redeliver it: straight onto the queue, no producer check.
    again = (
        make_app(settings)
        .send_task("ttsq.synthesize", kwargs={"text": "Delivered twice."}, queue=settings.queue)
        .get(timeout=30)
    )
    assert again["cached"] is True and again["key"] == first["key"] and again["batch_size"] == 0
    wait_until(lambda: stats.window(5)["cached_worker"] > before["cached_worker"], 10, "the cache hit counted")
    after = stats.window(5)
    assert after["synthesized"] == before["synthesized"] == 1
    assert after["cached_worker"] == before["cached_worker"] + 1


def test_pickle_messages_are_refused_not_executed(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    from celery import Celery

    worker = start_worker(settings)
    marker = tmp_path / "pwned"
    attacker = Celery(broker=settings.broker_url, backend=settings.result_backend)
    attacker.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    attacker.send_task(
        "ttsq.synthesize", kwargs={"text": Exploit(str(marker))}, queue=settings.queue, serializer="pickle"
    )
    # The worker keeps serving: a normal job right after the bad message completes.
    assert Client(settings).submit("Still alive.").wait(timeout=30)["duration_s"] > 0
    assert not marker.exists()
    assert queue_length(settings) == 0  # refused and dropped, not left to be redelivered forever
    assert "refused (encoding: content type 'application/x-python-serialize'" in worker.log()
    letters = DeadLetters(redis.Redis.from_url(settings.broker_url)).letters()
    assert [(letter.reason, letter.task) for letter in letters] == [("encoding", "ttsq.synthesize")]


class Exploit:
    """Unpickling this runs a command: what a pickle-accepting worker would execute."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str]]:
        import os

        return (os.system, (f"touch {self.path}",))


def test_worker_logs_never_show_the_text_or_the_url(settings: Settings, start_worker: StartWorker) -> None:
    worker = start_worker(settings)
    secret = "Confidential sentence about project Nightingale."
    result = Client(settings).submit(secret).wait(timeout=30)
    bad = make_app(settings).send_task(
        "ttsq.synthesize", kwargs={"text": secret, "format": "aiff"}, queue=settings.queue
    )
    with pytest.raises(InvalidRequest):
        bad.get(timeout=30)
    assert worker.stop() == 0  # SIGTERM: warm shutdown, clean exit
    log = worker.log()
    assert "succeeded" in log and "InvalidRequest" in log  # the log was written
    assert "Nightingale" not in log
    assert result["url"].split("?")[0] not in log and "Signature" not in log


def test_frame_cap_truncation_is_flagged_in_the_result(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings)
    result = (
        Client(settings)
        .submit("This sentence is far longer than five frames of audio.", max_new_tokens=5)
        .wait(timeout=30)
    )
    assert result["truncated"] is True
    assert result["duration_s"] == pytest.approx(5 / 12.5, abs=0.01)
    assert Client(settings).submit("Short.").wait(timeout=30)["truncated"] is False


def test_storage_down_at_the_worker_fails_the_job_and_indexes_nothing(
    settings: Settings, start_worker: StartWorker
) -> None:
    from ttsq.ops.redis_server import free_port

    broken = start_worker(settings.replace(s3_endpoint_url=f"http://127.0.0.1:{free_port()}"), name="broken")
    client = Client(settings)
    job = client.submit("Nowhere to put this.")
    with pytest.raises(StorageError):
        job.wait(timeout=60)
    assert job.key is not None and RedisOwner(settings, role="test").cache_index.get(job.key) is None
    assert s3_keys(settings) == []
    # The failed job let go of its single-flight claim: the same request, resubmitted once storage
    # is back, is a new job that succeeds (not a join onto the failed one).
    broken.stop()
    start_worker(settings, name="healthy")
    again = client.submit("Nowhere to put this.")
    assert again.id != job.id and not again.joined
    assert again.wait(timeout=30)["key"] == job.key
    assert len(s3_keys(settings)) == 1
    client.close()


def test_cache_hit_reports_what_the_first_result_did(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings)
    client = Client(settings)
    first = client.submit("Same answer twice.", instruct="a deep voice").wait(timeout=30)
    again = client.submit("Same answer twice.", instruct="a deep voice").wait(timeout=30)
    assert again["cached"] and not first["cached"]
    assert again["ignored"] == first["ignored"] == ["instruct"]
    assert {k: v for k, v in again.items() if k not in ("cached", "batch_size", "timings", "url", "worker")} == {
        k: v for k, v in first.items() if k not in ("cached", "batch_size", "timings", "url", "worker")
    }
    client.close()


def test_a_job_the_worker_rejects_still_releases_the_producers_claim(
    settings: Settings, start_worker: StartWorker
) -> None:
    import redis

    start_worker(settings.replace(max_text_chars=10))  # stricter than the producer's 5000
    with Client(settings) as client:
        client.submit("short").wait(timeout=30)  # the worker's model is now known to producers
        job = client.submit("A sentence the worker finds too long.")
        assert job.key is not None
        with pytest.raises(InvalidRequest):
            job.wait(timeout=30)
        assert redis.Redis.from_url(settings.cache_url).keys("ttsq:inflight:*") == []
        # and the next identical submit is a new job, not a join onto the failed one
        again = client.submit("A sentence the worker finds too long.")
        assert not again.joined and again.id != job.id
