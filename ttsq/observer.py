"""Hooks around a job's life on a worker: what metrics, fleet statistics and counters listen to.

The job path itself (``WorkerRuntime``, the batcher) only reports what happened, once, to one
``Observer``; everything that counts or exports it hangs off these hooks, the way dramatiq's
middleware does (``before_process_message`` / ``after_process_message``). ``Observers`` fans one
report out to several, and an observer that fails is logged and skipped: watching a job must never
fail it.

Hooks, in the order a job meets them: ``message_refused`` or ``duplicate_dropped`` (the envelope gate,
for a message that never becomes a job) → ``job_started`` → ``cache_checked`` → (``job_parked``) →
``batch_finished`` / ``batch_split`` (from the batcher thread, once per engine call), ``first_audio``
(a streaming job's first piece written) →
``job_finished`` (always, however the job ended); ``job_recovered`` from the sweeper, for a job whose
message was lost and is sent again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ttsq.job import JobResult

logger = logging.getLogger(__name__)

#: How a job left the worker: a fixed vocabulary (it labels metrics).
OUTCOMES = ("synthesized", "cached", "invalid", "failed", "timeout", "cancelled")


@dataclass(frozen=True)
class JobReport:
    """One job, finished: how it ended and what it made."""

    task_id: str
    #: One of ``OUTCOMES``.
    outcome: str
    #: Producer send to worker start; None when the message carried no send time.
    queue_wait_s: float | None = None
    #: The result, for a job that succeeded.
    result: JobResult | None = None
    #: Whether this run stored a new object (False for a cache hit, or an object an earlier run stored).
    written: bool = False
    #: The job's lane (from its kwargs, "interactive" unless they say bulk) and tenant ("" when its
    #: request did not validate, or named none).
    lane: str = "interactive"
    tenant: str = ""


@dataclass(frozen=True)
class BatchReport:
    """One engine call (for a continuous engine: one job's share of the frames it decoded in)."""

    size: int
    seconds: float
    audio_s: float
    truncated: int


class Observer:
    """Every hook does nothing here; an observer overrides the ones it needs. Hooks may be called from
    any task thread and from the batcher thread: implementations are thread-safe."""

    def message_refused(self, reason: str) -> None:
        """The envelope gate refused a message (one of ``ttsq.delivery.envelope.REASONS``) and dead-lettered it."""

    def duplicate_dropped(self) -> None:
        """The gate dropped a second copy of a job a worker had already received."""

    def job_recovered(self) -> None:
        """The sweeper sent a lost job again."""

    def jobs_requeued(self, count: int) -> None:
        """``count`` messages a dead worker process held went back to their queue (``ttsq.worker.recovery``)."""

    def job_started(self, task_id: str) -> None:
        """A task thread took the job up."""

    def cache_checked(self, *, hit: bool) -> None:
        """The worker's cache re-check found (or did not find) the audio."""

    def job_parked(self, task_id: str) -> None:
        """The job entered the engine too often without finishing and was parked."""

    def batch_finished(self, report: BatchReport) -> None:
        """An engine call returned."""

    def batch_split(self) -> None:
        """A batch ran out of device memory and was split in halves."""

    def first_audio(self, seconds: float) -> None:
        """A streaming job's first audio reached its stream, ``seconds`` after its producer sent it."""

    def job_finished(self, report: JobReport) -> None:
        """The job left the worker, with its outcome."""


class Observers(Observer):
    """Several observers as one. A hook that raises is logged and the others still run."""

    def __init__(self, observers: Sequence[Observer]) -> None:
        self.observers = list(observers)

    def _each(self, hook: str, *args: object, **kwargs: object) -> None:
        for observer in self.observers:
            try:
                getattr(observer, hook)(*args, **kwargs)
            except Exception as exc:
                logger.warning("%s.%s failed: %s", type(observer).__name__, hook, type(exc).__name__)

    def message_refused(self, reason: str) -> None:
        self._each("message_refused", reason)

    def duplicate_dropped(self) -> None:
        self._each("duplicate_dropped")

    def job_recovered(self) -> None:
        self._each("job_recovered")

    def jobs_requeued(self, count: int) -> None:
        self._each("jobs_requeued", count)

    def job_started(self, task_id: str) -> None:
        self._each("job_started", task_id)

    def cache_checked(self, *, hit: bool) -> None:
        self._each("cache_checked", hit=hit)

    def job_parked(self, task_id: str) -> None:
        self._each("job_parked", task_id)

    def batch_finished(self, report: BatchReport) -> None:
        self._each("batch_finished", report)

    def batch_split(self) -> None:
        self._each("batch_split")

    def first_audio(self, seconds: float) -> None:
        self._each("first_audio", seconds)

    def job_finished(self, report: JobReport) -> None:
        self._each("job_finished", report)
