"""Continuous batching for a ``ContinuousEngine`` (qwen-fast): jobs join free slots between frames.

Every job joins as soon as a slot is free, interactive jobs first, then in arrival order, and leaves when
it is done; an isolated job runs alone. Only an idle engine waits before it starts, for the rest of a
burst: while more jobs are known to be on their way or keep arriving, within the batch window (a lone
job waits out a pause in the arrival stream, a quarter of the window by default, as a batch engine's
group does), so that they start together instead of one a frame; rows that start together end
together, their slots refill together, and the burst's last rows do not trail off in ever smaller
batches. A streaming job waits for no one.

Each job is charged its own prefill and an even share of every frame it was in, so the shares add up to
the engine's busy time. Failures, cancellation and the accounting: docs/development.md, "The batcher".
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ttsq.tracing as tracing
from ttsq.batching.jobs import POLL_S, BatchItem, Coming, Intake, Waiting, audio_seconds, bookkeep, claim, late
from ttsq.engines.base import streams_audio
from ttsq.errors import DeadlineExceeded, EngineError, SharedFailure, TTSQError
from ttsq.observer import BatchReport, Observer

if TYPE_CHECKING:
    from ttsq.engines.base import ContinuousEngine, EngineOutput

logger = logging.getLogger(__name__)


class SlotScheduler:
    """Feeds a ``ContinuousEngine`` from the intake (batcher thread; ``done`` may fire on the engine's
    codec thread, and ``abandon`` on any thread)."""

    def __init__(
        self,
        engine: ContinuousEngine,
        intake: Intake,
        observer: Observer,
        *,
        max_wait_s: float = 0.0,
        backlog: Callable[[], int] | None = None,
    ) -> None:
        """``max_wait_s``: the longest an idle engine's first rows wait for the rest of a burst;
        ``backlog``: how many jobs wait in the broker for this worker (``Batcher``)."""
        self.engine = engine
        self.intake = intake
        self.observer = observer
        self.max_wait_s = max_wait_s
        self.coming = Coming(intake.incoming, backlog)
        #: Whether the engine hands streaming rows their audio while it makes them.
        self.streams = streams_audio(engine)
        self.busy_since: float | None = None
        # Device seconds charged so far to each job in the engine (by batch id), and jobs to run again
        # alone; guarded by one lock since ``done`` may run on the codec thread.
        self._charges: dict[int, list[float]] = {}
        self._retries: collections.deque[Waiting] = collections.deque()
        self._lock = threading.Lock()
        self._abandoned: collections.deque[Future[BatchItem]] = collections.deque()
        self._decoding: dict[Future[BatchItem], Callable[[Any], object]] = {}  # job -> its done, in the engine

    def abandon(self, future: Future[BatchItem]) -> None:
        self._abandoned.append(future)

    def run(self) -> None:
        engine, intake = self.engine, self.intake
        waiting: list[Waiting] = []
        alone: Future[BatchItem] | None = None  # the isolated job decoding, until it is answered
        try:
            while True:
                waiting.extend(self._take_retries())
                idle = not engine.active and not waiting
                if idle and intake.stop_seen and not intake.pending:
                    return
                intake.drain(block_until=float("inf") if idle and not intake.stop_seen else None)
                if intake.pending or waiting:  # arrival order across groups: groups only matter to batch engines
                    waiting.extend(w for group in intake.pending.values() for w in group)
                    intake.pending.clear()
                    # Interactive rows take a free slot before bulk ones (docs/scheduling.md), then arrival.
                    waiting.sort(key=lambda w: (w.request.lane == "bulk", w.deadline))
                if alone is not None and alone.done():
                    alone = None
                fill_until = self._filling(waiting) if alone is None else None
                if fill_until is not None:
                    intake.drain(block_until=min(fill_until, time.monotonic() + POLL_S))
                    continue
                while waiting and alone is None and engine.free_slots() > 0:
                    isolated = waiting[0].isolated
                    if isolated and (engine.active or self._charges):
                        break  # it starts once the slots have emptied and their jobs are answered
                    job = waiting.pop(0)
                    self._admit(job)
                    if isolated and not job.future.done():
                        alone = job.future
                self._drop_abandoned()
                if engine.active:
                    # The jobs that join once slots free up: none while an isolated job is in the engine
                    # or waits for it to empty (the loop stops after this generation then).
                    joining = 0 if alone is not None or (waiting and waiting[0].isolated) else len(waiting)
                    self._step(queued=joining)
                elif waiting:  # jobs wait for a codec decode to answer the isolated job or its elders
                    intake.drain(block_until=time.monotonic() + 0.01)
        finally:  # whatever ends the loop, no job it holds is lost: the batcher answers these
            for job in [*waiting, *self._take_retries()]:
                intake.pending.setdefault(job.group, []).append(job)

    def _filling(self, waiting: list[Waiting]) -> float | None:
        """Until when an idle engine waits before it admits ``waiting`` (monotonic seconds), for the
        rest of a burst; None: start now. It starts once the waiting jobs fill its free slots, or the
        oldest has waited the batch window, or, with none known to be coming (none in the broker or
        in a task thread), once the arrival stream pauses (as a batch engine's group does)."""
        if self.engine.active or not waiting or len(waiting) >= self.engine.free_slots():
            return None
        if waiting[0].isolated or any(w.on_piece is not None for w in waiting):
            return None  # someone is listening, or it runs alone anyway
        now = time.monotonic()
        until = min(w.deadline for w in waiting)
        if not self.coming(now):
            until = min(until, self.intake.arrivals.paused_at(min(w.arrived for w in waiting), self.max_wait_s))
        return until if until > now else None

    def _drop_abandoned(self) -> None:
        while self._abandoned:
            done = self._decoding.get(self._abandoned.popleft())
            if done is not None and self.engine.cancel(done):
                logger.info("a job its caller gave up on left the engine")

    def _step(self, queued: int) -> None:
        """One frame, its time split between the jobs in the engine; ``queued`` jobs wait for a slot."""
        with self._lock:
            charges = list(self._charges.values())
        self.busy_since = time.monotonic()
        started = time.perf_counter()
        try:
            self.engine.step(queued)
        except Exception:  # the engine fails its own rows; the loop goes on
            logger.exception("continuous engine step failed")
        finally:
            self.busy_since = None
            share = (time.perf_counter() - started) / max(1, len(charges))
            for charge in charges:
                charge[0] += share

    def _take_retries(self) -> list[Waiting]:
        retries = []
        while self._retries:
            retries.append(self._retries.popleft())
        return retries

    def _admit(self, waiting: Waiting) -> None:
        """Start one job in the engine, or drop it if it was cancelled or its deadline has passed."""
        if not claim(waiting.future):
            return
        now = time.time()
        if waiting.request.expired(now):
            waiting.future.set_exception(DeadlineExceeded(late(waiting.request, now)))
            return
        bookkeep([waiting.on_enter])
        batch_id = next(self.intake.batch_ids)
        started = time.perf_counter()
        rows = self.engine.active + 1
        admitted = time.monotonic()
        tracing.record("ttsq.batch_wait", waiting.trace, waiting.arrived, admitted)
        charge = [0.0]  # device seconds charged to this job (its admit, its share of every step)
        with self._lock:
            self._charges[batch_id] = charge

        def done(output: EngineOutput | Exception) -> None:
            with self._lock:
                self._charges.pop(batch_id, None)
                self._decoding.pop(waiting.future, None)
            seconds = time.perf_counter() - started
            if isinstance(output, SharedFailure) and not waiting.isolated:
                # Perhaps a neighbour's fault: run it again, alone (the loop picks it up; thread-safe).
                if waiting.on_piece is not None:
                    waiting.on_piece(None)  # its audio starts over
                bookkeep([waiting.on_exit])
                self._retries.append(replace(waiting, group=self.intake.isolated_group()))
                return
            if isinstance(output, Exception):
                waiting.future.set_exception(output if isinstance(output, TTSQError) else EngineError(repr(output)))
            else:
                self.observer.batch_finished(
                    BatchReport(
                        size=rows, seconds=charge[0], audio_s=audio_seconds(output), truncated=int(output.truncated)
                    )
                )
                # A continuous engine has no batch to link: each job's decode is its own span.
                tracing.record(
                    "ttsq.synthesis",
                    waiting.trace,
                    admitted,
                    attributes={"ttsq.batch.size": rows, "ttsq.engine": self.engine.identity.engine},
                )
                waiting.future.set_result(BatchItem(output, batch_id, rows, seconds, charge[0]))
            bookkeep([waiting.on_exit])

        with self._lock:
            self._decoding[waiting.future] = done
        self.busy_since = time.monotonic()
        try:
            if waiting.on_piece is not None and self.streams:
                self.engine.admit(waiting.request, done, piece=waiting.on_piece)  # type: ignore[call-arg]
            else:
                self.engine.admit(waiting.request, done)
        except BaseException as exc:  # admit reports failures through done; this is a bug, failing one job
            logger.exception("continuous engine admit failed")
            if not waiting.future.done():  # even if the loop ends with it: this job is no longer waiting
                done(EngineError(f"cannot start this job: {exc!r}"))
            if not isinstance(exc, Exception):
                raise
        finally:
            self.busy_since = None
            charge[0] += time.perf_counter() - started
