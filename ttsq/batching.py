"""The in-worker batcher: task threads hand it requests, one thread owns the engine.

Every job stays its own Celery task (its own result, events and Flower row); the batcher only decides
which of the jobs waiting in this worker share a forward pass. Jobs wait in groups that can share a
pass (``SynthesisRequest.group``: same mode, language, sampling). A group runs as soon as it holds
``max_batch`` jobs, or when its oldest job has waited ``max_wait_s``; mixed traffic therefore fills
each group's batch instead of splitting one collection into small passes. Each batch is ordered by
text length to limit padding.

A failed item fails only its own future. If the engine call itself raises, the batch is retried one
item at a time so that one poison item cannot fail its neighbours. If it raises ``EngineOutOfMemory``,
the batch is split in halves and each half retried, and the half's size is remembered for that length
bucket (longest text, rounded up to a power of two): later batches of similar texts are cut to that
size up front instead of failing on the device again. Each item reports the size and time of the
engine call it actually rode in.

A job submitted ``isolated`` (a redelivery whose earlier attempt never finished: perhaps the job that
killed the last worker) runs in a batch of its own, so that if it crashes the process again it takes
no neighbour with it. A job whose deadline passes while it waits is dropped before the engine sees it.

The batcher reports how long the current engine call has run (``busy_s``), so a watchdog can tell
a slow engine from a stuck one.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ttsq.engines.base import is_continuous
from ttsq.errors import DeadlineExceeded, EngineError, EngineOutOfMemory, SharedFailure, TTSQError

if TYPE_CHECKING:
    from ttsq.engines.base import ContinuousEngine, Engine, EngineOutput
    from ttsq.metrics import Metrics
    from ttsq.request import SynthesisRequest

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class _Waiting:
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


@dataclass(frozen=True)
class BatchItem:
    """One finished item: its audio and the batch it rode in."""

    output: EngineOutput
    batch_id: int
    batch_size: int
    synthesis_s: float
    #: This item's share of its engine call's time, apportioned by the audio length it generated.
    device_s: float = 0.0


class Batcher:
    """Collects requests from many threads into batches for one engine, on one thread.

    The batcher thread is the only thread that ever touches the engine: it loads and warms it, runs
    every batch and closes it. On a GPU that keeps the device context and streams on one thread.
    """

    def __init__(self, engine: Engine, *, max_batch: int, max_wait_s: float,
                 metrics: Metrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._batch_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._stop_seen = False  # batcher thread only, like _pending
        self._pending: dict[tuple[Any, ...], list[_Waiting]] = {}  # group -> jobs waiting, oldest first
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        #: Length bucket -> largest batch known to fit on the device, learnt from out-of-memory errors.
        self.largest_fit: dict[int, int] = {}
        self.oom_splits = 0
        self._thread = threading.Thread(target=self._main, name="ttsq-batcher", daemon=True)
        self._isolated_ids = itertools.count(1)
        self._busy_since: float | None = None  # monotonic start of the engine call now running
        # Continuous engines: device seconds charged so far to each job in the engine (by batch id),
        # and jobs to run again alone; ``done`` may fire on the engine's codec thread.
        self._charges: dict[int, list[float]] = {}
        self._retries: collections.deque[_Waiting] = collections.deque()
        self._charge_lock = threading.Lock()
        self._abandoned: collections.deque[Future[BatchItem]] = collections.deque()
        self._decoding: dict[Future[BatchItem], Callable[[Any], object]] = {}  # job -> its done, in the engine

    def start(self, timeout: float = 600.0) -> None:
        """Load and warm the engine on the batcher thread; return when it is ready, or raise."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise EngineError(f"engine did not load within {timeout:.0f}s")
        if self._load_error is not None:
            raise self._load_error

    def submit(self, request: SynthesisRequest, *, isolated: bool = False,
               on_enter: Callable[[], object] | None = None,
               on_exit: Callable[[], object] | None = None) -> Future[BatchItem]:
        """Queue one request; the future resolves when its batch is done.

        ``isolated`` runs it in a batch of its own. ``on_enter`` and ``on_exit`` are called on the
        batcher thread just before the engine runs it and once the engine call has returned (or
        raised); if they raise, the job runs anyway (they are bookkeeping).
        """
        future: Future[BatchItem] = Future()
        with self._lock:  # no request may slip in behind the stop marker
            if self._closed or not self._thread.is_alive():
                future.set_exception(EngineError("the batcher has stopped"))
            else:
                group = ("isolated", next(self._isolated_ids)) if isolated else request.group()
                # The deadline starts now: time spent queued behind a running batch counts.
                self._queue.put(_Waiting(request, future, time.monotonic() + self.max_wait_s, group,
                                         on_enter, on_exit))
        return future

    def abandon(self, future: Future[BatchItem]) -> None:
        """The caller gave up on this job (it timed out). A job still waiting is cancelled; a job a
        continuous engine is decoding leaves it at the next frame, freeing its slot; a batch engine's
        job finishes with its batch. Thread-safe."""
        if not future.cancel() and not future.done() and is_continuous(self.engine):
            self._abandoned.append(future)

    def busy_s(self) -> float:
        """How long the engine call now running has taken (0 when the engine is idle)."""
        since = self._busy_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def alive(self) -> bool:
        """Whether the batcher thread runs (it ends only when stopped, or on a bug)."""
        return self._thread.is_alive()

    def stop(self, timeout: float = 60.0) -> bool:
        """Finish what is queued, close the engine, end the thread; False if it is still busy."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("batcher still running after %.0fs; leaving the engine to the process exit", timeout)
            return False
        return True

    def _main(self) -> None:
        try:
            self.engine.load()
            self.engine.warmup()
        except BaseException as exc:
            self._load_error = exc
            self._closed = True
            self._ready.set()
            return
        self._ready.set()
        try:
            if is_continuous(self.engine):
                self._continuous_loop()
            else:
                self._loop()
        finally:
            with self._lock:
                self._closed = True  # whatever ended the loop, refuse new work from now on
            try:
                self.engine.close()
            finally:
                self._fail_leftovers()

    def _fail_leftovers(self) -> None:
        waiting = [w.future for group in self._pending.values() for w in group]
        waiting += [w.future for w in self._take_retries()]
        self._pending.clear()
        for future in waiting:
            if _claim(future):
                future.set_exception(EngineError("the batcher stopped before this job ran"))
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP and item.future.set_running_or_notify_cancel():
                item.future.set_exception(EngineError("the batcher stopped before this job ran"))

    def _next_batch(self) -> list[_Waiting] | None:
        """Wait for the next batch to be due: a group that is full, or whose oldest job has waited
        ``max_wait_s``. Returns None once stopped and drained."""
        pending = self._pending
        while True:
            # Everything that arrived while the last batch ran joins its group before any choice.
            self._drain(block_until=None)
            full = next((key for key, group in pending.items() if len(group) >= self.max_batch), None)
            if full is not None:
                return self._take(full)
            if self._stop_seen:  # run what is pending, then end
                return self._take(next(iter(pending))) if pending else None
            due = min(pending, key=lambda key: pending[key][0].deadline, default=None)
            if due is not None and pending[due][0].deadline <= time.monotonic():
                return self._take(due)
            self._drain(block_until=pending[due][0].deadline if due is not None else float("inf"))

    def _drain(self, *, block_until: float | None) -> None:
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
            if item is _STOP:
                self._stop_seen = True
                return
            try:
                self._pending.setdefault(item.group, []).append(item)
            except Exception as exc:  # a request that cannot even be grouped fails alone
                if item.future.set_running_or_notify_cancel():
                    item.future.set_exception(EngineError(f"cannot batch this request: {exc!r}"))
            if block_until is not None:
                return

    def _take(self, key: tuple[Any, ...]) -> list[_Waiting]:
        group = self._pending.pop(key)
        if len(group) > self.max_batch:
            self._pending[key] = group[self.max_batch:]
        # A future cancelled while waiting, or a job past its deadline, is dropped here, before any
        # work is done for it.
        now = time.time()
        batch = []
        for waiting in group[:self.max_batch]:
            if not waiting.future.set_running_or_notify_cancel():
                continue
            if waiting.request.expired(now):
                waiting.future.set_exception(DeadlineExceeded(_late(waiting.request, now)))
                continue
            batch.append(waiting)
        return batch

    def _loop(self) -> None:
        while (batch := self._next_batch()) is not None:
            if not batch:
                continue
            _bookkeep([w.on_enter for w in batch])
            group = sorted(((w.request, w.future) for w in batch), key=lambda pair: len(pair[0].text))
            try:
                self._run_group(group)
            except BaseException as exc:  # never let the thread die with futures unresolved
                logger.exception("batcher failed outside the engine")
                for _, future in group:
                    if not future.done():
                        future.set_exception(EngineError(f"batcher failure: {exc!r}"))
            finally:
                _bookkeep([w.on_exit for w in batch])

    # -- continuous batching ----------------------------------------------------------------------

    def _continuous_loop(self) -> None:
        """Feed a ``ContinuousEngine``: every job joins as soon as a slot is free (at the next frame),
        in arrival order, and leaves when it is done; no job waits for a batch to fill or to finish.

        An isolated job runs alone: it waits for the slots to empty, and nothing joins beside it until
        its ``done`` has fired (its codec decode included). A job that failed with ``SharedFailure``
        (a frame failed for every row in it) runs again, once, isolated: only the culprit fails.

        Device time: each ``step`` is timed and split evenly between the jobs in the engine (admitted,
        not yet answered), each ``admit`` is charged to its own job, so the jobs' shares add up to the
        engine's busy time.
        """
        engine: ContinuousEngine = self.engine  # type: ignore[assignment]
        waiting: list[_Waiting] = []
        alone: Future[BatchItem] | None = None  # the isolated job decoding, until it is answered
        try:
            while True:
                waiting.extend(self._take_retries())
                idle = not engine.active and not waiting
                if idle and self._stop_seen and not self._pending:
                    return
                self._drain(block_until=float("inf") if idle and not self._stop_seen else None)
                if self._pending or waiting:  # arrival order across groups: groups only matter to batch engines
                    waiting.extend(w for group in self._pending.values() for w in group)
                    self._pending.clear()
                    waiting.sort(key=lambda w: w.deadline)
                if alone is not None and alone.done():
                    alone = None
                while waiting and alone is None and engine.free_slots() > 0:
                    isolated = waiting[0].group[0] == "isolated"
                    if isolated and (engine.active or self._charges):
                        break  # it starts once the slots have emptied and their jobs are answered
                    job = waiting.pop(0)
                    self._admit(engine, job)
                    if isolated and not job.future.done():
                        alone = job.future
                self._drop_abandoned(engine)
                if engine.active:
                    self._step(engine)
                elif waiting:  # jobs wait for a codec decode to answer the isolated job or its elders
                    self._drain(block_until=time.monotonic() + 0.01)
        finally:  # whatever ends the loop, no job it holds is lost: _fail_leftovers answers these
            for job in [*waiting, *self._take_retries()]:
                self._pending.setdefault(job.group, []).append(job)

    def _drop_abandoned(self, engine: ContinuousEngine) -> None:
        while self._abandoned:
            done = self._decoding.get(self._abandoned.popleft())
            if done is not None and engine.cancel(done):
                logger.info("a job its caller gave up on left the engine")

    def _step(self, engine: ContinuousEngine) -> None:
        """One frame, its time split between the jobs in the engine."""
        with self._charge_lock:
            charges = list(self._charges.values())
        self._busy_since = time.monotonic()
        started = time.perf_counter()
        try:
            engine.step()
        except Exception:  # the engine fails its own rows; the loop goes on
            logger.exception("continuous engine step failed")
        finally:
            self._busy_since = None
            share = (time.perf_counter() - started) / max(1, len(charges))
            for charge in charges:
                charge[0] += share

    def _take_retries(self) -> list[_Waiting]:
        retries = []
        while self._retries:
            retries.append(self._retries.popleft())
        return retries

    def _admit(self, engine: ContinuousEngine, waiting: _Waiting) -> None:
        """Start one job in the engine, or drop it if it was cancelled or its deadline has passed."""
        if not _claim(waiting.future):
            return
        now = time.time()
        if waiting.request.expired(now):
            waiting.future.set_exception(DeadlineExceeded(_late(waiting.request, now)))
            return
        _bookkeep([waiting.on_enter])
        batch_id = next(self._batch_ids)
        started = time.perf_counter()
        rows = engine.active + 1
        charge = [0.0]  # device seconds charged to this job (its admit, its share of every step)
        with self._charge_lock:
            self._charges[batch_id] = charge

        def done(output: EngineOutput | Exception) -> None:
            with self._charge_lock:
                self._charges.pop(batch_id, None)
                self._decoding.pop(waiting.future, None)
            seconds = time.perf_counter() - started
            if isinstance(output, SharedFailure) and waiting.group[0] != "isolated":
                # Perhaps a neighbour's fault: run it again, alone (the loop picks it up; thread-safe).
                _bookkeep([waiting.on_exit])
                self._retries.append(replace(waiting, group=("isolated", next(self._isolated_ids))))
                return
            if isinstance(output, Exception):
                waiting.future.set_exception(output if isinstance(output, TTSQError) else EngineError(repr(output)))
            else:
                if self.metrics is not None:
                    self.metrics.observe_batch(size=rows, seconds=charge[0], audio_s=_audio_seconds(output),
                                               truncated=int(output.truncated))
                waiting.future.set_result(BatchItem(output, batch_id, rows, seconds, charge[0]))
            _bookkeep([waiting.on_exit])

        with self._charge_lock:
            self._decoding[waiting.future] = done
        self._busy_since = time.monotonic()
        try:
            engine.admit(waiting.request, done)
        except BaseException as exc:  # admit reports failures through done; this is a bug, failing one job
            logger.exception("continuous engine admit failed")
            if not waiting.future.done():  # even if the loop ends with it: this job is no longer waiting
                done(EngineError(f"cannot start this job: {exc!r}"))
            if not isinstance(exc, Exception):
                raise
        finally:
            self._busy_since = None
            charge[0] += time.perf_counter() - started

    def _run_group(self, group: list[tuple[SynthesisRequest, Future[BatchItem]]]) -> None:
        batch_id = next(self._batch_ids)
        requests = [request for request, _ in group]
        started = time.perf_counter()
        results = self._synthesize(requests)
        elapsed = time.perf_counter() - started
        failed = 0
        for (_, future), (output, size, seconds, share) in zip(group, results, strict=True):
            if isinstance(output, Exception):
                failed += 1
                future.set_exception(output if isinstance(output, TTSQError) else EngineError(repr(output)))
            else:
                future.set_result(BatchItem(output, batch_id, size, seconds, share))
        logger.info("batch %d: %d items (%d failed) in %.3fs, %s", batch_id, len(group), failed, elapsed,
                    requests[0].describe().split(" chars=")[0])

    def _call_engine(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        """One engine call, timed for the watchdog (``busy_s``)."""
        self._busy_since = time.monotonic()
        try:
            outputs = self.engine.synthesize_batch(requests)
        finally:
            self._busy_since = None
        if len(outputs) != len(requests):
            raise EngineError(f"engine returned {len(outputs)} outputs for {len(requests)} requests")
        return outputs

    def _synthesize(self, requests: Sequence[SynthesisRequest]) -> list[_Ran]:
        """Each request's output (or exception) with the size and duration of the engine call it rode in."""
        bucket = length_bucket(requests)
        fit = self.largest_fit.get(bucket)
        if fit is not None and len(requests) > fit:
            return [ran for start in range(0, len(requests), fit)
                    for ran in self._synthesize(requests[start:start + fit])]
        started = time.perf_counter()
        try:
            outputs = self._call_engine(requests)
        except EngineOutOfMemory as exc:
            if len(requests) == 1:
                return [(exc, 1, time.perf_counter() - started, 0.0)]
        except Exception as exc:
            if len(requests) == 1:
                return [(exc, 1, time.perf_counter() - started, 0.0)]
            logger.warning("batch of %d failed (%s); retrying its items one by one",
                           len(requests), type(exc).__name__)
            return [self._synthesize([request])[0] for request in requests]
        else:
            seconds = time.perf_counter() - started
            return self._account(outputs, seconds)
        # Only a batch that ran out of device memory gets here. It is split outside the handler, so the
        # failed attempt (and whatever it still held) is released before the halves run.
        half = (len(requests) + 1) // 2
        # The size to try next for this length bucket; it only shrinks while this worker lives (a restart
        # starts over), since one more failure on the device costs more than a smaller batch.
        self.largest_fit[bucket] = min(half, self.largest_fit.get(bucket, half))
        self.oom_splits += 1
        if self.metrics is not None:
            self.metrics.record_oom_split()
        logger.warning("batch of %d ran out of device memory; splitting, and capping batches of texts "
                       "up to %d characters at %d", len(requests), 2 ** bucket, self.largest_fit[bucket])
        return [*self._synthesize(requests[:half]), *self._synthesize(requests[half:])]


    def _account(self, outputs: list[EngineOutput | Exception], seconds: float) -> list[_Ran]:
        """Record one engine call in the metrics and give each output its share of the call's time."""
        lengths = [_audio_seconds(output) for output in outputs]
        audio_s = sum(lengths)
        if self.metrics is not None:
            truncated = sum(1 for output in outputs if not isinstance(output, Exception) and output.truncated)
            self.metrics.observe_batch(size=len(outputs), seconds=seconds, audio_s=audio_s, truncated=truncated)
        # Padding makes every row of a pass cost about as much as the longest, but a longer item holds
        # the device for more decode steps: generated length is the fairest split there is.
        return [(output, len(outputs), seconds,
                 seconds * length / audio_s if audio_s > 0 else seconds / len(outputs))
                for output, length in zip(outputs, lengths, strict=True)]


