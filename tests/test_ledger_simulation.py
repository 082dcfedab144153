"""The accepted-job ledger's real Lua scripts (``ttsq.records.accepted.AcceptedJobs`` on the session's
redis-server) driven by a simulated fleet, many thousands of steps with a fresh seed each run (printed on
failure: ``TTSQ_SIM_SEED=<seed>`` replays it).

The world is Python; the only I/O is the ledger. Producers accept jobs and send them, through the
release window (``defer``) when the job has a tenant, as ``ttsq.sending`` does: two deployments, one with
a window alone, one with a window and a per-tenant cap. Workers fan documents out: a fan-out sends 2 to 8
chunks one after another, each a job of its own, under the window and no cap. Whose turn a job or a chunk
waits for is the product's one rule (``ttsq.job.turn_of``, the world's ``turn``): a chunk waits in its
tenant's chunk place, which release.lua holds to no cap. A releaser releases what the room allows and
sends it. Workers pop messages (up to ``PREFETCH`` each), mark each received and act on the receipt
(RUN: run it; DUPLICATE, CANCELLED: drop it), look whether a running job was cancelled, settle its
outcome, store the result in a dict that stands for Celery's result backend and finish its record. A
worker dies (after a settle and before its store, too): what it held comes back as a redelivery
(``plain=False``) ``RECOVERY_STEPS`` later. The sweeper now and then sends again a job the ledger holds
unseen: ``accept`` again and a second plain copy, as when its look missed the first copy (its look is
``tests/test_delivery_simulation.py``'s; here it and the send are one step, so it never sends a job a
worker received). Clients cancel as ``Client.cancel`` does, each of its steps a step of its own with the
workers' steps in between: read the stored state (a final one is the answer), ``cancel`` (a settled state
is the answer), else ``finish`` and store REVOKED (the answer). After every step:

- the answer to every cancel is the job's stored final state, and a stored final state is never replaced
  by another; a job whose cancel won is never stored SUCCESS or FAILURE, and no copy of it runs;
- a plain copy of a job that ran never runs (DUPLICATE, before and after the job finished), no two live
  workers run a job at once unless one of the copies is a redelivery, and DUPLICATE and CANCELLED answer
  only a job that was received, or whose cancel won;
- a released job is sent with the headers it was deferred with (its sender's trace), not the recorded ones;
- the jobs of a tenant that no worker has received yet (each counted once, however many copies), a
  document's chunks among them whatever place they wait in, never exceed the window on their queue;
  every ``UNSEEN_CHECK_EVERY`` steps the ledger's unseen set is exactly the jobs the world has sent and
  no worker has received;
- and at the end, with faults, sends and new cancels stopped and everything driven to completion, every
  job has one final state and no record, and no deferred job or in-flight count is left.

A plain copy that arrives after its job finished is a second copy too: the record keeps the settled
outcome (``finish``), so the receipt answers DUPLICATE (before, ``finish`` dropped the whole record and such
copies ran again, two of them at once at times). Cancellers die after their cancel won, before they store
REVOKED or before they finish the record: the job still ends REVOKED, stored by the worker whose copy the
receipt answers CANCELLED (``ttsq.worker.gate``), and ``Client.cancel`` stores REVOKED before it finishes the
record, so a deferred job still has a copy to be released and dropped (finished first, a job cancelled while
it waited had none, and stayed PENDING). A run's outcome is always the job's own (``Job.outcome``: a rerun
settles what the first run settled, as a cache hit does): where a rerun can end otherwise (a transient
failure), ``settle`` sets its state over one settled before, so a cancel that answered the first run's
outcome would see the job end with the second's; that gap is open (docs/guarantees.md, "Cancel"). Not
modelled: the document job itself (its fan-out is one step, its stitch none), a document's cancel reaching
its chunks, ``touch``, retries (``unsettle``), outcomes that expire, Redis restarts.

Mutation tests at the end: each breaks one rule of one script (in ``MUTATIONS``, the one place that
knows the scripts' text) and the simulation must fail; and the senders' rule as it was before chunks
waited their turn (sent with no tenant, so at once, past the window) must fail the window check.
"""

