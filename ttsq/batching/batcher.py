"""The in-worker batcher: task threads hand it requests, one thread owns the engine.

Every job stays its own Celery task; the batcher only decides which of the jobs waiting in this worker
share the engine, with one of two schedulers (``ttsq.batching.batches`` for grouped batches,
``ttsq.batching.slots`` for a ``ContinuousEngine``), both on the job bookkeeping of
``ttsq.batching.jobs``. This module holds the batcher thread's life, the choice of scheduler and the
answer for every job it still holds when it ends. Isolated jobs, deadlines and both schedulers:
docs/development.md, "The batcher".
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import ttsq.tracing as tracing
from ttsq.batching.batches import BatchScheduler, Downstream
from ttsq.batching.jobs import STOP, BatchItem, Expected, Intake, Scheduler, Waiting
from ttsq.batching.slots import SlotScheduler
from ttsq.engines.base import is_continuous
from ttsq.errors import EngineError
from ttsq.observer import Observer

if TYPE_CHECKING:
    from ttsq.engines.base import Engine, Piece
    from ttsq.job import SynthesisRequest

__all__ = ["BatchItem", "Batcher"]

logger = logging.getLogger(__name__)


class Batcher:
    """Collects requests from many threads for one engine, on one thread.

    The batcher thread is the only thread that ever touches the engine: it loads and warms it, runs
    every call and closes it. On a GPU that keeps the device context and streams on one thread.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch: int,
        max_wait_s: float,
        observer: Observer | None = None,
        backlog: Callable[[], int] | None = None,
        downstream: Downstream | None = None,
    ) -> None:
        """``backlog``: how many jobs wait in the broker for this worker (a batch that is not full may
        wait for them); ``downstream``: how many seconds the stage after the engine (the worker's
        encoders) is already busy for a batch of these requests (a batch whose audio would only queue
        there waits for company instead). Both are called on the batcher thread, must answer fast and
        never raise."""
        self.backlog = backlog
        self.downstream = downstream
        self.engine = engine
        self.observer = observer or Observer()
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self.intake = Intake()
        self.scheduler: Scheduler = self._scheduler()
        self._lock = threading.Lock()
        self._closed = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ttsq-batcher", daemon=True)

    def _scheduler(self) -> Scheduler:
        if is_continuous(self.engine):
            return SlotScheduler(
                self.engine,  # type: ignore[arg-type]
                self.intake,
                self.observer,
                max_wait_s=self.max_wait_s,
                backlog=self.backlog,
            )
        return BatchScheduler(
            self.engine,
            self.intake,
            self.observer,
            max_batch=self.max_batch,
            max_wait_s=self.max_wait_s,
            backlog=self.backlog,
            downstream=self.downstream,
        )

    def start(self, timeout: float = 600.0) -> None:
        """Load and warm the engine on the batcher thread; return when it is ready, or raise."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise EngineError(f"engine did not load within {timeout:.0f}s")
        if self._load_error is not None:
            raise self._load_error

    def submit(
        self,
        request: SynthesisRequest,
        *,
        isolated: bool = False,
        on_enter: Callable[[], object] | None = None,
        on_exit: Callable[[], object] | None = None,
        on_piece: Piece | None = None,
    ) -> Future[BatchItem]:
        """Queue one request; the future resolves when its batch is done.

        ``isolated`` runs it alone. ``on_enter`` and ``on_exit`` are called on the batcher thread just
        before the engine runs it and once the engine call has returned (or raised); if they raise,
        the job runs anyway (they are bookkeeping). ``on_piece`` gets a streaming job's audio while an
        engine that streams (``ttsq.engines.base.streams_audio``) makes it.
        """
        future: Future[BatchItem] = Future()
        with self._lock:  # no request may slip in behind the stop marker
            if self._closed or not self._thread.is_alive():
                future.set_exception(EngineError("the batcher has stopped"))
            else:
                group = self.intake.isolated_group() if isolated else request.group()
                # The deadline starts now: time spent queued behind a running batch counts.
                now = time.monotonic()
                # With the submitting task thread's span: the batcher thread links to it, never attaches it.
                trace = tracing.current()
                self.intake.put(
                    Waiting(request, future, now + self.max_wait_s, group, on_enter, on_exit, now, on_piece, trace)
                )
        return future

    def expect(self) -> Expected:
        """Say that a job is on its way (a task thread took it from the queue and is checking it):
        a batch that is not full may wait for it. Call ``done`` on the handle once the job is
        submitted, or has left without being; thread-safe."""
        return self.intake.incoming.expect()

    def abandon(self, future: Future[BatchItem]) -> None:
        """The caller gave up on this job (it timed out). A job still waiting is cancelled; a job a
        continuous engine is decoding leaves it at the next frame, freeing its slot; a batch engine's
        job finishes with its batch. Thread-safe."""
        if not future.cancel() and not future.done():
            self.scheduler.abandon(future)

    def busy_s(self) -> float:
        """How long the engine call now running has taken (0 when the engine is idle)."""
        since = self.scheduler.busy_since
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
                self.intake.put(STOP)
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
            self.scheduler.run()
        finally:
            with self._lock:
                self._closed = True  # whatever ended the loop, refuse new work from now on
            try:
                self.engine.close()
            finally:
                self.intake.fail_all("the batcher stopped before this job ran")
