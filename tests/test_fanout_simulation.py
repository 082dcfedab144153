"""A document's fan-out rule (``ttsq.delivery.fanout.unsent``) driven through a simulated world of resumed
fan-outs, many thousands of steps with a fresh seed each run (printed on failure: ``TTSQ_SIM_SEED=<seed>``
replays it).

The world, one step at a time (each step one act, chosen at random, of whoever may act):

- documents arrive; each one's fan-out (``ttsq.worker.documents``) reads the chunks' accepted records,
  then their results, then for each chunk the rule answers accepts it (its record) and, a step later,
  sends its message; its worker may die at any step of that, and the document task comes back later
  (recovery) and resumes: a fresh fan-out that reads again. The two reads are separate steps, with other
  steps going on between them.
- chunk messages are queued, popped by a worker (kombu's fetch window: in no list, not yet in the
  unacked hash), recorded in the unacked hash, started (Celery stores ``STARTED``: a result of a state),
  their result stored (``SUCCESS``), then their record dropped (``AcceptedJobs.finish`` from the
  ``task_postrun`` handler, after Celery stored the result), then acked: each its own step, in the
  product's order.
- faults: a fan-out's worker dies (its chunk accepted and not yet sent stays a record with no message);
  a chunk worker dies (what it popped and had not recorded is lost; what it held goes back to the queue
  after recovery's delay); Redis loses a queued message.
- the sweeper sends again a chunk whose record has no message anywhere at two sweeps in a row (its real
  rules, ``ttsq.delivery.lost``, have their own simulation: here it is an oracle that never sends a
  chunk that has a copy, so a second copy can only come from a fan-out).

After every step, for every chunk the step touched: at most one copy of it in flight (queued, popped,
held, running or on its way back). A fan-out that sends a chunk that has a copy or has run fails at
once, naming where the copy is, and a fan-out's copy never starts after another copy of its chunk did
(a chunk runs again only as at-least-once allows: its copy given back by recovery, or lost after it
started and sent again by the sweeper). At the end, with faults and new documents stopped, every
document's chunks all ran to ``SUCCESS``, and no record and no message is left.
"""

from __future__ import annotations

import collections
import os
import random
import time
from collections.abc import Iterator, Sequence

import pytest

from ttsq.delivery.fanout import Read, choose, unsent

STEPS = 200_000
DOCUMENTS = 6  # documents under way at once
WORKERS = 4
READ_PAUSE = 40  # a fan-out's two reads are up to this many steps apart (a loaded machine)
REDELIVERY = 150  # a dead fan-out's document task comes back within this many steps
RECOVERY = 100  # a dead worker's held messages go back to the queue after this many steps
SWEEP_EVERY = 20  # steps between sweeps; a chunk missing at two sweeps in a row is sent again
DRAIN = 100_000  # steps the end may take, faults stopped

STARTED, SUCCESS = "STARTED", "SUCCESS"


class Chunk:
    """One chunk job of a document, as Redis and the broker know it."""

    __slots__ = ("copies", "document", "missing", "popping", "ran", "record", "result", "task_id")

    def __init__(self, task_id: str, document: Document) -> None:
        self.task_id = task_id
        self.document = document
        self.record = False  # its accepted record (written before its message, dropped after its result)
        self.result: str | None = None  # its result key, of any state
        self.copies = 0  # its messages anywhere: queued, popped, held, running, on their way back
        self.popping = 0  # of those, popped and not yet in the unacked hash (the fetch window)
        self.ran: set[int] = set()  # the copies of it a worker started
        self.missing = 0  # sweeps in a row that found its record and no message of it


class Copy:
    """One message of a chunk."""

    __slots__ = ("by", "chunk", "number", "stage", "worker")

    def __init__(self, number: int, chunk: Chunk, by: str) -> None:
        self.number = number
        self.chunk = chunk
        self.by = by  # who sent it: a fan-out, or the sweeper
        self.worker = -1
        self.stage = 0  # running: 0 started, 1 result stored, 2 record dropped (acked next)


class Document:
    __slots__ = ("back_at", "chunks", "fan_out", "fan_outs", "pending", "ready_at", "sent")

    def __init__(self, number: int, chunks: int) -> None:
        self.chunks = [Chunk(f"doc{number}-{index}", self) for index in range(chunks)]
        self.fan_out: Iterator[int] | None = None  # the live fan-out, one step per ``next``
        self.ready_at = 0  # the step its fan-out's next act may come
        self.pending: Chunk | None = None  # accepted by the live fan-out, its message not sent yet
        self.sent = False  # a fan-out got through (``PlanStore.fanned_out``)
        self.back_at: int | None = None  # its fan-out's worker died: its task comes back at this step
        self.fan_outs = 0