from __future__ import annotations

import collections
import os
import random
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import pytest
import redis

from ttsq.job import turn_of
from ttsq.records.accepted import AcceptedJobs, Receipt
from ttsq.records.scripts import source

if TYPE_CHECKING:
    from collections.abc import Iterator

SUCCESS, FAILURE, REVOKED = "SUCCESS", "FAILURE", "REVOKED"
FINAL = frozenset({SUCCESS, FAILURE, REVOKED})
TASK = "ttsq.synthesize"
TRACE = "traceparent"  # a header a release must send the job with: its sender's trace
#: None: a job sent with no tenant (as ``ttsq retry`` sends one: it waited its turn once) goes to its queue at
#: once, outside the window; a document that names none is the default tenant's, its chunks wait all the same.
TENANTS = (None, "t0", "t1", "t2")
WINDOW = 3
CAP = 2
WORKERS = 4
PREFETCH = 2
RECOVERY_STEPS = (5, 200)  # a dead worker's messages come back this many steps later
TTL_S = 3600  # what outlives a finished record (its cancel, its settled outcome) outlives the run
CHUNKS = (2, 8)  # a fan-out sends this many chunks at once
STEPS = 100_000
UNSEEN_CHECK_EVERY = 97
CANCELLER_DIES = 0.1  # of a canceller's steps after its cancel won
#: What each step does, by weight (steps whose action cannot happen fall through to a pop).
WEIGHTS = {
    "produce": 7,
    "fan_out": 0.3,
    "release": 4,
    "pop": 15,
    "receive": 15,
    "progress": 30,
    "cancel": 3,
    "client": 12,
    "sweep": 1.5,
    "die": 0.4,
}


class Turn(Protocol):
    """Whose turn a job waits for under the window (``ttsq.job.turn_of``); None: it is sent at once."""

    def __call__(self, tenant: str | None, *, chunk: bool = False) -> str | None: ...


@dataclass
class Deployment:
    scope: str  # its base queue: the cap counts per tenant across its queues
    queues: list[str]
    cap: int


@dataclass
class Job:
    task_id: str
    queue: str
    tenant: str | None
    deployment: Deployment
    outcome: str  # what its runs settle (SUCCESS or FAILURE)
    document: str | None = None  # the document a chunk belongs to
    deferred: bool = False
    received: bool = False  # a copy was answered RUN or CANCELLED: out of the ledger's unseen set
    ran: bool = False  # a copy was answered RUN
    cancel_won: bool = False
    finished: bool = False  # its record was finished (by a worker or a cancelling client)
    stored: str | None = None
    answers: list[str] = field(default_factory=list)
    runs: int = 0
    history: list[str] = field(default_factory=list)

    @property
    def windowed(self) -> bool:
        """The window counts it: a job of a tenant, or a document's chunk, whatever place it waits in."""
        return self.tenant is not None or self.document is not None


@dataclass
class Message:
    task_id: str
    seq: int
    plain: bool  # neither a redelivery nor a retry


@dataclass
class Held:
    message: Message
    phase: str = "popped"  # popped -> running -> checked -> settled -> stored, then gone


@dataclass
class Worker:
    name: int
    held: list[Held] = field(default_factory=list)


@dataclass
class Cancel:
    job: Job
    phase: str = "read"  # read -> cancel -> (store -> finish)


