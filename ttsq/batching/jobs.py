"""The job bookkeeping the batcher and its two schedulers share: a job waiting for the engine
(``Waiting``), a finished one (``BatchItem``), the hand-over from task threads (``Intake``), and what a
scheduler must offer the batcher (``Scheduler``)."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ttsq.errors import EngineError

if TYPE_CHECKING:
    from ttsq.engines.base import EngineOutput, Piece
    from ttsq.job import SynthesisRequest

logger = logging.getLogger(__name__)

#: Handed to ``Intake.put`` by ``Batcher.stop``: run what is pending, then end.
STOP = object()


@dataclass(frozen=True)
class Waiting:
    """A request in the batcher, with the time by which its group must run (monotonic seconds)."""

    request: SynthesisRequest
    future: Future[BatchItem]
    deadline: float
    #: Group key: the request's group, or a key of its own for an isolated job.
    group: tuple[Any, ...]
    #: Called on the batcher thread just before the engine runs this job, and once the engine call
    #: has returned (attempt accounting: a call that never returns leaves its jobs charged).
    on_enter: Callable[[], object] | None = None
    on_exit: Callable[[], object] | None = None
    #: When the task thread handed it over (monotonic seconds).
    arrived: float = 0.0
    #: Where a streaming job's audio goes while the engine makes it (``ttsq.engines.base.Piece``).
    on_piece: Piece | None = None
    #: The job's span context (``ttsq.tracing.current``) for the batch's spans to link to; None untraced.
    trace: Any = None

    @property
    def isolated(self) -> bool:
        """Whether this job runs alone."""
        return bool(self.group[0] == "isolated")


@dataclass(frozen=True)
class BatchItem:
    """One finished item: its audio and the batch it rode in."""

    output: EngineOutput
    batch_id: int
    batch_size: int
    synthesis_s: float
    #: This item's share of its engine call's time, apportioned by the audio length it generated.
    device_s: float = 0.0


#: A gap between two arrivals longer than this starts a new stream: its rate says nothing of the next.
STREAM_GAP_S = 1.0
#: How long a lone job waits for company when no arrival stream is known (the old fixed window).
MIN_PAUSE_S = 0.02
#: A pause of this many mean arrival gaps means the stream has stopped...
PAUSE_GAPS = 3.0
#: ... and never a pause shorter than this share of the bound: a thread scheduled late on a busy
#: machine is not the end of a burst.
PAUSE_SHARE = 0.25


def recent_mean(mean: float | None, value: float) -> float:
    """An exponentially weighted mean over the last few values (the newest weighs 0.3); ``value``
    itself when there is no mean yet. For arrival gaps here, engine call times in the batch scheduler."""
    return value if mean is None else 0.3 * value + 0.7 * mean


class Arrivals:
    """The recent arrival stream (batcher thread only): when the last job came in, and the mean gap
    between jobs while they keep coming."""

    def __init__(self) -> None:
        self.last: float | None = None
        #: Mean seconds between arrivals in the current stream; None until a stream has two jobs.
        self.mean_gap: float | None = None

    def note(self, now: float) -> None:
        if self.last is not None:
            gap = now - self.last
            self.mean_gap = None if gap > STREAM_GAP_S else recent_mean(self.mean_gap, gap)
        self.last = now

    def paused_at(self, since: float, max_wait_s: float) -> float:
        """When the stream counts as paused, for a job waiting since ``since`` (monotonic seconds): a
        few mean gaps after the last arrival, at least ``PAUSE_SHARE`` of the window (and
        ``MIN_PAUSE_S``), never more than the window."""
        floor = max(MIN_PAUSE_S, PAUSE_SHARE * max_wait_s)
        gap = self.mean_gap
        pause = min(max_wait_s, floor if gap is None else max(floor, PAUSE_GAPS * gap))
        return max(since, self.last or 0.0) + pause


class Incoming:
    """Jobs a worker has taken from the queue that are on their way to the batcher (the task thread
    is checking the cache and the ledger): the queue depth the batcher cannot see yet. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def expect(self) -> Expected:
        with self._lock:
            self._count += 1
        return Expected(self)

    def _arrived(self) -> None:
        with self._lock:
            self._count -= 1


#: How often a waiting scheduler asks the broker how many jobs are queued (seconds).
BACKLOG_EVERY_S = 0.05
#: While jobs are on their way, a waiting scheduler looks again this often (their arrival wakes it sooner).
POLL_S = 0.005


