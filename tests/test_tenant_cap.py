"""The per-tenant in-flight cap and per-tenant waits (docs/scheduling.md), on a real Redis and real workers.

A tenant never has more than ``TTSQ_TENANT_MAX_IN_FLIGHT`` jobs sent and not finished; the rest wait in
its place and go out as its jobs finish, while another tenant's job goes straight in. What a job that
ended counts is given back (a cancel, a finish, a record that went another way), so nothing is counted
forever. ``ttsq stats --json`` and the metrics show each tenant's waits.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

import pytest
import redis
from support import WorkerProcess, run_cli, s3_keys, scrape, value, wait_until

from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.constants import (
    ACCEPTED_PREFIX,
    DEFERRED_PREFIX,
    TENANT_IN_FLIGHT_PREFIX,
    TENANTS_IN_FLIGHT_PREFIX,
    WAITS_PREFIX,
)
from ttsq.observer import JobReport
from ttsq.ops.redis_server import free_port
from ttsq.records.owner import RedisOwner
from ttsq.records.stats import OTHER_TENANT, WAIT_TENANTS_PER_MINUTE, FleetObserver, tenant_waits
from ttsq.worker.metrics import Metrics

StartWorker = Callable[..., WorkerProcess]


class Sampler:
    """Reads, in one transaction at a time, which of a tenant's jobs are in flight by their records (a
    record without the ``deferred`` mark: sent and not finished) and how many of them the queue's list
    holds, as often as it can until stopped; keeps the most of each it saw. Optionally watches that no
    job of ``later`` is received (``seen_at``, or finished) before ``first`` is."""

    def __init__(self, settings: Settings, ids: list[str], *, every_s: float = 0.005) -> None:
        self.ids = ids
        self.every_s = every_s
        self.most_in_flight = 0
        self.most_listed = 0
        self.samples = 0
        self.first: str | None = None
        self.later: list[str] = []
        self.overtaken: list[str] = []
        self._cache = redis.Redis.from_url(settings.cache_url)
        self._broker = redis.Redis.from_url(settings.broker_url)
        self._queue = settings.queue
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._cache.close()
        self._broker.close()

    def in_flight(self) -> int:
        with self._cache.pipeline(transaction=True) as pipe:
            for task_id in self.ids:
                pipe.hexists(ACCEPTED_PREFIX + task_id, "task")  # a finished job leaves its owner only
                pipe.hexists(ACCEPTED_PREFIX + task_id, "deferred")
            found = pipe.execute()
        return sum(1 for at in range(0, len(found), 2) if found[at] and not found[at + 1])

    def finished(self) -> set[str]:
        with self._cache.pipeline(transaction=True) as pipe:
            for task_id in self.ids:
                pipe.hexists(ACCEPTED_PREFIX + task_id, "task")  # a finished job leaves its owner only
            found = pipe.execute()
        return {task_id for task_id, exists in zip(self.ids, found, strict=True) if not exists}

    def _received(self, ids: list[str]) -> list[bool]:
        with self._cache.pipeline(transaction=True) as pipe:
            for task_id in ids:
                pipe.hexists(ACCEPTED_PREFIX + task_id, "task")  # a finished job leaves its owner only
                pipe.hexists(ACCEPTED_PREFIX + task_id, "seen_at")
            found = pipe.execute()
        return [not found[at] or bool(found[at + 1]) for at in range(0, len(found), 2)]

    def _run(self) -> None:
        mine = set(self.ids)
        while not self._stop.is_set():
            self.most_in_flight = max(self.most_in_flight, self.in_flight())
            listed = [json.loads(raw)["headers"]["id"] for raw in self._broker.lrange(self._queue, 0, -1)]
            self.most_listed = max(self.most_listed, sum(1 for task_id in listed if task_id in mine))
            first, later = self.first, list(self.later)
            if first is not None and later:
                seen = self._received([first, *later])
                if not seen[0]:
                    self.overtaken += [task_id for task_id, got in zip(later, seen[1:], strict=True) if got]
            self.samples += 1
            self._stop.wait(self.every_s)


def done_at(client: Client, job: Job) -> datetime:
    return datetime.fromisoformat(client.app.backend.get_task_meta(job.id)["date_done"])


@pytest.mark.slow  # 200 jobs through a worker: about 30 s on 2 shared cores
def test_a_capped_tenant_never_has_more_in_flight_and_another_tenant_goes_straight_in(
    settings: Settings, start_worker: StartWorker
) -> None:
    cap = 8
    port = free_port()
    settings = settings.replace(tenant_max_in_flight=cap, metrics_port=port)
    client = Client(settings)
    big = [client.submit(f"Tenant A sentence {i}.", tenant="tenant-a") for i in range(200)]
    owner = RedisOwner(settings, role="test")
    # No worker yet: the cap lets 8 of A's jobs into the list (the window would let 64), the rest wait.
    assert owner.accepted.in_flight(settings.queue) == {"tenant-a": cap}
    assert owner.accepted.deferred(settings.queue) == {"tenant-a": 200 - cap}
    with Sampler(settings, [job.id for job in big]) as sampler:
        assert sampler.in_flight() == cap
        start_worker(settings)
        wait_until(lambda: len(sampler.finished()) >= 2 * cap, 120, "a few of tenant A's jobs to finish")
        finished_before = sampler.finished()
        small = client.submit("Tenant B has one sentence.", tenant="tenant-b")
        cache = owner.cache
        waiting = [str(task_id) for task_id in cache.lrange(f"{DEFERRED_PREFIX}{settings.queue}:tenant-a", 0, -1)]
        assert len(waiting) >= 100, "tenant A should still have most of its jobs waiting"
        sampler.first, sampler.later = small.id, waiting
        small.wait(timeout=120)
        for job in big:
            job.wait(timeout=180)
    # Sampled all along: A never had more than its cap in flight, and the list never held more of it.
    assert sampler.samples > 10
    assert sampler.most_in_flight == cap and sampler.most_listed <= cap, (sampler.most_in_flight, sampler.most_listed)
    # B went into the list ahead of every job A still had waiting: none was received before it.
    assert not sampler.overtaken, sampler.overtaken[:5]
    # B waited for A's jobs in flight and a batch or two, not for A's backlog (the window alone: ~64 of them).
    b_done = done_at(client, small)
    ahead = [job for job in big if job.id not in finished_before and done_at(client, job) < b_done]
    assert len(ahead) <= cap + 2 * settings.max_batch, len(ahead)
    # Nothing stays counted once it has finished.
    wait_until(lambda: not owner.accepted.in_flight(settings.queue), 30, "the tenants' counts to empty")
    assert not list(cache.scan_iter(f"{TENANT_IN_FLIGHT_PREFIX}*"))
    assert len(s3_keys(settings)) == len(big) + 1

    # Per-tenant waits, fleet-wide: `ttsq stats --json` and every worker's metrics.
    def tenants() -> dict[str, dict[str, Any]]:
        snap = json.loads(run_cli("stats", "--json", "--ping-timeout", "0", settings=settings).stdout)
        return {row["tenant"]: row for row in snap["tenants"]}

    wait_until(lambda: tenants().get("tenant-a", {}).get("jobs") == 200, 30, "the workers' waits to be written")
    rows = tenants()
    assert rows["tenant-b"]["jobs"] == 1
    a, b = rows["tenant-a"], rows["tenant-b"]
    assert 0 < a["wait_p50_s"] <= a["wait_p95_s"] and b["wait_p50_s"] > 0
    # A's backlog waited its turns; B's one job went straight in.
    assert a["wait_p95_s"] > b["wait_p95_s"], rows
    table = run_cli("stats", "--ping-timeout", "0", settings=settings).stdout.decode()
    assert "capped at 8" in table and "tenant-a" in table and "tenant-b" in table
    samples = scrape(port)
    assert value(samples, "ttsq_tenant_jobs", tenant="tenant-a") == 200
    p50 = value(samples, "ttsq_tenant_wait_seconds", tenant="tenant-a", quantile="0.5")
    assert p50 <= value(samples, "ttsq_tenant_wait_seconds", tenant="tenant-a", quantile="0.95")
    owner.close()
    client.close()


def test_a_cancel_gives_its_place_back_and_a_cap_works_without_a_window(settings: Settings) -> None:
    # No window: only the cap makes jobs wait. No worker: the release is the one a worker runs.
    settings = settings.replace(release_window=0, tenant_max_in_flight=2)
    client = Client(settings)
    owner = RedisOwner(settings, role="test")
    accepted, queue = owner.accepted, settings.queue
    jobs = [client.submit(f"Sentence {i}.", tenant="t1") for i in range(4)]
    other = client.submit("Another tenant's sentence.", tenant="t2")
    assert accepted.in_flight(queue) == {"t1": 2, "t2": 1}
    assert accepted.deferred(queue) == {"t1": 2}
    assert accepted.release([queue], window=0, most=64, cap=2, scope=queue) == []  # t1 is at its cap
    # A cancelled job leaves the count (its record is finished), and the next of t1's goes out.
    client.cancel(jobs[0].id)
    assert accepted.in_flight(queue) == {"t1": 1, "t2": 1}
    released = accepted.release([queue], window=0, most=64, cap=2, scope=queue)
    assert [job.task_id for job in released] == [jobs[2].id]
    assert accepted.in_flight_ids(queue, "t1") == [jobs[1].id, jobs[2].id]
    # A finished job leaves it, however many times it was sent meanwhile (a set, not a counter).
    accepted.finish(jobs[1].id)
    accepted.finish(jobs[1].id)
    assert accepted.in_flight(queue) == {"t1": 1, "t2": 1}
    # A job whose record went without a finish (it expired) stops counting when the counts are aged;
    # one still in flight never does.
    owner.cache.delete(ACCEPTED_PREFIX + other.id)
    assert accepted.age_in_flight(queue, every_s=60) == 1
    assert accepted.in_flight(queue) == {"t1": 1}
    assert accepted.age_in_flight(queue) == 0
    # Workers age once a period between them: within it, another worker's aging is skipped.
    owner.cache.delete(ACCEPTED_PREFIX + jobs[2].id)
    assert accepted.age_in_flight(queue, every_s=60) == 0
    assert accepted.in_flight(queue) == {"t1": 1}
    assert accepted.age_in_flight(queue) == 1
    assert accepted.in_flight(queue) == {}
    owner.close()
    client.close()


def test_a_count_left_by_a_job_that_ended_elsewhere_is_aged_out(settings: Settings, start_worker: StartWorker) -> None:
    # Two jobs fill t1's cap, and their records go without a finish (as if they had expired): they
    # still run, but nothing finishes their count. The releaser's aging gives their places back
    # within a lost-job grace, and t1's other jobs all run.
    settings = settings.replace(tenant_max_in_flight=2, lost_job_grace_s=1)
    owner = RedisOwner(settings, role="test")
    client = Client(settings)
    first = [client.submit(f"Tenant one opens with sentence {i}.", tenant="t1") for i in range(2)]
    owner.cache.delete(*(ACCEPTED_PREFIX + job.id for job in first))
    jobs = [client.submit(f"Tenant one sentence {i}.", tenant="t1") for i in range(6)]
    assert owner.accepted.deferred(settings.queue) == {"t1": 6}
    start_worker(settings)
    for job in first + jobs:
        assert job.wait(timeout=120)["duration_s"] > 0
    wait_until(lambda: not owner.accepted.in_flight(settings.queue), 30, "t1's count to empty")
    owner.close()
    client.close()


def test_a_tenant_at_its_cap_gives_its_bulk_work_its_share(settings: Settings, start_worker: StartWorker) -> None:
    # One place in flight, interactive jobs waiting ahead of bulk ones: with bulk's share at 100% every
    # freed place goes to bulk first, so the bulk jobs run before the interactive backlog (interactive
    # strictly first would run them last).
    settings = settings.replace(max_batch=1, tenant_max_in_flight=1, bulk_share_percent=100)
    client = Client(settings)
    interactive = [client.submit(f"Interactive sentence {i}.", tenant="t1") for i in range(4)]
    bulk = [client.submit(f"Bulk sentence {i}.", tenant="t1", lane="bulk") for i in range(2)]
    start_worker(settings)
    for job in interactive + bulk:
        job.wait(timeout=120)
    order = sorted(interactive + bulk, key=lambda job: done_at(client, job))
    lanes = ["B" if job in bulk else "I" for job in order]
    assert [job.id for job in order[:3]] == [interactive[0].id, bulk[0].id, bulk[1].id], lanes
    client.close()


@pytest.mark.slow
def test_a_worker_killed_under_the_cap_loses_nothing_and_leaves_nothing_counted(
    settings: Settings, start_worker: StartWorker
) -> None:
    # Jobs held and running when their worker dies stay counted (once) until they run on the next one:
    # no tenant goes over its cap meanwhile, every job runs once, and every count ends at zero.
    cap = 3
    settings = settings.replace(max_batch=2, release_window=4, tenant_max_in_flight=cap, lost_job_grace_s=2)
    client = Client(settings)
    jobs = [client.submit(f"Tenant {i % 3} says sentence {i}.", tenant=f"t{i % 3}") for i in range(60)]
    with contextlib.ExitStack() as stack:
        samplers = [
            stack.enter_context(Sampler(settings, [job.id for job in jobs[tenant::3]], every_s=0.02))
            for tenant in range(3)
        ]
        first = start_worker(settings, "w1")
        wait_until(lambda: len(s3_keys(settings)) >= 10, 60, "the first worker to make some clips")
        first.stop(signal.SIGKILL)
        start_worker(settings, "w2")
        for job in jobs:
            assert job.wait(timeout=120)["duration_s"] > 0
    most = [sampler.most_in_flight for sampler in samplers]
    assert max(most) == cap and all(m <= cap for m in most), most
    keys = s3_keys(settings)
    assert len(keys) == len(set(keys)) == len(jobs)
    owner = RedisOwner(settings, role="test")
    wait_until(lambda: not owner.accepted.in_flight(settings.queue), 30, "the tenants' counts to empty")
    assert not list(owner.cache.scan_iter(f"{TENANT_IN_FLIGHT_PREFIX}*"))
    assert not list(owner.cache.scan_iter(f"{DEFERRED_PREFIX}*")), "jobs left waiting"
    owner.close()
    client.close()


def test_tenant_waits_stay_a_bounded_set_and_their_percentiles_within_a_fifth(settings: Settings) -> None:
    # 1,200 tenants' jobs through one worker's fleet observer into Redis: a minute keeps at most
    # WAIT_TENANTS_PER_MINUTE names, and what stats and the metrics show is the busiest ten and `other`.
    owner = RedisOwner(settings, role="test")
    observer = FleetObserver(owner.stats)
    waits = [0.01 * (1 + i) for i in range(200)]  # the busiest tenant: 10 ms to 2 s, evenly
    for wait in waits:
        observer.job_finished(JobReport(task_id="x", outcome="synthesized", queue_wait_s=wait, tenant="busy"))
    for i in range(1200):
        observer.job_finished(JobReport(task_id="x", outcome="failed", queue_wait_s=0.5, tenant=f"t{i:04d}"))
    observer.close()
    # What is read back is untrusted: a field ttsq would not write is not shown.
    owner.cache.hset(f"{WAITS_PREFIX}{int(time.time() // 60)}", "3|evil\x1b[31m\nCRITICAL forged", 7)
    forged = f"{TENANT_IN_FLIGHT_PREFIX}{settings.queue}:bad\nname"
    owner.cache.sadd(f"{TENANTS_IN_FLIGHT_PREFIX}{settings.queue}", "bad\nname")
    owner.cache.zadd(forged, {"x": 1.0})
    assert owner.accepted.in_flight(settings.queue) == {}
    stored = owner.stats.waits(2)
    assert not [tenant for tenant in stored if "\n" in tenant or "\x1b" in tenant]
    assert len(stored) <= WAIT_TENANTS_PER_MINUTE + 1 and OTHER_TENANT in stored
    rows = tenant_waits(stored)
    assert len(rows) == 11 and rows[0]["tenant"] == "busy" and rows[-1]["tenant"] == OTHER_TENANT
    assert sum(row["jobs"] for row in rows) == 1400
    busy = rows[0]
    for quantile, got in ((0.5, busy["wait_p50_s"]), (0.95, busy["wait_p95_s"])):
        truth = waits[int(quantile * len(waits)) - 1]
        assert abs(got - truth) <= truth / 5, (quantile, got, truth)
    # The worker's series carry the same bounded set of tenant labels.
    metrics = Metrics(node="n", stats=owner.stats)
    tenants = {
        sample.labels["tenant"]
        for family in metrics.registry.collect()
        if family.name == "ttsq_tenant_jobs"
        for sample in family.samples
    }
    assert len(tenants) == 11 and {"busy", OTHER_TENANT} <= tenants
    owner.close()