class World:
    def __init__(self, rng: random.Random, ledger: AcceptedJobs, run: str, *, turn: Turn = turn_of) -> None:
        self.rng = rng
        self.ledger = ledger
        self.run = run
        self.turn = turn  # the senders' rule: the product's, or a test's with a defect
        self.deployments = [
            Deployment(f"sim-{run}-a", [f"sim-{run}-a", f"sim-{run}-a-bulk"], 0),
            Deployment(f"sim-{run}-b", [f"sim-{run}-b"], CAP),
        ]
        self.queues: dict[str, collections.deque[Message]] = {
            q: collections.deque() for d in self.deployments for q in d.queues
        }
        #: Per queue, the jobs sent (or released) that no worker received and that did not finish: the
        #: ledger's unseen set, as the world knows it.
        self.unseen: dict[str, set[str]] = {q: set() for q in self.queues}
        self.jobs: dict[str, Job] = {}
        self.order: list[str] = []
        self.workers = [Worker(n) for n in range(WORKERS)]
        self.next_worker = WORKERS
        self.returning: list[tuple[int, str, Message]] = []  # (due step, queue, redelivered message)
        self.cancels: list[Cancel] = []
        self.cancelling: set[str] = set()
        self.steps = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.actions = list(WEIGHTS)
        self.weights = list(WEIGHTS.values())
        self.faults = True

    # --- the checks -------------------------------------------------------------------------------

    def store(self, job: Job, state: str) -> None:
        """The result backend stores ``state`` for ``job``."""
        self.note(job, f"stored {state}")
        if job.stored is not None and job.stored != state:
            raise AssertionError(f"{job.task_id}: stored {job.stored}, then replaced by {state}: {job.history}")
        if job.cancel_won and state != REVOKED:
            raise AssertionError(f"{job.task_id}: its cancel won, yet it was stored {state}: {job.history}")
        for answer in job.answers:
            if answer != state:
                raise AssertionError(f"{job.task_id}: a cancel answered {answer}, then stored {state}: {job.history}")
        if job.stored is not None:
            self.stats["stored again"] += 1
        job.stored = state

    def answer(self, job: Job, state: str) -> None:
        """A cancel of ``job`` answers ``state``."""
        self.note(job, f"a cancel answered {state}")
        if job.stored is not None and job.stored != state:
            raise AssertionError(f"{job.task_id}: stored {job.stored}, and a cancel answered {state}: {job.history}")
        job.answers.append(state)
        self.stats[f"cancel answered {state}"] += 1

    def check_window(self, queue: str) -> None:
        waiting = [task_id for task_id in self.unseen[queue] if self.jobs[task_id].windowed]
        if len(waiting) > WINDOW:
            chunks = sum(1 for task_id in waiting if self.jobs[task_id].document is not None)
            raise AssertionError(
                f"{queue}: {len(waiting)} jobs of tenants unreceived ({chunks} of them document chunks), over the "
                f"window of {WINDOW}"
            )

    def check_unseen(self) -> None:
        for queue, expected in self.unseen.items():
            found = {task_id for task_id, _ in self.ledger.unseen(queue, limit=100_000)}
            if found != expected:
                raise AssertionError(
                    f"{queue}: the ledger holds unseen {sorted(found - expected)[:3]} the world does not, "
                    f"and misses {sorted(expected - found)[:3]}"
                )

    # --- the world's moves -------------------------------------------------------------------------

    def note(self, job: Job, what: str) -> None:
        """``job``'s story, for the message of a check that fails."""
        job.history.append(f"{self.steps} {what}")

    def push(self, queue: str, message: Message) -> None:
        self.queues[queue].append(message)
        self.unseen[queue].add(message.task_id)

    def finished(self, job: Job) -> None:
        """``job``'s record was finished: out of the unseen set, and no longer waiting for a release."""
        self.note(job, "finished")
        self.ledger.finish(job.task_id)
        job.finished = True
        job.deferred = False
        self.unseen[job.queue].discard(job.task_id)

    def new_job(self, queue: str, tenant: str | None, deployment: Deployment, document: str | None = None) -> Job:
        task_id = f"sim-{self.run}-{len(self.order)}"
        outcome = SUCCESS if self.rng.random() < 0.8 else FAILURE
        job = Job(task_id, queue, tenant, deployment, outcome, document=document)
        self.jobs[task_id] = job
        self.order.append(task_id)
        return job

    def send(self, job: Job, turn: str | None, *, cap: int) -> None:
        """Accept ``job`` and send it as ``ttsq.sending`` does: with a ``turn`` (its ``Outgoing``'s tenant),
        deferred in that place if the window (or ``cap``) says so; with none, to its queue at once."""
        seq = self.ledger.accept(job.task_id, task=TASK, queue=job.queue, kwargs={}, headers={}, owner=job.tenant or "")
        kind = "chunk" if job.document is not None else "job"
        # ``ttsq.sending`` records the job, then defers it with the headers of its send: its trace.
        if turn is not None and self.ledger.defer(
            job.task_id,
            queue=job.queue,
            tenant=turn,
            window=WINDOW,
            cap=cap,
            scope=job.deployment.scope,
            headers={TRACE: job.task_id},
        ):
            job.deferred = True
            self.note(job, f"accepted, deferred in {turn}")
            self.stats[f"{kind} deferred"] += 1
        else:
            self.note(job, "accepted, sent")
            self.stats[f"{kind} sent at once"] += 1
            self.push(job.queue, Message(job.task_id, seq, plain=True))

    def produce(self) -> bool:
        deployment = self.rng.choice(self.deployments)
        tenant = self.rng.choice(TENANTS)
        job = self.new_job(self.rng.choice(deployment.queues), tenant, deployment)
        self.send(job, None if tenant is None else self.turn(tenant), cap=deployment.cap)
        self.check_window(job.queue)
        return True

    def fan_out(self) -> bool:
        """A worker fans a document out: it sends its chunks one after another, each in the turn the rule
        gives a chunk of the document's tenant, under the window and no cap (``ttsq.worker.documents``)."""
        deployment = self.rng.choice(self.deployments)
        queue = self.rng.choice(deployment.queues)
        tenant = self.rng.choice(TENANTS)
        document = f"sim-{self.run}-doc-{self.stats['documents']}"
        self.stats["documents"] += 1
        for _ in range(self.rng.randint(*CHUNKS)):
            chunk = self.new_job(queue, tenant, deployment, document)
            self.send(chunk, self.turn(tenant, chunk=True), cap=0)
        self.check_window(queue)
        return True

    def release(self) -> bool:
        deployment = self.rng.choice(self.deployments)
        released = self.ledger.release(
            deployment.queues, window=WINDOW, most=WINDOW, cap=deployment.cap, scope=deployment.scope
        )
        for record in released:
            job = self.jobs[record.task_id]
            assert job.deferred, f"{job.task_id}: released, and it was not waiting: {job.history}"
            assert record.headers == {TRACE: job.task_id}, (
                f"{job.task_id}: released with {record.headers}, not the headers it was deferred with (its "
                f"sender's trace): {job.history}"
            )
            job.deferred = False
            self.note(job, "released")
            self.push(record.queue, Message(record.task_id, record.seq, plain=True))
            self.stats["released"] += 1
        for queue in deployment.queues:
            self.check_window(queue)
        return bool(released)

    def pop(self) -> bool:
        workers = [w for w in self.workers if len(w.held) < PREFETCH]
        queues = [q for q in self.queues.values() if q]
        if not workers or not queues:
            return False
        self.rng.choice(workers).held.append(Held(self.rng.choice(queues).popleft()))
        return True

    def receive(self) -> bool:
        popped = [(w, h) for w in self.workers for h in w.held if h.phase == "popped"]
        if not popped:
            return False
        worker, held = self.rng.choice(popped)
        message = held.message
        job = self.jobs[message.task_id]
        receipt = self.ledger.received(job.task_id, task=TASK, queue=job.queue, seq=message.seq, plain=message.plain)
        self.stats[f"receipt {receipt.name}"] += 1
        self.note(job, f"w{worker.name} received a {'plain' if message.plain else 'redelivered'} copy: {receipt.name}")
        if receipt is Receipt.DUPLICATE:
            assert message.plain, f"{job.task_id}: a redelivered copy answered DUPLICATE: {job.history}"
            assert job.ran, f"{job.task_id}: a copy answered DUPLICATE, and no copy ran: {job.history}"
            worker.held.remove(held)
            return True
        if receipt is Receipt.CANCELLED:
            assert job.cancel_won, f"{job.task_id}: a copy answered CANCELLED, and no cancel won: {job.history}"
            job.received = True
            # The receipt dropped the record's fields (its own finish); the gate stores REVOKED, which a
            # canceller that died did not (ttsq.worker.gate).
            job.finished = True
            job.deferred = False
            self.unseen[job.queue].discard(job.task_id)
            self.store(job, REVOKED)
            worker.held.remove(held)
            return True
        if job.cancel_won:
            raise AssertionError(f"{job.task_id}: its cancel won, and a copy answered RUN: {job.history}")
        if message.plain and job.ran:
            when = "after its job finished" if job.finished else "while its record lives"
            raise AssertionError(f"{job.task_id}: a plain second copy answered RUN {when}: {job.history}")
        if message.plain:
            for other in self.workers:
                for h in other.held:
                    if h is not held and h.message.task_id == job.task_id and h.phase != "popped" and h.message.plain:
                        raise AssertionError(
                            f"{job.task_id}: two plain copies run at once, by workers {other.name} and "
                            f"{worker.name}: {job.history}"
                        )
        job.ran = True
        job.received = True
        job.runs += 1
        self.unseen[job.queue].discard(job.task_id)
        held.phase = "running"
        return True

    def progress(self) -> bool:
        running = [(w, h) for w in self.workers for h in w.held if h.phase != "popped"]
        if not running:
            return False
        worker, held = self.rng.choice(running)
        job = self.jobs[held.message.task_id]
        if held.phase == "running":
            # The pipeline looks before an engine call (a cache hit does not): a cancelled job skips it.
            if self.rng.random() < 0.5 and self.ledger.cancelled(job.task_id):
                self.revoked(worker, held, job)
            else:
                held.phase = "checked"
        elif held.phase == "checked":
            if self.ledger.settle(job.task_id, job.outcome, ttl_s=TTL_S):
                self.note(job, f"w{worker.name} settled {job.outcome}")
                held.phase = "settled"
            else:
                self.revoked(worker, held, job)
        elif held.phase == "settled":
            self.store(job, job.outcome)
            held.phase = "stored"
        else:  # stored: task_postrun finishes its record, and the message is acked
            self.finished(job)
            worker.held.remove(held)
        return True

    def revoked(self, worker: Worker, held: Held, job: Job) -> None:
        """The cancel came first: REVOKED stored (in case its canceller did not live to), record finished."""
        self.stats["revoked by its worker"] += 1
        self.note(job, f"w{worker.name} found it cancelled")
        self.store(job, REVOKED)
        self.finished(job)
        worker.held.remove(held)

    def die(self) -> bool:
        holding = [w for w in self.workers if w.held]
        if not holding:
            return False
        worker = self.rng.choice(holding)
        for held in worker.held:
            due = self.steps + self.rng.randint(*RECOVERY_STEPS)
            message = Message(held.message.task_id, held.message.seq, plain=False)
            self.returning.append((due, self.jobs[message.task_id].queue, message))
            self.stats[f"died holding a {held.phase} job"] += 1
            self.note(self.jobs[message.task_id], f"w{worker.name} died holding it {held.phase}")
        self.workers[self.workers.index(worker)] = Worker(self.next_worker)
        self.next_worker += 1
        return True

    def sweep(self) -> bool:
        queue = self.rng.choice(list(self.queues))
        unseen = self.ledger.unseen(queue, limit=50)
        if not unseen:
            return False
        task_id, _ = self.rng.choice(unseen)
        assert task_id in self.unseen[queue], f"{task_id}: unseen in the ledger, received or finished in the world"
        record = self.ledger.get(task_id)
        if record is None or record.seen_at is not None:
            return True
        job = self.jobs[task_id]
        if job.stored is not None:  # what the sweeper does with a job that has a final result
            self.finished(job)
            return True
        seq = self.ledger.accept(task_id, task=record.task, queue=record.queue, kwargs={}, headers={})
        self.push(queue, Message(task_id, seq, plain=True))
        self.note(job, "sent again")
        self.stats["sent again"] += 1
        return True

    def cancel(self) -> bool:
        recent = self.order[-self.rng.randint(1, min(len(self.order), 100)) :] if self.order else []
        choices = [t for t in recent if t not in self.cancelling and self.jobs[t].stored is None]
        if not choices:
            return False
        job = self.jobs[self.rng.choice(choices)]
        self.cancelling.add(job.task_id)
        self.cancels.append(Cancel(job))
        return True

    def client(self) -> bool:
        if not self.cancels:
            return False
        cancel = self.rng.choice(self.cancels)
        job = cancel.job
        if cancel.phase == "read":
            if job.stored in FINAL:
                self.answer(job, job.stored)
                self.ended(cancel)
            else:
                cancel.phase = "cancel"
        elif cancel.phase == "cancel":
            settled = self.ledger.cancel(job.task_id, ttl_s=TTL_S)
            if settled is not None:
                self.answer(job, settled)
                self.ended(cancel)
            else:
                self.note(job, "a cancel won")
                job.cancel_won = True
                cancel.phase = "store"
        elif self.faults and self.rng.random() < CANCELLER_DIES:
            # After its cancel won, before it stored REVOKED, or before it finished the record: nobody
            # hears an answer, and the job must still end REVOKED and its record finish.
            self.note(job, f"its canceller died before its {cancel.phase}")
            self.stats["canceller died"] += 1
            self.cancels.remove(cancel)  # still in ``cancelling``: no other cancel of it
        elif cancel.phase == "store":
            self.store(job, REVOKED)
            cancel.phase = "finish"
        else:
            self.finished(job)
            self.answer(job, REVOKED)
            self.ended(cancel)
        return True

    def ended(self, cancel: Cancel) -> None:
        self.cancels.remove(cancel)
        self.cancelling.discard(cancel.job.task_id)

    def recover(self) -> None:
        """Recovery gives back what dead workers held, once it is due."""
        if self.returning and min(due for due, _, _ in self.returning) <= self.steps:
            for due, queue, message in self.returning:
                if due <= self.steps:
                    self.queues[queue].append(message)
            self.returning = [r for r in self.returning if r[0] > self.steps]

    def step(self) -> None:
        self.steps += 1
        action = self.rng.choices(self.actions, self.weights)[0]
        if not self.faults and action in ("produce", "fan_out", "cancel", "sweep", "die"):
            action = "release" if self.rng.random() < 0.1 else "client"
        if not getattr(self, action)():
            self.pop()
        self.recover()
        if self.steps % UNSEEN_CHECK_EVERY == 0:
            self.check_unseen()

    def busy(self) -> bool:
        return bool(
            any(self.queues.values())
            or any(w.held for w in self.workers)
            or self.returning
            or self.cancels
            or any(job.deferred for job in self.jobs.values())
        )

    def drain(self) -> None:
        """No more faults, jobs, sweeps or cancels: everything under way ends, and the ledger is empty."""
        self.faults = False
        give_up = self.steps + 1_000_000
        while self.busy():
            assert self.steps < give_up, f"never ended: {[j.task_id for j in self.jobs.values() if j.deferred][:3]}"
            self.step()
        for deployment in self.deployments:  # the ids of jobs cancelled while they waited go at their turn
            for _ in range(100):
                if not any(self.ledger.deferred(q) for q in deployment.queues):
                    break
                assert not self.release(), "a job released after every job ended"
            for queue in deployment.queues:
                assert self.ledger.deferred(queue) == {}, f"{queue}: jobs left deferred {self.ledger.deferred(queue)}"
            in_flight = self.ledger.in_flight(deployment.scope)
            assert in_flight == {}, f"{deployment.scope}: jobs left counted in flight {in_flight}"
        self.check_unseen()
        for job in self.jobs.values():
            assert job.stored in FINAL, f"{job.task_id}: never ended: {job.history}"
            assert job.finished, f"{job.task_id}: its record never finished: {job.history}"
            assert not self.ledger.exists(job.task_id), f"{job.task_id}: ended, and its record is left: {job.history}"
            for answer in job.answers:
                assert answer == job.stored, f"{job.task_id}: a cancel answered {answer}, and it ended {job.stored}"


