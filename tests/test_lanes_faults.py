"""Fair shares across a Redis restart: no accepted job is lost or run twice while jobs wait in their tenants'
places for release (docs/guarantees.md, the Redis restart row), on a redis-server of the test's own with the
compose file's AOF settings, stopped cleanly and started again on the same data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from support import WorkerProcess, s3_keys, wait_until

from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.ops.redis_server import RedisServer

#: Whole-file: a Redis of its own, restarted, and 40-job runs; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

StartWorker = Callable[..., WorkerProcess]
JOBS = 40


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server of this test's own, appending every write to its AOF (``appendfsync everysec``). Ask for
    it before ``start_worker``: it then stops after the test's workers, which need it to shut down cleanly."""
    (tmp_path / "redis").mkdir()
    server = RedisServer(directory=str(tmp_path / "redis"), appendonly=True, appendfsync="everysec").start()
    yield server
    server.stop()


def on(server: RedisServer, settings: Settings) -> Settings:
    url = server.url
    return settings.replace(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        cache_url=f"{url}/2",
        release_window=2,
        visibility_timeout_s=40,
        job_timeout_s=12,
        storage_attempts=1,
        storage_timeout_s=2,
        lost_job_grace_s=2,
    )


def submit_two_tenants(settings: Settings) -> list[tuple[str, Job]]:
    """40 jobs, 30 of tenant-a and 10 of tenant-b, distinct texts: each is one content key."""
    with Client(settings) as client:
        texts = [(f"Tenant {'b' if i % 4 == 3 else 'a'} says sentence {i}.", i % 4 == 3) for i in range(JOBS)]
        return [(text, client.submit(text, tenant="tenant-b" if b else "tenant-a")) for text, b in texts]


def waiting(settings: Settings) -> dict[str, int]:
    """What waits for release in the test's own Redis: deferred job ids per deferred list."""
    cache = redis.Redis.from_url(settings.cache_url)
    try:
        return {key.decode(): int(cache.llen(key)) for key in cache.scan_iter("ttsq:deferred:*")}
    finally:
        cache.close()


def restart(server: RedisServer) -> None:
    server.stop(keep_data=True)
    time.sleep(1)
    server.start()


def assert_each_completed_once(settings: Settings, jobs: list[tuple[str, Job]], workers: list[WorkerProcess]) -> None:
    with Client(settings) as client:
        for text, job in jobs:
            assert client.wait(job.id or "", timeout=120)["duration_s"] > 0, text
    keys = s3_keys(settings)
    assert len(keys) == len(set(keys)) == len({text for text, _ in jobs}) == JOBS
    # Content keys hide a second run (it overwrites the same object): the logs say how often each job ran.
    log = "".join(worker.log() for worker in workers)
    runs = {job.id: log.count(f"job {job.id}: synthesized") for _, job in jobs}
    assert set(runs.values()) == {1}, {job_id: n for job_id, n in runs.items() if n != 1}
    assert waiting(settings) == {}, "jobs left waiting for release"
    cache = redis.Redis.from_url(settings.cache_url)
    try:
        assert not cache.exists(f"ttsq:tenants:{settings.queue}"), "a tenant left in the release ring"
    finally:
        cache.close()


def test_jobs_waiting_for_release_survive_a_redis_restart_and_run_once(
    settings: Settings, own_redis: RedisServer, start_worker: StartWorker
) -> None:
    settings = on(own_redis, settings)
    jobs = submit_two_tenants(settings)
    deferred = {f"ttsq:deferred:{settings.queue}:tenant-a": 28, f"ttsq:deferred:{settings.queue}:tenant-b": 10}
    assert waiting(settings) == deferred  # two jobs in the list (the window), 38 waiting
    restart(own_redis)
    assert waiting(settings) == deferred  # the AOF kept them, in order
    worker = start_worker(settings)
    assert_each_completed_once(settings, jobs, [worker])


def test_a_redis_restart_while_the_worker_releases_loses_nothing_and_runs_nothing_twice(
    settings: Settings, own_redis: RedisServer, start_worker: StartWorker
) -> None:
    settings = on(own_redis, settings).replace(max_batch=1)  # one job at a time: most still wait at the restart
    jobs = submit_two_tenants(settings)
    worker = start_worker(settings)
    wait_until(lambda: len(s3_keys(settings)) >= 6, 60, "the worker to make some clips")
    before = sum(waiting(settings).values())
    restart(own_redis)
    assert before > 0, "every job was released before the restart: the test proved nothing"
    assert_each_completed_once(settings, jobs, [worker])
    assert worker.process is not None and worker.process.poll() is None, "the worker did not outlive the restart"
