"""The in-worker batcher: task threads hand it requests, one thread owns the engine.

Every job stays its own Celery task (its own result, events and Flower row); the batcher only decides
which of the jobs waiting in this worker share a forward pass. It takes the first request, then waits
at most ``max_wait_s`` for more, up to ``max_batch``; splits what it collected into groups that can
share a pass (``SynthesisRequest.group``), orders each group by text length to limit padding, and
runs each group as one engine call.

A failed item fails only its own future. If the engine call itself raises, the batch is retried one
item at a time so that one poison item cannot fail its neighbours.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ttsq.errors import EngineError, TTSQError

if TYPE_CHECKING:
    from ttsq.engines.base import Engine, EngineOutput
    from ttsq.request import SynthesisRequest

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True)
class BatchItem:
    """One finished item: its audio and the batch it rode in."""

    output: EngineOutput
    batch_id: int
    batch_size: int
    synthesis_s: float


class Batcher:
    """Collects requests from many threads into batches for one engine, on one thread.

    The batcher thread is the only thread that ever touches the engine: it loads and warms it, runs
    every batch and closes it. On a GPU that keeps the device context and streams on one thread.
    """

    def __init__(self, engine: Engine, *, max_batch: int, max_wait_s: float) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._batch_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="ttsq-batcher", daemon=True)

    def start(self, timeout: float = 600.0) -> None:
        """Load and warm the engine on the batcher thread; return when it is ready, or raise."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise EngineError(f"engine did not load within {timeout:.0f}s")
        if self._load_error is not None:
            raise self._load_error

    def submit(self, request: SynthesisRequest) -> Future[BatchItem]:
        """Queue one request; the future resolves when its batch is done."""
        future: Future[BatchItem] = Future()
        with self._lock:  # no request may slip in behind the stop marker
            if self._closed or not self._thread.is_alive():
                future.set_exception(EngineError("the batcher has stopped"))
            else:
                self._queue.put((request, future))
        return future

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
            self._loop()
        finally:
            with self._lock:
                self._closed = True  # whatever ended the loop, refuse new work from now on
            try:
                self.engine.close()
            finally:
                self._fail_leftovers()

    def _fail_leftovers(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP and item[1].set_running_or_notify_cancel():
                item[1].set_exception(EngineError("the batcher stopped before this job ran"))

    def _collect(self) -> tuple[list[tuple[SynthesisRequest, Future[BatchItem]]], bool]:
        first = self._queue.get()
        if first is _STOP:
            return [], True
        items = [first]
        stopping = False
        deadline = time.monotonic() + self.max_wait_s
        while len(items) < self.max_batch:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stopping = True
                break
            items.append(item)
        # A future cancelled while waiting is dropped here, before any work is done for it.
        return [(r, f) for r, f in items if f.set_running_or_notify_cancel()], stopping

    def _loop(self) -> None:
        while True:
            items, stopping = self._collect()
            groups: dict[tuple[Any, ...], list[tuple[SynthesisRequest, Future[BatchItem]]]] = defaultdict(list)
            for request, future in items:
                groups[request.group()].append((request, future))
            for group in groups.values():
                group.sort(key=lambda pair: len(pair[0].text))
                try:
                    self._run_group(group)
                except BaseException as exc:  # never let the thread die with futures unresolved
                    logger.exception("batcher failed outside the engine")
                    for _, future in group:
                        if not future.done():
                            future.set_exception(EngineError(f"batcher failure: {exc!r}"))
            if stopping:
                return

    def _run_group(self, group: list[tuple[SynthesisRequest, Future[BatchItem]]]) -> None:
        batch_id = next(self._batch_ids)
        requests = [request for request, _ in group]
        started = time.perf_counter()
        outputs = self._synthesize(requests)
        elapsed = time.perf_counter() - started
        failed = 0
        for (_, future), output in zip(group, outputs, strict=True):
            if isinstance(output, Exception):
                failed += 1
                future.set_exception(output if isinstance(output, TTSQError) else EngineError(repr(output)))
            else:
                future.set_result(BatchItem(output, batch_id, len(group), elapsed))
        logger.info("batch %d: %d items (%d failed) in %.3fs, %s", batch_id, len(group), failed, elapsed,
                    requests[0].describe().split(" chars=")[0])

    def _synthesize(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        try:
            outputs = self.engine.synthesize_batch(requests)
            if len(outputs) != len(requests):
                raise EngineError(f"engine returned {len(outputs)} outputs for {len(requests)} requests")
            return outputs
        except Exception as exc:
            if len(requests) == 1:
                return [exc]
            logger.warning("batch of %d failed (%s); retrying its items one by one",
                           len(requests), type(exc).__name__)
            return [self._synthesize([request])[0] for request in requests]