def run(
    seed: int, steps: int, client: redis.Redis, ledger: AcceptedJobs, *, drain: bool = True, turn: Turn = turn_of
) -> World:
    """``steps`` steps of a world seeded with ``seed`` on ``ledger`` (on ``client``) whose senders wait
    their ``turn``, then (``drain``) to its end; what it wrote is deleted either way. Its keys are named by
    a random run id, not the seed."""
    world = World(random.Random(seed), ledger, os.urandom(8).hex(), turn=turn)
    try:
        for _ in range(steps):
            world.step()
        if drain:
            world.drain()
    finally:
        forget(client, ledger, world)
    return world


def forget(client: redis.Redis, ledger: AcceptedJobs, world: World) -> None:
    """Delete what this run wrote, and only that: its jobs leave the shared sets (``finish``), then every
    key that names its run (records, marks, queues' sets, counters, deferred lists and in-flight counts)."""
    for task_id in world.order:
        ledger.finish(task_id)
    keys = list(client.scan_iter(match=f"*sim-{world.run}*", count=1000))
    for at in range(0, len(keys), 500):
        client.delete(*keys[at : at + 500])


@pytest.fixture
def decoded(redis_client: redis.Redis) -> Iterator[redis.Redis]:
    """The session's Redis as ttsq's own clients read it (``decode_responses``, ``ttsq.records.owner``)."""
    where = redis_client.connection_pool.connection_kwargs
    client = redis.Redis(host=where["host"], port=where["port"], db=where.get("db", 0), decode_responses=True)
    yield client
    client.close()