class World:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.now = 0
        self.faults = True
        self.documents: list[Document] = []  # under way
        self.queue: collections.deque[Copy] = collections.deque()
        self.popped: list[Copy] = []  # the fetch window: in no list, not in the unacked hash
        self.held: list[Copy] = []  # in the unacked hash, not started
        self.running: list[Copy] = []  # in the unacked hash, started
        self.returning: list[tuple[int, Copy]] = []  # a dead worker's, in the unacked hash until then
        self.recorded: dict[str, Chunk] = {}  # chunks with an accepted record
        self.touched: set[Chunk] = set()
        self.changed: set[Document] = set()
        self.copies_made = 0
        self.documents_made = 0
        self.stats: collections.Counter[str] = collections.Counter()
        self.failed = ""  # the chunk a fan-out sent a second time

    # --- the fan-out -----------------------------------------------------------------------------

    def fan_out(self, document: Document) -> Iterator[int]:
        """The product's: ``choose`` asks for its reads in its order, answered here with other steps
        between them, and decides. Yields, after each act, the steps until its next."""
        chooser = choose([chunk.task_id for chunk in document.chunks])
        ask = next(chooser)
        while True:
            answer = self.records(document) if ask is Read.RECORDS else self.results(document)
            yield self.rng.randrange(READ_PAUSE)
            try:
                ask = chooser.send(answer)
            except StopIteration as done:
                todo: list[str] = done.value
                break
        yield from self.send(document, todo)

    def records(self, document: Document) -> set[str]:
        if document.fan_outs > 1:  # what a resume finds under way: the states that make the rule hard
            self.stats["popping at a resume's first read"] += sum(c.popping > 0 for c in document.chunks)
            self.stats["running at a resume's first read"] += sum(c.result == STARTED for c in document.chunks)
        return {chunk.task_id for chunk in document.chunks if chunk.record}

    def results(self, document: Document) -> set[str]:
        return {chunk.task_id for chunk in document.chunks if chunk.result is not None}

    def broker(self, document: Document) -> set[str]:
        """What a look in the queue's list and kombu's unacked hash finds of the document's chunks."""
        mine = set(document.chunks)
        unacked = [*self.held, *self.running, *(copy for _, copy in self.returning)]
        return {copy.chunk.task_id for copy in (*self.queue, *unacked) if copy.chunk in mine}

    def send(self, document: Document, ids: Sequence[str]) -> Iterator[int]:
        chunks = {chunk.task_id: chunk for chunk in document.chunks}
        for task_id in ids:
            chunk = chunks[task_id]
            self.accept(chunk)
            document.pending = chunk
            yield 0
            document.pending = None
            if chunk.copies or chunk.ran:
                self.failed = task_id
                raise AssertionError(
                    f"a fan-out ({document.fan_outs}) sent {task_id} a second time: {self.where(chunk)}"
                )
            self.push(chunk, "a fan-out")
            if document.fan_outs > 1:
                self.stats["chunks sent by resumed fan-outs"] += 1
            yield 0

    def where(self, chunk: Chunk) -> str:
        places = [
            *(["queued"] * sum(copy.chunk is chunk for copy in self.queue)),
            *(["a worker is popping it (in no list, not in unacked)"] * chunk.popping),
            *(["held"] * sum(copy.chunk is chunk for copy in self.held)),
            *(["running"] * sum(copy.chunk is chunk for copy in self.running)),
            *(["on its way back"] * sum(copy.chunk is chunk for _, copy in self.returning)),
        ]
        ran = f"; {len(chunk.ran)} copy(ies) of it ran, result {chunk.result}" if chunk.ran else ""
        return f"{chunk.copies} copy(ies) on their way{': ' if places else ''}{', '.join(places)}{ran}"

    # --- the world -------------------------------------------------------------------------------

    def accept(self, chunk: Chunk) -> None:
        chunk.record = True
        self.recorded[chunk.task_id] = chunk
        self.touched.add(chunk)

    def push(self, chunk: Chunk, by: str) -> None:
        self.copies_made += 1
        chunk.copies += 1
        self.queue.append(Copy(self.copies_made, chunk, by))
        self.touched.add(chunk)

    def start_fan_out(self, document: Document) -> None:
        document.fan_outs += 1
        document.fan_out = self.fan_out(document)
        document.ready_at = self.now

    def take(self, copies: list[Copy]) -> Copy:
        """A random one of ``copies``, taken out."""
        index = self.rng.randrange(len(copies))
        copies[index], copies[-1] = copies[-1], copies[index]
        return copies.pop()

    def step(self) -> None:
        self.now += 1
        roll = self.rng.random()
        if roll < 0.02:
            if self.faults and len(self.documents) < DOCUMENTS:
                self.documents_made += 1
                document = Document(self.documents_made, self.rng.randrange(1, 9))
                self.documents.append(document)
                self.start_fan_out(document)
        elif roll < 0.22:
            ready = [d for d in self.documents if d.fan_out is not None and d.ready_at <= self.now]
            if ready:
                self.advance(self.rng.choice(ready))
        elif roll < 0.40:
            if self.queue:
                copy = self.queue.popleft()
                copy.worker = self.rng.randrange(WORKERS)
                copy.chunk.popping += 1
                self.popped.append(copy)
        elif roll < 0.55:
            if self.popped:  # kombu records it in the unacked hash
                copy = self.take(self.popped)
                copy.chunk.popping -= 1
                self.held.append(copy)
        elif roll < 0.67:
            if self.held:  # a task thread starts it: Celery stores STARTED
                copy = self.take(self.held)
                if copy.by == "a fan-out" and copy.chunk.ran - {copy.number}:
                    raise AssertionError(f"{copy.chunk.task_id}: run a second time by a fan-out's copy")
                copy.chunk.ran.add(copy.number)
                if copy.chunk.result is None:
                    copy.chunk.result = STARTED
                copy.stage = 0
                self.running.append(copy)
                self.touched.add(copy.chunk)
        elif roll < 0.93:
            if self.running:
                self.work(self.rng.randrange(len(self.running)))
        elif self.faults:
            if roll < 0.94:
                self.kill_fan_out()
            elif roll < 0.943:
                self.kill_worker(self.rng.randrange(WORKERS))
            elif roll < 0.945 and self.queue:  # Redis loses a queued message
                position = self.rng.randrange(len(self.queue))
                self.lose(self.queue[position])
                del self.queue[position]
        self.settle()
        self.check()

    def advance(self, document: Document) -> None:
        assert document.fan_out is not None
        try:
            document.ready_at = self.now + next(document.fan_out)
        except StopIteration:
            document.fan_out = None
            document.sent = True
            self.changed.add(document)

    def work(self, index: int) -> None:
        """The next act of a running copy: its result stored, then its record dropped, then its ack."""
        copy = self.running[index]
        chunk = copy.chunk
        if copy.stage == 0:
            chunk.result = SUCCESS
        elif copy.stage == 1:
            chunk.record = False
            self.recorded.pop(chunk.task_id, None)
        else:
            self.running[index] = self.running[-1]
            self.running.pop()
            chunk.copies -= 1
            self.changed.add(chunk.document)
        copy.stage += 1
        self.touched.add(chunk)

    def kill_fan_out(self) -> None:
        live = [d for d in self.documents if d.fan_out is not None]
        if live:
            document = self.rng.choice(live)
            document.fan_out = None
            document.pending = None  # accepted and never sent: a record and no message, for the sweeper
            document.back_at = self.now + self.rng.randrange(1, REDELIVERY)
            self.stats["fan-outs killed"] += 1

    def kill_worker(self, worker: int) -> None:
        for copy in [c for c in self.popped if c.worker == worker]:
            copy.chunk.popping -= 1
            self.lose(copy)
        self.popped = [c for c in self.popped if c.worker != worker]
        for copies in (self.held, self.running):
            for copy in copies:
                if copy.worker == worker:
                    self.returning.append((self.now + RECOVERY, copy))
            copies[:] = [c for c in copies if c.worker != worker]

    def lose(self, copy: Copy) -> None:
        copy.chunk.copies -= 1
        self.touched.add(copy.chunk)
        self.stats["messages lost"] += 1

    def settle(self) -> None:
        """Recovery's give-backs, the documents' redeliveries and the sweeps that are due."""
        if self.returning and any(at <= self.now for at, _ in self.returning):
            for at, copy in self.returning:
                if at <= self.now:
                    copy.worker, copy.stage = -1, 0
                    self.queue.append(copy)
            self.returning = [(at, c) for at, c in self.returning if at > self.now]
        for document in self.documents:
            if document.back_at is not None and document.back_at <= self.now:
                document.back_at = None
                self.start_fan_out(document)
                self.stats["fan-outs resumed"] += 1
        if self.now % SWEEP_EVERY == 0:
            for chunk in list(self.recorded.values()):
                if chunk.copies or chunk is chunk.document.pending:
                    chunk.missing = 0
                    continue
                chunk.missing += 1
                if chunk.missing >= 2:
                    chunk.missing = 0
                    self.push(chunk, "the sweeper")
                    self.stats["sent again by the sweeper"] += 1

    def check(self) -> None:
        for chunk in self.touched:
            assert chunk.copies <= 1, f"{chunk.task_id}: two copies in flight: {self.where(chunk)}"
            self.changed.add(chunk.document)
        self.touched.clear()
        for document in self.changed:
            if (
                document.sent
                and document.fan_out is None
                and document.back_at is None
                and all(c.result == SUCCESS and not c.record and not c.copies for c in document.chunks)
            ):
                self.documents.remove(document)
                self.stats["documents done"] += 1
                self.stats["chunks done"] += len(document.chunks)
        self.changed.clear()

    def drain(self) -> None:
        """No more faults or documents: every document under way is done in the end."""
        self.faults = False
        until = self.now + DRAIN
        while self.documents:
            assert self.now < until, f"never done: {[d.chunks[0].task_id for d in self.documents]}"
            self.step()
        leftover = (self.queue, self.popped, self.held, self.running, self.returning, self.recorded)
        assert not any(leftover), leftover


