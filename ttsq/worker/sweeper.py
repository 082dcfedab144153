"""The sweeper: a job whose message was lost between the broker and a worker is sent again.

One worker of a deployment at a time runs it. Every second it reads the accepted-job ledger
(``ttsq.records.accepted``) and sends again, under the same task id, through ``ttsq.sending``, a job no
worker received although its queue moved past it, and a received job that made no progress for a
visibility timeout (a document: for two graces). When a job counts as lost, and why a rerun is safe:
docs/guarantees.md, "Lost jobs".

A document is received once and then waits for its chunks, which may queue behind a backlog for
longer than that: a stale document whose fan-out is under way, or whose messages (its own, its
unfinished chunks', its stitch's) are still queued or held by a worker, is waiting, not lost. Only one
with none of them anywhere is sent again, its fan-out mark cleared so that the delivery fans out anew
(chunk ids are deterministic and finished chunks come from the cache): docs/documents.md.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from celery import states

from ttsq.app import queues_for, stored_result
from ttsq.constants import DOCUMENT_TASK_NAME, PROGRESS_PREFIX, REQUEUED_STATE, SWEEPER_LOCK_PREFIX
from ttsq.delivery.broker import held, queue_depth
from ttsq.delivery.lost import Unseen, UnseenJobs
from ttsq.errors import CorruptRecord
from ttsq.records.plans import SENDING, SENT, chunk_task_ids
from ttsq.sending import Outgoing, send_job

if TYPE_CHECKING:
    from celery import Celery

    from ttsq.config import Settings
    from ttsq.observer import Observer
    from ttsq.records.accepted import AcceptedJob
    from ttsq.records.owner import RedisOwner

logger = logging.getLogger(__name__)

#: How often the sweep runs, and how long a sweeper's lock outlives its last renewal (seconds).
SWEEP_INTERVAL_S = 1.0
LOCK_TTL_S = 5.0
#: How many lost-job graces a received document may go without progress before the sweeper looks for
#: its messages. Its chunks have no record of their own: one lost in kombu's fetch window (a worker
#: killed between popping it and recording it) is found this way, within seconds, not after a
#: visibility timeout; a document that is only waiting costs one look at the broker each time.
DOCUMENT_STALE_GRACES = 2
#: How many of a stale document's unfinished chunks the sweeper looks for in the broker: any one of
#: them queued or held means the document is waiting.
DOCUMENT_CHUNKS_LOOKED_FOR = 64


class Sweeper:
    """Finds and re-sends lost jobs, on one worker of the deployment at a time."""

    def __init__(self, app: Celery, settings: Settings, redis: RedisOwner, observer: Observer, *, node: str) -> None:
        """``app`` is the worker's own: lost jobs are sent again through it."""
        self.settings = settings
        self.accepted = redis.accepted
        self.plans = redis.plans
        self._cache = redis.cache
        self.observer = observer
        self.node = node
        self.grace_s = float(settings.lost_job_grace_s)
        self.queues = queues_for(settings.queue)
        self._broker = redis.broker
        self._lease = redis.lease(SWEEPER_LOCK_PREFIX + settings.queue, node, ttl_s=LOCK_TTL_S)
        self._app = app
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ttsq-sweeper", daemon=True)
        #: Per queue, the unseen jobs it suspects (``ttsq.delivery.lost``): one queue's sweep never
        #: touches another's.
        self._unseen: dict[str, UnseenJobs] = {}
        #: Task id -> Redis time a received job was first found stale (lost once it stays so,
        #: ``_confirmed``).
        self._stale: dict[str, float] = {}

    def start(self) -> None:
        """Start sweeping (whenever this worker holds the lock)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop sweeping and give the lock up."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=SWEEP_INTERVAL_S + 10)
        try:
            self._lease.give_up()
        except Exception as exc:  # the lock expires by itself within seconds
            logger.debug("could not give the sweeper lock up: %s", type(exc).__name__)

    def _run(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            try:
                if self._hold_lock():
                    self.sweep()
                else:
                    # Another worker sweeps: start afresh if this one takes over.
                    self._unseen.clear()
                    self._stale.clear()
            except Exception as exc:  # Redis restarting, most likely: the next round tries again
                logger.warning("sweep failed: %s: %s", type(exc).__name__, exc)

    def _hold_lock(self) -> bool:
        if self._lease.take():
            logger.info("this worker sweeps for lost jobs")
            return True
        return self._lease.renew()

    def sweep(self) -> int:
        """One round over every queue of the deployment; return how many jobs were sent again."""
        now = self.accepted.now()
        sent = 0
        for queue in self.queues:
            sent += self._sweep_unseen(queue, now)
        sent += self._sweep_received(now)
        return sent

    def _sweep_unseen(self, queue: str, now: float) -> int:
        unseen = self.accepted.unseen(queue)
        if not unseen:
            self._unseen.pop(queue, None)
            return 0
        view = self._unseen.setdefault(queue, UnseenJobs(confirm_s=min(self.grace_s, 2.0)))
        depth = queue_depth(self._broker, queue)
        watermark, _ = self.accepted.watermark(queue)
        jobs: dict[str, AcceptedJob] = {}
        for task_id, _seq in unseen:
            job = self.accepted.get(task_id)
            if job is None:  # its record expired
                self.accepted.drop_unseen(queue, task_id)
            else:
                jobs[task_id] = job
        looking = view.sweep(
            time.monotonic(),
            [
                Unseen(task_id, overdue=now - job.accepted_at > self.grace_s, behind=seq < watermark or depth == 0)
                for task_id, seq in unseen
                if (job := jobs.get(task_id)) is not None
            ],
        )
        # Rarely (only jobs suspect long enough): in the queue's lists, and in kombu's unacked hash, where
        # a message a worker popped is recorded, and a dead worker's stays until recovery gives it back.
        queued = held(self._broker, set(looking), [queue]) if looking else set()
        lost = view.looked(time.monotonic(), queued)
        return sum(self._send_again(jobs[task_id], why="its message never reached a worker") for task_id in lost)

    def _sweep_received(self, now: float) -> int:
        stale_s = self.settings.visibility_timeout_s + self.grace_s
        document_stale_s = min(stale_s, DOCUMENT_STALE_GRACES * self.grace_s)
        suspects = self.accepted.received_before(now - stale_s)
        if document_stale_s < stale_s:
            # Received documents with no progress for a few graces: an ordinary job received as long
            # ago is held by a worker (kombu gives it back after the visibility timeout), but a
            # document waits on chunk messages nothing else records.
            older = set(suspects)
            recent = [t for t in self.accepted.received_before(now - document_stale_s) if t not in older]
            suspects += [t for t, task in self.accepted.tasks(recent).items() if task == DOCUMENT_TASK_NAME]
        sent = 0
        stale = set()
        for task_id in suspects:
            job = self.accepted.get(task_id)
            if job is None:
                self.accepted.finish(task_id)
            elif job.task == DOCUMENT_TASK_NAME and self._document_waiting(task_id):
                self.accepted.touch(task_id)  # waiting behind others: look again after another stale period
            else:
                # Lost once it is found so in two sweeps: a chunk a worker is popping right now is in no
                # list and not yet in the unacked hash, and a document's look above misses it.
                stale.add(task_id)
                if self._confirmed(self._stale, task_id, now):
                    sent += self._send_again(job, why="a worker received it, and it made no progress since", stale=True)
                    self._stale.pop(task_id, None)
        for task_id in set(self._stale) - stale:
            self._stale.pop(task_id, None)
        return sent

    def _settled(self, job: AcceptedJob) -> None:
        """``job`` was sent again, or found not lost: its queue's view forgets it."""
        if (view := self._unseen.get(job.queue)) is not None:
            view.settled(job.task_id)

    def _confirmed(self, suspects: dict[str, float], task_id: str, now: float) -> bool:
        """Whether ``task_id`` has been suspect (in ``suspects``, from when) long enough to count as lost:
        in two sweeps at least, and never longer than the grace."""
        return now - suspects.setdefault(task_id, now) >= min(self.grace_s, 2.0)

    def _document_waiting(self, doc_id: str) -> bool:
        """Whether a stale document is still on its way: its fan-out under way, or a message of its own,
        of an unfinished chunk or of its stitch (which carries its id) queued or held by a worker."""
        state = self.plans.fan_out_state(doc_id)
        if state == SENDING:
            return True  # its lease bounds it
        ids = {doc_id}
        if state == SENT:
            total = self.plans.chunk_count(doc_id) or 0
            done = {str(name) for name in self._cache.hkeys(PROGRESS_PREFIX + doc_id)}
            unfinished = [
                task_id for index, task_id in enumerate(chunk_task_ids(doc_id, total)) if str(index) not in done
            ]
            ids.update(unfinished[:DOCUMENT_CHUNKS_LOOKED_FOR])
        if held(self._broker, ids, self.queues):
            logger.info("document %s: waiting for its chunks behind other work, not lost", doc_id)
            return True
        return False

    def _send_again(self, job: AcceptedJob, *, why: str, stale: bool = False) -> int:
        try:
            state = stored_result(self._app, job.task_id).state
        except CorruptRecord as exc:  # a result is there, if not one ttsq wrote: the job is not lost
            logger.warning("job %s: %s; its record is dropped, not sent again", job.task_id, exc)
            state = states.FAILURE
        if state in states.READY_STATES:
            self.accepted.finish(job.task_id)
            self._settled(job)
            return 0
        if state not in (states.PENDING, REQUEUED_STATE) and not stale:
            # STARTED or PROGRESS: a worker has it; its mark went missing. (REQUEUED says only that its
            # message went back to the queue once: found nowhere since, it is lost.)
            self._settled(job)
            return 0
        if job.task == DOCUMENT_TASK_NAME:
            # None of its messages is anywhere: the next delivery must fan it out again.
            self.plans.forget_fan_out(job.task_id)
        again = Outgoing(
            task_id=job.task_id,
            task=job.task,
            queue=job.queue,
            kwargs=job.kwargs,
            headers=job.headers,
            kwargsrepr="<sent again by the sweeper>",
        )
        send_job(self._app, self.accepted, again, withdraw=False)  # not sent: the next sweep tries again
        self._settled(job)
        self.observer.job_recovered()
        logger.warning("job %s: %s; sent again", job.task_id, why)
        return 1