#: An output or exception, the size of the engine call it came from, that call's seconds, and this
#: output's share of them (apportioned by generated audio length).
_Ran = tuple["EngineOutput | Exception", int, float, float]


def _bookkeep(calls: list[Callable[[], object] | None]) -> None:
    for call in calls:
        if call is not None:
            try:
                call()
            except Exception as exc:
                logger.warning("could not record an attempt (%s); running the job anyway", exc)


def _claim(future: Future[BatchItem]) -> bool:
    """Whether the batcher may resolve this future now: it was waiting (and is now running), or it is
    running already (a job queued again after a ``SharedFailure``). False if cancelled or resolved."""
    if future.done():
        return False
    return future.running() or future.set_running_or_notify_cancel()


def _late(request: SynthesisRequest, now: float) -> str:
    return f"deadline passed {now - (request.deadline or now):.1f}s before synthesis; the job was dropped"


def length_bucket(requests: Sequence[SynthesisRequest]) -> int:
    """Batches whose longest texts round up to the same power of two need about the same memory."""
    return max(len(request.text) for request in requests).bit_length()


def _audio_seconds(output: EngineOutput | Exception) -> float:
    """Seconds of audio an engine output holds (0 for a failed item)."""
    if isinstance(output, Exception) or output.sample_rate <= 0:
        return 0.0
    return float(len(output.samples)) / output.sample_rate