def run(world: World, steps: int) -> World:
    for _ in range(steps):
        world.step()
    world.drain()
    return world


def test_a_resumed_fan_out_sends_no_chunk_twice_and_every_chunk_is_done() -> None:
    seed = int(os.environ.get("TTSQ_SIM_SEED") or random.SystemRandom().randrange(2**32))
    started = time.process_time()
    try:
        world = run(World(random.Random(seed)), STEPS)
    except AssertionError as exc:
        pytest.fail(f"simulation failed with TTSQ_SIM_SEED={seed}: {exc}")
    stats = world.stats
    print(f"seed {seed}: {STEPS} steps, {dict(stats)} in {time.process_time() - started:.1f} CPU-s", end=" ")
    # The world did what makes the rule hard, or the test proves nothing: resumed fan-outs found chunks a
    # worker was popping and chunks running, sent chunks, and lost ones were sent again by the sweeper.
    for name in (
        "fan-outs resumed",
        "chunks sent by resumed fan-outs",
        "popping at a resume's first read",
        "running at a resume's first read",
        "sent again by the sweeper",
    ):
        assert stats[name] > 0, f"TTSQ_SIM_SEED={seed}: no {name}"
    assert stats["documents done"] == world.documents_made, f"TTSQ_SIM_SEED={seed}"