def seeded() -> int:
    return int(os.environ.get("TTSQ_SIM_SEED") or random.SystemRandom().randrange(2**32))


def test_cancel_settle_and_receipt_hold_in_the_real_ledger(decoded: redis.Redis) -> None:
    seed = seeded()
    ledger = AcceptedJobs(decoded, keep_s=TTL_S, outcome_s=TTL_S)
    started = time.monotonic()
    try:
        world = run(seed, STEPS, decoded, ledger)
    except AssertionError as exc:
        pytest.fail(f"simulation failed with TTSQ_SIM_SEED={seed}: {exc}")
    elapsed = time.monotonic() - started
    print(f"seed {seed}: {world.steps} steps, {len(world.jobs)} jobs in {elapsed:.1f}s: {dict(world.stats)}")
    # The run met what it is for: cancels both ways, duplicates dropped, deaths after a settle.
    seen_all = ("cancel answered REVOKED", "cancel answered SUCCESS", "receipt DUPLICATE", "receipt CANCELLED")
    for seen in (*seen_all, "job deferred", "chunk deferred", "chunk sent at once"):
        assert world.stats[seen] > 0, f"TTSQ_SIM_SEED={seed}: no {seen!r} in {dict(world.stats)}"


# --- mutations: each breaks one rule of one script; the simulation must fail --------------------------
#
# The one place that knows the scripts' text: each mutation is the shipped script with one rule cut out.
# When a script changes, the cut changes with it (the test says so if the text is no longer there).
MUTATIONS = {
    # (a) a settle that ignores the cancel: the worker's outcome stands even when a cancel came first
    "settle": "if redis.call('HGET', KEYS[1], 'state') == 'cancelled' then\n  return 0\nend\n",
    # (b) a cancel that ignores the settle: it wins even when the worker settled first
    "cancel": "if state == 'done' or state == 'failed' then\n  return state\nend\n",
    # (c) a receipt that runs a plain second copy of a job a worker already received
    "received": "if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[1], 'seen_at') == 1 then\n  return 0\nend\n",
    # (e) a defer that keeps the recorded headers: a released job loses its sender's trace
    "defer": "if ARGV[5] and ARGV[5] ~= '' then\n  redis.call('HSET', KEYS[1], 'headers', ARGV[5])\nend\n",
    # (d) a receipt that runs a plain second copy of a job already finished (its outcome kept)
    "received-finished": "  if ARGV[4] == '1' and (state == 'done' or state == 'failed') then\n    return 0\n  end\n",
}
#: What the simulation says when each rule is cut.
FAILS_WITH = {
    "settle": "its cancel won, yet it was stored|then replaced by",
    "cancel": "its cancel won, yet it was stored|then replaced by|a cancel answered",
    "received": "a plain second copy answered RUN while its record lives",
    "received-finished": "a plain second copy answered RUN after its job finished",
    "defer": "not the headers it was deferred with",
}
MUTATION_STEPS = 30_000


