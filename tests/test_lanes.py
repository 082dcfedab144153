"""Lanes and fair shares (docs/scheduling.md), on real workers, a real Redis and real storage.

Interactive work goes first and bulk work keeps a guaranteed share; while a queue's list is full, a
tenant's jobs wait in its own place and workers release the tenants' jobs in round robin; a job cancelled
while it waits never runs; and nothing that waits is lost when a worker dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest
import redis
from support import WorkerProcess, run_cli, s3_keys, wait_until

from ttsq.app import queue_for
from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.engines.base import EngineIdentity
from ttsq.errors import InvalidRequest
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key
from ttsq.records.owner import RedisOwner
from ttsq.records.plans import SENT, chunk_task_ids

StartWorker = Callable[..., WorkerProcess]


def finished_order(client: Client, jobs: list[Job], timeout: float = 120.0) -> list[Job]:
    """The jobs, in the order their results were stored (Celery's ``date_done``)."""
    for job in jobs:
        job.wait(timeout=timeout)
    done = {job.id: datetime.fromisoformat(client.app.backend.get_task_meta(job.id)["date_done"]) for job in jobs}
    return sorted(jobs, key=lambda job: done[job.id])


def test_lane_and_tenant_are_checked_and_are_no_part_of_the_content_key() -> None:
    identity = EngineIdentity(engine="espeak", model="espeak-ng", revision="1", sample_rate=22050)
    plain = SynthesisRequest.from_dict({"text": "안녕하세요"})
    scheduled = SynthesisRequest.from_dict({"text": "안녕하세요", "lane": "bulk", "tenant": "team-a"})
    assert content_key(plain, identity) == content_key(scheduled, identity)
    assert scheduled.to_dict()["lane"] == "bulk" and "lane" not in plain.to_dict()
    for field, value in (("lane", "urgent"), ("lane", 3), ("tenant", "sk-секрет"), ("tenant", "a" * 65), ("tenant", 7)):
        with pytest.raises(InvalidRequest) as refused:
            SynthesisRequest.from_dict({"text": "x", field: value})
        assert refused.value.field == field


def test_interactive_jobs_go_first_and_bulk_keeps_its_share(settings: Settings, start_worker: StartWorker) -> None:
    # One job at a time, no fair-share window: the order the worker takes messages in is the order they finish.
    settings = settings.replace(max_batch=1, release_window=0, bulk_share_percent=20)
    client = Client(settings)
    bulk = [client.submit(f"Bulk sentence number {i}.", lane="bulk") for i in range(20)]
    interactive = [client.submit(f"Interactive sentence number {i}.") for i in range(30)]
    assert {job.id for job in bulk} <= set(_queued_ids(settings, queue_for(settings.queue, "voice_design", "bulk")))
    start_worker(settings)
    order = finished_order(client, bulk + interactive)
    bulk_ids = {job.id for job in bulk}
    first = [job.id in bulk_ids for job in order[:25]]
    # Strict priority would finish all 30 interactive jobs first; FIFO over both, the 20 bulk ones. Bulk's
    # share is one message in five while both lanes have work (the worker prefetches two at its start).
    assert 3 <= sum(first) <= 8, [("B" if b else "I") for b in first]
    assert sum(first[:10]) <= 3, "interactive work did not go first"
    client.close()


def test_tenants_are_released_in_round_robin_and_a_cancelled_waiting_job_never_runs(
    settings: Settings, start_worker: StartWorker
) -> None:
    settings = settings.replace(max_batch=1, release_window=2)
    client = Client(settings)
    big = [client.submit(f"Tenant A sentence {i}.", tenant="tenant-a") for i in range(24)]
    small = [client.submit(f"Tenant B sentence {i}.", tenant="tenant-b") for i in range(5)]
    cancelled = client.submit("Tenant B changes its mind about this one.", tenant="tenant-b")
    queue = settings.queue
    # No worker yet: two jobs wait in the list, the rest in their tenants' places, visible in `ttsq stats`.
    snap = json.loads(run_cli("stats", "--json", "--ping-timeout", "0", settings=settings).stdout)
    (row,) = [q for q in snap["queues"] if q["queue"] == queue]
    assert row["depth"] == 2 and row["deferred"] == {"tenant-a": 22, "tenant-b": 6}
    assert client.cancel(cancelled.id) == "REVOKED"
    start_worker(settings)
    order = [job.id for job in finished_order(client, big + small)]
    last_small = max(order.index(job.id) for job in small)
    # Round robin: B's five interleave with A's jobs instead of waiting for all 24 of them.
    assert last_small <= 2 + 2 * len(small) + 2, order
    assert client.status(cancelled.id)["state"] == "REVOKED"
    time.sleep(1.0)  # a release after the cancel would have run by now
    assert len(s3_keys(settings)) == len(big) + len(small)  # the cancelled one never ran
    client.close()


@pytest.mark.parametrize("cap", [0, 1])
def test_a_documents_chunks_take_turns_with_other_tenants_under_the_release_window(
    settings: Settings, start_worker: StartWorker, faulty_engine: str, cap: int
) -> None:
    # A document's chunks count under the release window as any job does: its eight chunks wait in their
    # tenant's chunk place instead of filling the list, so another tenant's job sent after the fan-out
    # gets its turn within a few chunks, not behind all of them; and nothing is left waiting. Under a
    # cap of one job in flight, the document is its tenant's one job: its chunks, which it waits for,
    # are held to no cap (in the tenant's own place they would wait for the document forever).
    settings = settings.replace(
        engine=faulty_engine, max_batch=1, release_window=1, doc_target_chars=1, tenant_max_in_flight=cap
    )
    start_worker(settings)
    client = Client(settings)
    owner = RedisOwner(settings, role="test")
    text = " ".join(f"[slow] Chunk sentence number {n} of a long document." for n in range(8))
    try:
        document = client.submit_document(text, tenant="tenant-a")
        doc_id = document.id or ""
        wait_until(lambda: owner.plans.fan_out_state(doc_id) == SENT, 30, "the fan-out")
        other = client.submit("[slow] Tenant B has one job.", lane="bulk", tenant="tenant-b")
        assert len(document.wait(timeout=120)["chunks"]) == 8  # type: ignore[typeddict-item]
        other.wait(timeout=60)
        backend = client.app.backend
        chunks = [datetime.fromisoformat(backend.get_task_meta(i)["date_done"]) for i in chunk_task_ids(doc_id, 8)]
        done = datetime.fromisoformat(backend.get_task_meta(other.id)["date_done"])
        before = sum(chunk < done for chunk in chunks)
        # Ahead of it at most: the two chunks the worker holds, the two the window lets into the list
        # (one unseen more than the window), and one turn of the chunks' place. Behind all eight before.
        assert before <= 5, f"tenant B's job finished after {before} of the document's 8 chunks"
        assert not list(owner.cache.scan_iter("ttsq:deferred:*")), "chunks left waiting"
    finally:
        owner.close()
        client.close()


@pytest.mark.slow
def test_no_deferred_job_is_lost_or_run_twice_when_a_worker_dies(settings: Settings, start_worker: StartWorker) -> None:
    settings = settings.replace(max_batch=2, release_window=4, lost_job_grace_s=2)
    client = Client(settings)
    jobs = [client.submit(f"Tenant {i % 3} says sentence {i}.", tenant=f"t{i % 3}") for i in range(60)]
    first = start_worker(settings, "w1")
    wait_until(lambda: len(s3_keys(settings)) >= 10, 60, "the first worker to make some clips")
    first.stop(signal.SIGKILL)
    start_worker(settings, "w2")
    for job in jobs:
        assert job.wait(timeout=120)["duration_s"] > 0
    keys = s3_keys(settings)
    assert len(keys) == len(set(keys)) == len(jobs)
    cache = redis.Redis.from_url(settings.cache_url)
    try:
        assert not [key for key in cache.scan_iter("ttsq:deferred:*")], "jobs left waiting"
    finally:
        cache.close()
    client.close()


def _queued_ids(settings: Settings, queue: str) -> list[str]:
    broker = redis.Redis.from_url(settings.broker_url)
    try:
        return [json.loads(raw)["headers"]["id"] for raw in broker.lrange(queue, 0, -1)]
    finally:
        broker.close()


@pytest.mark.slow
def test_the_lanes_benchmark_runs(tmp_path: Path) -> None:
    script = Path(__file__).parent.parent / "benchmarks" / "lanes.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    args = ["--capacity-jobs", "16", "--seconds", "2", "--backlog", "60", "--tenants", "60,20,6", "--stagger", "0.5"]
    out = subprocess.run([sys.executable, str(script), *args], capture_output=True, timeout=600, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    report = json.loads(out.stdout.decode()[out.stdout.decode().index("{\n") :])
    assert report["idle"]["jobs"] == report["backlog"]["jobs"] > 0
    for run in (
        "together_fair",
        "together_capped",
        "together_fifo",
        "staggered_fair",
        "staggered_capped",
        "staggered_fifo",
    ):
        assert report[f"tenants_{run}"]["small_last_s"] > 0
