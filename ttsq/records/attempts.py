"""The ledger of attempts: per job, the engine calls that never returned, and the jobs parked.

A job whose input crashes or hangs the engine kills its worker, is redelivered after the visibility
timeout, and would kill the next worker too, forever. The ledger stops the cycle. The batcher
charges an attempt to each job of a batch just before the engine call and refunds it when the call
returns, so what remains charged counts the calls that died with the process. A delivery that finds
``max_attempts`` charged fails the job with ``JobParked`` and keeps it here, where ``ttsq failed``
lists it and ``ttsq retry ID`` sends it again.

So deliveries are counted only where they can point at the culprit: a job that merely waited in
the queue of a worker that died, or that finished its synthesis before the crash, is not a
suspect. Attempts live in the job's one record in the cache Redis (``ttsq.records.accepted``, the field
``attempts``, written by ``lua/attempt.lua``): they go when the job finishes. Parked jobs are kept apart,
for as long as an operator has not sent them again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ttsq.constants import ACCEPTED_PREFIX, PARKED_KEY, STITCH_TASK_NAME, TASK_NAME
from ttsq.errors import CorruptRecord
from ttsq.records.connection import address, patiently
from ttsq.records.scripts import register

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParkedJob:
    """A job failed after too many attempts, kept with its request so it can be sent again."""

    id: str
    queue: str
    kwargs: dict[str, Any]
    attempts: int
    error: str
    parked_at: float
    #: The task to send again: a job (``ttsq.synthesize``) or a document's stitch (``ttsq.stitch``).
    task: str = TASK_NAME

    def summary(self) -> dict[str, Any]:
        """What an operator sees: never the input text."""
        text = self.kwargs.get("text")
        return {
            "id": self.id,
            "queue": self.queue,
            "attempts": self.attempts,
            "error": self.error,
            "parked_at": self.parked_at,
            "chars": len(text) if isinstance(text, str) else None,
            "language": self.kwargs.get("language", "auto"),
        }


class Ledger:
    """Attempt counters and parked jobs, in one Redis database."""

    def __init__(self, client: redis.Redis, *, ttl_s: int, patience_s: float = 0.0) -> None:
        self.url = address(client)
        self.ttl_s = ttl_s
        self.patience_s = patience_s
        self._redis = client
        self._attempt = register(client, "attempt")
        self._lock = threading.Lock()
        #: Refunds the batcher handed over (``refund_soon``), written by ``_refunder`` or by the next charge.
        self._refunds: list[str] = []
        #: Held while refunds taken from the list are being written: a charge waits for them.
        self._writing = threading.Lock()
        self._wake = threading.Event()
        self._refunder: threading.Thread | None = None

    def attempts(self, task_id: str) -> int:
        """Engine calls with this job in them that never returned."""
        key = ACCEPTED_PREFIX + task_id
        return int(patiently(lambda: self._redis.hget(key, "attempts"), self.url, self.patience_s) or 0)

    def charge(self, task_id: str) -> int:
        """Count one more attempt (called just before the engine runs the job); return the total.

        The refunds handed over before it (``refund_soon``) are written first, in the same round trip:
        an engine call that kills its worker must not find a job whose call returned before it still
        charged. Left to the refund thread, a job that ran alone and returned, then lost its worker
        (and its upload) to the next job's crash, came back with that attempt counted and was parked."""
        with self._writing:
            with self._lock:
                refunds, self._refunds = self._refunds, []

            def incr() -> int:
                pipe = self._redis.pipeline()
                self._queue(pipe, refunds, -1)
                self._queue(pipe, [task_id], +1)
                return int(pipe.execute()[-1])

            try:
                return patiently(incr, self.url, self.patience_s)
            except BaseException:
                with self._lock:  # not written: the refund thread tries them again
                    self._refunds[:0] = refunds
                raise

    def refund(self, task_id: str) -> None:
        """The engine call returned: this attempt does not count against the job."""
        key = ACCEPTED_PREFIX + task_id
        patiently(lambda: self._attempt(keys=[key], args=[-1, self.ttl_s]), self.url, self.patience_s)

    def refund_soon(self, task_id: str) -> None:
        """``refund``, written by a thread of the ledger's own within milliseconds, several in one round
        trip: the batcher's thread, which calls this as an engine call returns, goes straight back to the
        engine instead of waiting on Redis (and on the interpreter lock behind busy task threads). The
        next charge writes whatever is still pending first, so an engine call never starts with a
        returned job still charged; only a worker killed from outside in those milliseconds leaves the
        attempt charged, as if it had died a moment earlier, inside the call."""
        with self._lock:
            self._refunds.append(task_id)
            if self._refunder is None:
                self._refunder = threading.Thread(target=self._refund_pending, name="ttsq-refunds", daemon=True)
                self._refunder.start()
        self._wake.set()

    def flush_refunds(self) -> None:
        """Write the refunds handed over and not yet written (a worker stopping cleanly)."""
        with self._writing:
            with self._lock:
                task_ids, self._refunds = self._refunds, []
            if not task_ids:
                return

            def decr() -> None:
                pipe = self._redis.pipeline(transaction=False)
                self._queue(pipe, task_ids, -1)
                pipe.execute()

            try:
                patiently(decr, self.url, self.patience_s)
            except Exception as exc:  # bookkeeping: the jobs ran; an attempt left charged only isolates a rerun
                logger.warning("could not refund %d attempt(s): %s", len(task_ids), type(exc).__name__)

    def _queue(self, pipe: Any, task_ids: list[str], delta: int) -> None:
        """Queue on ``pipe`` one charge (``delta`` +1) or refund (-1) per task id."""
        for task_id in task_ids:
            self._attempt(keys=[ACCEPTED_PREFIX + task_id], args=[delta, self.ttl_s], client=pipe)

    def _refund_pending(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            self.flush_refunds()

    def park(self, job: ParkedJob) -> None:
        """Keep a failed job for an operator."""
        record = json.dumps(
            {
                "queue": job.queue,
                "kwargs": job.kwargs,
                "attempts": job.attempts,
                "error": job.error,
                "parked_at": job.parked_at,
                "task": job.task,
            }
        )
        patiently(lambda: self._redis.hset(PARKED_KEY, job.id, record), self.url, self.patience_s)

    def parked(self) -> list[ParkedJob]:
        """Every parked job, oldest first."""
        raw = patiently(lambda: self._redis.hgetall(PARKED_KEY), self.url, self.patience_s)
        jobs = [_parked(str(task_id), str(record)) for task_id, record in raw.items()]
        return sorted(jobs, key=lambda job: job.parked_at)

    def unpark(self, task_id: str) -> ParkedJob | None:
        """Take a job out of the parked set and clear its attempts (before it is sent again)."""

        def take() -> str | None:
            pipe = self._redis.pipeline()
            pipe.hget(PARKED_KEY, task_id)
            pipe.hdel(PARKED_KEY, task_id)
            pipe.hdel(ACCEPTED_PREFIX + task_id, "attempts")
            record: str | None = pipe.execute()[0]
            return record

        record = patiently(take, self.url, self.patience_s)
        return None if record is None else _parked(task_id, record)


def _parked(task_id: str, record: str) -> ParkedJob:
    data = json.loads(record)
    task = data.get("task", TASK_NAME)  # records from before stitches could be parked name no task
    if task not in (TASK_NAME, STITCH_TASK_NAME):
        raise CorruptRecord("parked.task", f"of job {task_id[:80]} is not a task ttsq parks")
    return ParkedJob(
        id=task_id,
        queue=data["queue"],
        kwargs=data["kwargs"],
        attempts=int(data["attempts"]),
        error=data["error"],
        parked_at=float(data.get("parked_at", time.time())),
        task=task,
    )
