"""Batches for an engine that takes a list and returns it whole (espeak, stock qwen).

Jobs wait in groups that can share a forward pass; a group runs when it is full, or earlier once more
waiting no longer pays; a failed batch is retried item by item, and one out of device memory is split in
halves. When a batch leaves, and why: docs/development.md, "The batcher".
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import ttsq.tracing as tracing
from ttsq.batching.jobs import (
    POLL_S,
    BatchItem,
    Coming,
    Intake,
    Waiting,
    audio_seconds,
    bookkeep,
    late,
    recent_mean,
)
from ttsq.engines.base import streams_audio
from ttsq.errors import DeadlineExceeded, EngineError, EngineOutOfMemory, TTSQError
from ttsq.observer import BatchReport, Observer

if TYPE_CHECKING:
    from ttsq.engines.base import Engine, EngineOutput, Piece
    from ttsq.job import SynthesisRequest

logger = logging.getLogger(__name__)

#: An output or exception, the size of the engine call it came from, that call's seconds, and this
#: output's share of them (apportioned by generated audio length).
_Ran = tuple["EngineOutput | Exception", int, float, float]

#: A group waits at most this share of a recent engine call's time: past it, a bigger batch later
#: costs its waiting jobs more than the fuller pass saves.
FILL_SHARE = 0.5
#: A group whose audio would queue behind the encoders waits until they have this many recent engine
#: calls' worth of work left: its batch then returns as they run dry (more than one, for the bigger batch
#: it will be and a late wake-up on a busy host; a little early costs a row or two, late leaves them idle).
HOLD_CALLS = 1.5
#: While a group is held for the encoders, the batcher looks again this often (seconds): they may run dry
#: sooner than their recent pace said.
HOLD_RECHECK_S = 0.02

#: Seconds the stage after the engine is busy for a batch of these requests (``Batcher``'s ``downstream``).
Downstream = Callable[[Sequence["SynthesisRequest"]], float]


class BatchScheduler:
    """Forms batches from the intake's groups and runs them on the engine (batcher thread only)."""

    def __init__(
        self,
        engine: Engine,
        intake: Intake,
        observer: Observer,
        *,
        max_batch: int,
        max_wait_s: float,
        backlog: Callable[[], int] | None = None,
        downstream: Downstream | None = None,
    ) -> None:
        self.coming = Coming(intake.incoming, backlog)
        self.downstream = downstream
        self.engine = engine
        #: Whether the engine hands streaming rows their audio while it makes them.
        self.streams = streams_audio(engine)
        self.intake = intake
        self.observer = observer
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        #: Mean seconds of the recent engine calls (None before the first), and when the last ended.
        self.recent_call_s: float | None = None
        self.idle_since = 0.0
        self.busy_since: float | None = None
        #: Length bucket -> largest batch known to fit on the device, learnt from out-of-memory errors.
        self.largest_fit: dict[int, int] = {}
        self.oom_splits = 0

    def abandon(self, future: Future[BatchItem]) -> None:
        """A job already in a batch finishes with its batch: nothing to free."""

    def run(self) -> None:
        while (batch := self._next_batch()) is not None:
            if not batch:
                continue
            bookkeep([w.on_enter for w in batch])
            # By length, for a batch engine's padding; but streaming jobs first, in the order they came: an
            # engine that makes a batch's clips one by one (espeak) then hands a document's chunks over in
            # reading order, and its first chunk is not made last of eight.
            batch = sorted(batch, key=lambda w: (0, w.arrived, 0) if w.on_piece else (1, 0.0, len(w.request.text)))
            group = [(w.request, w.future) for w in batch]
            try:
                with tracing.batch([(w.trace, w.arrived) for w in batch], self._traced(batch)):
                    self._run_group(group, [w.on_piece for w in batch])
            except BaseException as exc:  # never let the thread die with futures unresolved
                logger.exception("batcher failed outside the engine")
                for _, future in group:
                    if not future.done():
                        future.set_exception(EngineError(f"batcher failure: {exc!r}"))
            finally:
                bookkeep([w.on_exit for w in batch])

    def _traced(self, batch: list[Waiting]) -> dict[str, tracing.Value | None]:
        """What the batch's spans say about it (nothing of its texts)."""
        if not tracing.enabled():
            return {}
        first = batch[0].request
        return {
            "ttsq.batch.size": len(batch),
            "ttsq.engine": self.engine.identity.engine,
            "ttsq.mode": first.mode,
            "ttsq.language": first.language if all(w.request.language == first.language for w in batch) else "mixed",
        }

    def _next_batch(self) -> list[Waiting] | None:
        """Wait for the next batch to be due: a group that is full, or one that should not wait any
        longer (module docstring). Returns None once stopped and drained."""
        intake, pending = self.intake, self.intake.pending
        while True:
            # Everything that arrived while the last batch ran joins its group before any choice.
            intake.drain(block_until=None)
            full = next((key for key, group in pending.items() if len(group) >= self.max_batch), None)
            if full is not None:
                return self._take(full)
            if intake.stop_seen:  # run what is pending, then end
                return self._take(next(iter(pending))) if pending else None
            now = time.monotonic()
            coming = bool(pending) and self.coming(now)
            due_at = {key: self._due_at(group, now, coming) for key, group in pending.items()}
            due = min(due_at, key=lambda key: due_at[key][0], default=None)
            if due is not None and due_at[due][0] <= now:
                return self._take(due)
            wake, held = (float("inf"), False) if due is None else due_at[due]
            if held:
                # Held for the encoders: an arrival wakes it anyway, and a job that leaves without
                # arriving changes nothing; they may run dry sooner than their recent pace said.
                wake = min(wake, now + HOLD_RECHECK_S)
            elif coming:
                wake = min(wake, now + POLL_S)  # a job on its way may also leave without arriving
            intake.drain(block_until=wake)

    def _due_at(self, group: list[Waiting], now: float, coming: bool) -> tuple[float, bool]:
        """When a group that is not full stops waiting for company (monotonic seconds), and whether it
        is held for the encoders until then; ``coming``: whether jobs are known to be on their way."""
        oldest = group[0]
        if any(w.on_piece is not None for w in group):
            # Someone is listening: a streaming job waits for no company (what arrived with it rides along).
            return min(w.arrived for w in group if w.on_piece is not None), False
        recent = self.recent_call_s
        deadlines = [w.request.deadline for w in group if w.request.deadline is not None]
        # Leave the job whose deadline comes first the time an engine call takes.
        latest = now + (min(deadlines) - time.time()) - (recent or 0.0) if deadlines else math.inf
        due = min(oldest.deadline, latest)  # oldest.deadline: submitted + max_wait_s, the bound
        if not coming:
            # Nothing known to be coming: wait out a pause in the arrival stream, and never more than the
            # fuller pass is worth. Waiting for company starts when the device is free: time queued
            # behind a running batch was not spent waiting for this one to fill.
            since = max(oldest.arrived, self.idle_since)
            if recent is not None:
                due = min(due, since + FILL_SHARE * recent)
            due = min(due, self.intake.arrivals.paused_at(since, self.max_wait_s))
        if self.downstream is not None and recent is not None:
            # Audio that would only queue behind the encoders is made no sooner than they can take it:
            # until then the group waits here for company, past the bound (the jobs wait as long either
            # way, first come first served), though never past a deadline.
            held = min(now + self.downstream([w.request for w in group]) - HOLD_CALLS * recent, latest)
            if held > due:
                return held, True
        return due, False

    def _take(self, key: tuple[Any, ...]) -> list[Waiting]:
        pending = self.intake.pending
        group = pending.pop(key)
        if len(group) > self.max_batch:
            # More than a batch waits: interactive rows first, then the nearest deadline, then arrival
            # (the sort is stable). What stays waits in arrival order, as the bounds above read it.
            group = sorted(group, key=_urgency)
            pending[key] = sorted(group[self.max_batch :], key=lambda w: w.arrived)
        # A future cancelled while waiting, or a job past its deadline, is dropped here, before any
        # work is done for it.
        now = time.time()
        batch = []
        for waiting in group[: self.max_batch]:
            if not waiting.future.set_running_or_notify_cancel():
                continue
            if waiting.request.expired(now):
                waiting.future.set_exception(DeadlineExceeded(late(waiting.request, now)))
                continue
            batch.append(waiting)
        return batch

    def _run_group(
        self, group: list[tuple[SynthesisRequest, Future[BatchItem]]], pieces: Sequence[Piece | None]
    ) -> None:
        batch_id = next(self.intake.batch_ids)
        requests = [request for request, _ in group]
        started = time.perf_counter()
        results = self._synthesize(requests, pieces)
        elapsed = time.perf_counter() - started
        failed = 0
        for (_, future), (output, size, seconds, share) in zip(group, results, strict=True):
            if isinstance(output, Exception):
                failed += 1
                future.set_exception(output if isinstance(output, TTSQError) else EngineError(repr(output)))
            else:
                future.set_result(BatchItem(output, batch_id, size, seconds, share))
        logger.info(
            "batch %d: %d items (%d failed) in %.3fs, %s",
            batch_id,
            len(group),
            failed,
            elapsed,
            requests[0].describe().split(" chars=")[0],
        )

    def _call_engine(
        self, requests: Sequence[SynthesisRequest], pieces: Sequence[Piece | None]
    ) -> list[EngineOutput | Exception]:
        """One engine call, timed for the watchdog (``busy_since``)."""
        streaming = self.streams and any(piece is not None for piece in pieces)
        if streaming:
            for piece in pieces:
                if piece is not None:
                    piece(None)  # a row run again (split, retried alone) starts its audio over
        self.busy_since = started = time.monotonic()
        try:
            if streaming:
                outputs = self.engine.synthesize_batch(requests, pieces=pieces)  # type: ignore[call-arg]
            else:
                outputs = self.engine.synthesize_batch(requests)
        finally:
            self.busy_since = None
            self.idle_since = time.monotonic()
            self.recent_call_s = recent_mean(self.recent_call_s, self.idle_since - started)
        if len(outputs) != len(requests):
            raise EngineError(f"engine returned {len(outputs)} outputs for {len(requests)} requests")
        return outputs

    def _synthesize(self, requests: Sequence[SynthesisRequest], pieces: Sequence[Piece | None]) -> list[_Ran]:
        """Each request's output (or exception) with the size and duration of the engine call it rode in."""
        bucket = length_bucket(requests)
        fit = self.largest_fit.get(bucket)
        if fit is not None and len(requests) > fit:
            return [
                ran
                for start in range(0, len(requests), fit)
                for ran in self._synthesize(requests[start : start + fit], pieces[start : start + fit])
            ]
        started = time.perf_counter()
        try:
            outputs = self._call_engine(requests, pieces)
        except EngineOutOfMemory as exc:
            if len(requests) == 1:
                return [(exc, 1, time.perf_counter() - started, 0.0)]
        except Exception as exc:
            if len(requests) == 1:
                return [(exc, 1, time.perf_counter() - started, 0.0)]
            logger.warning("batch of %d failed (%s); retrying its items one by one", len(requests), type(exc).__name__)
            return [self._synthesize([request], [piece])[0] for request, piece in zip(requests, pieces, strict=True)]
        else:
            return self._account(outputs, time.perf_counter() - started)
        # Only a batch that ran out of device memory gets here. It is split outside the handler, so the
        # failed attempt (and whatever it still held) is released before the halves run.
        half = (len(requests) + 1) // 2
        # The size to try next for this length bucket; it only shrinks while this worker lives (a restart
        # starts over), since one more failure on the device costs more than a smaller batch.
        self.largest_fit[bucket] = min(half, self.largest_fit.get(bucket, half))
        self.oom_splits += 1
        self.observer.batch_split()
        logger.warning(
            "batch of %d ran out of device memory; splitting, and capping batches of texts up to %d characters at %d",
            len(requests),
            2**bucket,
            self.largest_fit[bucket],
        )
        return [*self._synthesize(requests[:half], pieces[:half]), *self._synthesize(requests[half:], pieces[half:])]

    def _account(self, outputs: list[EngineOutput | Exception], seconds: float) -> list[_Ran]:
        """Report one engine call and give each output its share of the call's time."""
        lengths = [audio_seconds(output) for output in outputs]
        audio_s = sum(lengths)
        truncated = sum(1 for output in outputs if not isinstance(output, Exception) and output.truncated)
        self.observer.batch_finished(
            BatchReport(size=len(outputs), seconds=seconds, audio_s=audio_s, truncated=truncated)
        )
        # Padding makes every row of a pass cost about as much as the longest, but a longer item holds
        # the device for more decode steps: generated length is the fairest split there is.
        return [
            (output, len(outputs), seconds, seconds * length / audio_s if audio_s > 0 else seconds / len(outputs))
            for output, length in zip(outputs, lengths, strict=True)
        ]


def _urgency(waiting: Waiting) -> tuple[int, float]:
    request = waiting.request
    return (1 if request.lane == "bulk" else 0, request.deadline if request.deadline is not None else math.inf)


def length_bucket(requests: Sequence[SynthesisRequest]) -> int:
    """Batches whose longest texts round up to the same power of two need about the same memory."""
    return max(len(request.text) for request in requests).bit_length()
