"""The lost-job rules (``ttsq.delivery.lost``) driven through a simulated broker, many thousands of steps
with a fresh seed each run (printed on failure: ``TTSQ_SIM_SEED=<seed>`` replays it).

The world is what the sweeper cannot see directly: producers accept jobs and push their messages; a
worker pops them (kombu's BRPOP), records each in the unacked hash an instant later (up to
``RECORD_DELAY_S``) and its gate marks it received later still (up to ``GATE_DELAY_S``, a loaded
machine's worst); workers die, and their messages are lost (popped, not yet recorded) or given back
by recovery ``RECOVERY_S`` later (held in the unacked hash meanwhile); Redis loses a queued message
(a restart that lost a write); Redis's clock jumps forward. Every second the sweeper does what
``ttsq.worker.sweeper`` does: reads the unseen jobs, asks the rules whom to look for, looks in the
queue's lists and the unacked hash, sends again whom the rules say. After every step:

- a job sent again had no copy anywhere (not queued, not popped, not on its way back): no second copy
  of a job being delivered;
- a lost job (no copy anywhere, not received) is sent again within its bound: the grace, two
  confirmations and a few sweeps after it was lost;
- and at the end, with faults stopped, every accepted job was received.

Every job also moves through the lifecycle table (``ttsq.delivery.lifecycle.step``): sent, popped, its
message lost, given back by recovery, sent again, received. A move the table lacks fails the run, and at
every sweep a job is ``lost`` in the table exactly when no copy of it is anywhere in the world.
"""

from __future__ import annotations

import collections
import os
import random
import time
from collections.abc import Collection
from dataclasses import dataclass

import pytest

from ttsq.delivery.lifecycle import INITIAL, Event, State, step
from ttsq.delivery.lost import Unseen, UnseenJobs

GRACE_S = 10.0
CONFIRM_S = 2.0
SWEEP_S = 1.0
RECORD_DELAY_S = 0.05  # kombu records a popped message in the unacked hash within this (real seconds)
GATE_DELAY_S = 3.0  # and the worker's gate marks it received within this after that
RECOVERY_S = 20.0  # a dead worker's recorded messages go back to the queue after this
STEPS = 200_000
#: A lost job (overdue and behind) is sent again within this: two confirmations, and the sweeps' spacing.
BOUND_S = 2 * CONFIRM_S + 4 * SWEEP_S


@dataclass
class Job:
    task_id: str
    seq: int
    accepted_at: float  # Redis's clock
    #: Real time since when it has been lost (no copy anywhere, not received), overdue and behind all
    #: at once: the rules must send it again within BOUND_S of that.
    exposed_at: float | None = None
    sent_again: int = 0


