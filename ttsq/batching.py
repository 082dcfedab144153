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
    """Collects requests from many threads into batches for one engine."""

    def __init__(self, engine: Engine, *, max_batch: int, max_wait_s: float) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_wait_s = max_wait_s
        self._queue: queue.Queue[Any] = queue.Queue()
        self._batch_ids = itertools.count(1)
        self._thread = threading.Thread(target=self._loop, name="ttsq-batcher", daemon=True)
        self._thread.start()

    def submit(self, request: SynthesisRequest) -> Future[BatchItem]:
        """Queue one request; the future resolves when its batch is done."""
        future: Future[BatchItem] = Future()
        if not self._thread.is_alive():
            future.set_exception(EngineError("the batcher has stopped"))
            return future
        self._queue.put((request, future))
        return future

    def stop(self, timeout: float = 30.0) -> None:
        """Finish what is queued, then end the thread."""
        self._queue.put(_STOP)
        self._thread.join(timeout)

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