class Coming:
    """Whether jobs are known to be on their way to the batcher: a task thread is checking one, or the
    broker holds some for this worker (``backlog``, asked at most every ``BACKLOG_EVERY_S``; it must
    answer fast and never raise). Batcher thread only."""

    def __init__(self, incoming: Incoming, backlog: Callable[[], int] | None) -> None:
        self._incoming = incoming
        self._backlog = backlog
        self._read: tuple[float, int] = (-1.0, 0)  # (when, what) the broker last said

    def __call__(self, now: float) -> bool:
        if self._incoming.count:
            return True
        if self._backlog is None:
            return False
        when, queued = self._read
        if now - when >= BACKLOG_EVERY_S:
            queued = self._backlog()
            self._read = (now, queued)
        return queued > 0


class Expected:
    """One job on its way; ``done`` once it is in the batcher or has left without it (idempotent)."""

    def __init__(self, incoming: Incoming) -> None:
        self._incoming: Incoming | None = incoming

    def done(self) -> None:
        incoming, self._incoming = self._incoming, None
        if incoming is not None:
            incoming._arrived()


class Intake:
    """Requests from the task threads, sorted into groups as the batcher thread takes them in.

    Only the batcher thread reads ``pending``, ``stop_seen`` and ``arrivals``; ``put`` and
    ``incoming`` are the thread-safe parts.
    """

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        #: group -> jobs waiting, oldest first.
        self.pending: dict[tuple[Any, ...], list[Waiting]] = {}
        #: The stop marker has been taken in: run what is pending, then end.
        self.stop_seen = False
        self.batch_ids = itertools.count(1)
        self._isolated_ids = itertools.count(1)
        self.arrivals = Arrivals()
        self.incoming = Incoming()

    def put(self, item: Waiting | object) -> None:
        """Hand over a job (or the stop marker)."""
        self._queue.put(item)

    def isolated_group(self) -> tuple[Any, ...]:
        """A group key no other job shares."""
        return ("isolated", next(self._isolated_ids))

    def drain(self, *, block_until: float | None) -> None:
        """Move queued requests into their groups: all that are there now (``block_until`` None), or
        wait until one arrives or the given monotonic time passes."""
        while True:
            try:
                if block_until is None:
                    item = self._queue.get_nowait()
                elif block_until == float("inf"):
                    item = self._queue.get()
                else:
                    item = self._queue.get(timeout=max(0.0, block_until - time.monotonic()))
            except queue.Empty:
                return
            if item is STOP:
                self.stop_seen = True
                return
            self.arrivals.note(item.arrived or time.monotonic())
            try:
                self.pending.setdefault(item.group, []).append(item)
            except Exception as exc:  # a request that cannot even be grouped fails alone
                if item.future.set_running_or_notify_cancel():
                    item.future.set_exception(EngineError(f"cannot batch this request: {exc!r}"))
            if block_until is not None:
                return

    def fail_all(self, reason: str) -> None:
        """Answer every job still held, pending or queued, with ``reason``."""
        waiting = [w.future for group in self.pending.values() for w in group]
        self.pending.clear()
        for future in waiting:
            if claim(future):
                future.set_exception(EngineError(reason))
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not STOP and item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineError(reason))


class Scheduler(Protocol):
    """What the batcher thread runs once the engine is warm (``batch_scheduler``, ``slot_scheduler``)."""

    #: Monotonic start of the engine call now running, None while the engine is idle.
    busy_since: float | None

    def run(self) -> None:
        """Schedule jobs until the stop marker has been taken in and everything pending has run. Jobs
        it still holds when it ends, however it ends, go back to ``intake.pending``."""
        ...

    def abandon(self, future: Future[BatchItem]) -> None:
        """The caller gave up on a job the engine may be decoding (thread-safe)."""
        ...


def bookkeep(calls: list[Callable[[], object] | None]) -> None:
    """Run attempt-accounting callbacks; one that fails is logged, and the job runs anyway."""
    for call in calls:
        if call is not None:
            try:
                call()
            except Exception as exc:
                logger.warning("could not record an attempt (%s); running the job anyway", exc)


def claim(future: Future[BatchItem]) -> bool:
    """Whether the batcher may resolve this future now: it was waiting (and is now running), or it is
    running already (a job queued again after a ``SharedFailure``). False if cancelled or resolved."""
    if future.done():
        return False
    return future.running() or future.set_running_or_notify_cancel()


def late(request: SynthesisRequest, now: float) -> str:
    """Why a job past its deadline was dropped."""
    return f"deadline passed {now - (request.deadline or now):.1f}s before synthesis; the job was dropped"


def audio_seconds(output: EngineOutput | Exception) -> float:
    """Seconds of audio an engine output holds (0 for a failed item)."""
    if isinstance(output, Exception) or output.sample_rate <= 0:
        return 0.0
    return float(len(output.samples)) / output.sample_rate