class World:
    def __init__(self, rng: random.Random, rules: UnseenJobs) -> None:
        self.rng = rng
        self.rules = rules
        self.now = 0.0  # real time
        self.skew = 0.0  # Redis's clock minus real time (jumps forward)
        self.jobs: dict[str, Job] = {}  # accepted and not received yet
        self.received = 0
        self.queue: collections.deque[str] = collections.deque()  # the messages queued, oldest first
        self.popped: list[tuple[float, float, str]] = []  # (recorded at, marked at, task id): with a worker
        self.returning: list[tuple[float, str]] = []  # (back at, task id): a dead worker's, given back
        self.copies: collections.Counter[str] = collections.Counter()  # messages of each job anywhere
        #: Each job's state in the lifecycle table. A popped message counts as queued until something
        #: shows whether kombu recorded it (a worker's death, or the gate's mark).
        self.states: dict[str, State] = {}
        self.seq = 0
        self.watermark = 0
        self.next_sweep = SWEEP_S
        self.sent_again = 0

    @property
    def redis_now(self) -> float:
        return self.now + self.skew

    def move(self, task_id: str, *events: Event) -> None:
        """``task_id`` makes these moves, each one the lifecycle table must have."""
        for event in events:
            try:
                self.states[task_id] = step(self.states[task_id], event)
            except ValueError as exc:
                raise AssertionError(f"{task_id}: {exc}") from None

    def accept(self, task_id: str) -> None:
        self.seq += 1
        job = self.jobs.get(task_id)
        if job is None:
            self.jobs[task_id] = Job(task_id, self.seq, self.redis_now)
            self.states[task_id] = INITIAL
            self.move(task_id, Event.SENT)
        else:  # sent again: accepted anew with a new place in the queue, as AcceptedJobs.accept does
            job.seq, job.accepted_at, job.exposed_at = self.seq, self.redis_now, None
        self.queue.append(task_id)
        self.copies[task_id] += 1

    def pop(self) -> None:
        recorded_at = self.now + self.rng.uniform(0, RECORD_DELAY_S)
        self.popped.append((recorded_at, recorded_at + self.rng.uniform(0, GATE_DELAY_S), self.queue.popleft()))

    def step(self) -> None:
        self.now += self.rng.uniform(0.005, 0.1)
        roll = self.rng.random()
        if roll < 0.12:
            self.accept(f"job-{self.seq}")
        elif roll < 0.40 and self.queue:  # a worker pops the oldest message
            self.pop()
        elif roll < 0.402 and self.popped:  # a worker dies: what it recorded is given back later
            for recorded_at, _, task_id in self.popped:
                if recorded_at <= self.now:
                    self.returning.append((self.now + RECOVERY_S, task_id))
                    self.move(task_id, Event.POPPED)  # held by a dead worker until recovery looks
                else:  # popped and not recorded yet: gone (kombu's fetch window)
                    self.copies[task_id] -= 1
                    self.move(task_id, Event.MESSAGE_LOST)
            self.popped = []
        elif roll < 0.404 and self.queue:  # Redis loses a queued message
            position = self.rng.randrange(len(self.queue))
            self.copies[self.queue[position]] -= 1
            self.move(self.queue[position], Event.MESSAGE_LOST)
            del self.queue[position]
        elif roll < 0.405:  # Redis's clock jumps forward
            self.skew += self.rng.uniform(0.5, 30)
        self.settle()

    def settle(self) -> None:
        """Gates that mark, recoveries that give back, the sweeps that are due, and the checks."""
        marking = [t for _, at, t in self.popped if at <= self.now]
        self.popped = [(recorded, at, t) for recorded, at, t in self.popped if at > self.now]
        for task_id in marking:
            self.copies[task_id] -= 1
            job = self.jobs.pop(task_id, None)
            if job is not None:  # a second copy is dropped by the gate (Receipt.DUPLICATE)
                self.received += 1
                self.watermark = max(self.watermark, job.seq)
                self.move(task_id, Event.POPPED, Event.RECEIVED)
        for at, task_id in self.returning:
            if at <= self.now:
                self.queue.append(task_id)
                self.move(task_id, Event.HOLDER_DIED)
        self.returning = [(at, t) for at, t in self.returning if at > self.now]
        while self.now >= self.next_sweep:
            self.sweep()
            self.next_sweep += SWEEP_S
        for job in self.jobs.values():
            exposed = (
                self.copies[job.task_id] == 0
                and self.redis_now - job.accepted_at > GRACE_S
                and (job.seq < self.watermark or not self.queue)
            )
            if not exposed:
                job.exposed_at = None
            elif job.exposed_at is None:
                job.exposed_at = self.now
            else:
                late = self.now - job.exposed_at
                assert late <= BOUND_S, f"{job.task_id}: lost, and not sent again {late:.1f} s later"

    def held(self, task_ids: list[str]) -> set[str]:
        """What the sweeper's look finds: queued, or in the unacked hash (recorded by a live worker, or a
        dead worker's not given back yet)."""
        recorded = {t for at, _, t in self.popped if at <= self.now} | {t for _, t in self.returning}
        return {t for t in task_ids if t in recorded or t in self.queue}

    def sweep(self) -> None:
        for task_id in self.jobs:  # each sweep, not each step: a check on every job every step costs 60%
            copies = self.copies[task_id]
            assert (copies == 0) == (self.states[task_id] is State.LOST), (
                f"{task_id}: {self.states[task_id].value} in the table with {copies} copies in the world"
            )
        depth = len(self.queue)
        looking = self.rules.sweep(
            self.now,
            [
                Unseen(
                    job.task_id,
                    overdue=self.redis_now - job.accepted_at > GRACE_S,
                    behind=job.seq < self.watermark or depth == 0,
                )
                for job in self.jobs.values()
            ],
        )
        for task_id in self.rules.looked(self.now, self.held(looking)):
            assert task_id in self.jobs, f"{task_id} sent again after a worker received it"
            copies = self.copies[task_id]
            assert copies == 0, f"{task_id} sent again at {self.now:.2f} s with {copies} copy(ies) on their way"
            self.jobs[task_id].sent_again += 1
            self.sent_again += 1
            self.move(task_id, Event.SENT_AGAIN)
            self.accept(task_id)
            self.rules.sent(task_id)

    def drain(self) -> None:
        """No more faults or jobs: everything accepted is received in the end, and the rules forget."""
        give_up = self.now + 300
        while self.jobs:
            assert self.now < give_up, f"never received: {list(self.jobs)[:3]}"
            self.now += 0.05
            if self.queue:
                self.pop()
            self.settle()
        self.rules.sweep(self.now, [])
        assert self.rules.tracked == 0
        assert set(self.states.values()) == {State.RUNNING}, collections.Counter(self.states.values())