def mutated(redis_client: redis.Redis, mutation: str) -> AcceptedJobs:
    ledger = AcceptedJobs(redis_client, keep_s=TTL_S, outcome_s=TTL_S)
    script = mutation.split("-")[0]
    text = source(script)
    assert MUTATIONS[mutation] in text, f"{script}.lua no longer has the rule this test cuts out: update MUTATIONS"
    setattr(ledger, f"_{script}", redis_client.register_script(text.replace(MUTATIONS[mutation], "")))
    return ledger


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_simulation_fails_when_a_rule_is_cut(decoded: redis.Redis, mutation: str) -> None:
    seed = seeded()
    try:
        run(seed, MUTATION_STEPS, decoded, mutated(decoded, mutation), drain=False)
    except AssertionError as exc:
        assert re.search(FAILS_WITH[mutation], str(exc)), f"TTSQ_SIM_SEED={seed}: failed otherwise: {exc}"
    else:
        pytest.fail(f"TTSQ_SIM_SEED={seed}: the simulation passed {MUTATION_STEPS} steps with {mutation}'s rule cut")


# --- the senders' rule cut: chunks sent with no turn, as before they waited under the window ------------


def chunks_sent_at_once(tenant: str | None, *, chunk: bool = False) -> str | None:
    """The rule before the fix: a document's fan-out sent its chunks with no tenant, so ``ttsq.sending``
    sent them to the queue at once, past the window; other jobs waited their turn as today."""
    return None if chunk else turn_of(tenant)


CHUNK_MUTATION_STEPS = 10_000


def test_the_simulation_fails_when_chunks_skip_the_window(decoded: redis.Redis) -> None:
    seed = seeded()
    ledger = AcceptedJobs(decoded, keep_s=TTL_S, outcome_s=TTL_S)
    try:
        run(seed, CHUNK_MUTATION_STEPS, decoded, ledger, drain=False, turn=chunks_sent_at_once)
    except AssertionError as exc:
        assert re.search(r"\([1-9][0-9]* of them document chunks\), over the window", str(exc)), (
            f"TTSQ_SIM_SEED={seed}: failed otherwise: {exc}"
        )
    else:
        pytest.fail(f"TTSQ_SIM_SEED={seed}: {CHUNK_MUTATION_STEPS} steps passed with chunks sent past the window")