def failing(worlds: list[World], match: str, *, steps: int = STEPS) -> list[World]:
    """The worlds that fail within ``steps``, each with a message that contains ``match`` (another
    failure fails the test)."""
    failed = []
    for world in worlds:
        try:
            run(world, steps)
        except AssertionError as exc:
            assert match in str(exc), f"{type(world).__name__}: {exc}"
            failed.append(world)
    return failed


def test_reading_the_results_first_sends_a_chunk_that_finished_between_the_reads() -> None:
    """Results read before records: a chunk that starts, stores its result and drops its record between
    the two reads is in neither, and is sent (and run) a second time."""

    class ResultsFirst(World):
        def fan_out(self, document: Document) -> Iterator[int]:
            ids = [chunk.task_id for chunk in document.chunks]
            finished = self.results(document)
            yield self.rng.randrange(READ_PAUSE)
            recorded = self.records(document)
            yield 0
            yield from self.send(document, unsent(ids, recorded, finished))

    worlds: list[World] = [ResultsFirst(random.Random(seed)) for seed in range(5)]
    assert failing(worlds, "a second time") == worlds


def test_going_by_the_broker_sends_a_chunk_a_worker_is_popping() -> None:
    """The old rule (``_send_missing``): send a chunk with no result that is in no queue list and not in
    kombu's unacked hash, the results read before and after the look. A chunk a worker was popping at the
    look was in neither, and is sent a second time (and so is a lost one the sweeper sends meanwhile from
    its record: the broker says nothing of who else will send it)."""

    class ByTheBroker(World):
        #: Each chunk, as its fan-out's latest look found it.
        looked: dict[str, str]

        def fan_out(self, document: Document) -> Iterator[int]:
            ids = [chunk.task_id for chunk in document.chunks]
            seen = self.results(document)
            yield self.rng.randrange(READ_PAUSE)
            somewhere = self.broker(document)
            for chunk in document.chunks:
                self.looked[chunk.task_id] = "popping" if chunk.popping else "lost" if not chunk.copies else ""
            yield 0
            seen |= self.results(document)
            yield 0
            yield from self.send(document, [i for i in ids if i not in seen and i not in somewhere])

    worlds = [ByTheBroker(random.Random(seed)) for seed in range(5)]
    for world in worlds:
        world.looked = {}
    assert failing(list(worlds), "a second time") == worlds
    found = [world.looked[world.failed] for world in worlds]
    assert set(found) <= {"popping", "lost"} and "popping" in found, found


def test_sending_every_chunk_on_resume_sends_a_chunk_twice() -> None:
    """The checks see a resume with no rule at all: each chunk sent again whatever became of it."""

    class EveryChunk(World):
        def fan_out(self, document: Document) -> Iterator[int]:
            yield 0
            yield from self.send(document, [chunk.task_id for chunk in document.chunks])

    worlds: list[World] = [EveryChunk(random.Random(seed)) for seed in range(5)]
    assert failing(worlds, "a second time") == worlds