def run(seed: int, steps: int) -> World:
    world = World(random.Random(seed), UnseenJobs(confirm_s=CONFIRM_S))
    for _ in range(steps):
        world.step()
    world.drain()
    return world


def test_lost_jobs_are_sent_again_and_delivered_ones_never() -> None:
    seed = int(os.environ.get("TTSQ_SIM_SEED") or time.time_ns() % 2**32)
    started = time.monotonic()
    try:
        world = run(seed, STEPS)
    except AssertionError as exc:
        pytest.fail(f"simulation failed with TTSQ_SIM_SEED={seed}: {exc}")
    print(f"seed {seed}: {STEPS} steps, {world.seq} accepts, {world.sent_again} sent again", end=" ")
    print(f"in {time.monotonic() - started:.1f}s")
    assert world.sent_again > 0  # the faults did lose jobs, and the rules found them


def test_one_look_is_not_enough() -> None:
    """The rule that a missing job waits for a second look, a confirmation later: sending on the first
    look sends a second copy of a job a worker is just taking in (what a test once found)."""

    class OneLook(UnseenJobs):
        def looked(self, now: float, held: Collection[str]) -> list[str]:
            lost = [task_id for task_id in self._looking if task_id not in held]
            self._looking = []
            return lost

    failures = 0
    for seed in range(5):
        world = World(random.Random(seed), OneLook(confirm_s=CONFIRM_S))
        try:
            for _ in range(20_000):
                world.step()
        except AssertionError:
            failures += 1
    assert failures == 5


def test_a_look_in_the_lists_alone_is_not_enough() -> None:
    """The look covers kombu's unacked hash too: a dead worker's messages wait there for recovery, and a
    sweeper that looked in the queue's lists alone sent a second copy of each of them."""

    class ListsAlone(World):
        def held(self, task_ids: list[str]) -> set[str]:
            return {t for t in task_ids if t in self.queue}

    failures = 0
    for seed in range(5):
        world = ListsAlone(random.Random(seed), UnseenJobs(confirm_s=CONFIRM_S))
        try:
            for _ in range(50_000):
                world.step()
        except AssertionError:
            failures += 1
    assert failures == 5


def test_rules_that_never_send_break_the_bound() -> None:
    """The bound is checked: rules that never send a lost job again fail the simulation."""

    class Never(UnseenJobs):
        def looked(self, now: float, held: Collection[str]) -> list[str]:
            self._looking = []
            return []

    with pytest.raises(AssertionError, match="not sent again"):
        world = World(random.Random(1), Never(confirm_s=CONFIRM_S))
        for _ in range(50_000):
            world.step()
