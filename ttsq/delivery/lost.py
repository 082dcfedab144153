"""When an accepted job that no worker received counts as lost, without I/O.

The sweeper (``ttsq.worker.sweeper``) keeps one ``UnseenJobs`` per queue. Each sweep it reads the
queue's unseen jobs from the accepted-job ledger and hands them to ``sweep``; it looks in the queue's
lists for the ids ``sweep`` answers and hands what it found to ``looked``; it sends again the ids
``looked`` answers, and says so with ``sent`` (or ``settled`` when it found the job was not lost after
all: a result, or a worker's mark). The rules:

- A job is **suspect** while it is overdue (accepted longer than the grace ago, by Redis's clock) and
  behind (the queue moved past it: a later job was received, or the queue is empty).
- Suspect for ``confirm_s``, it is looked for in the queue's lists and in kombu's unacked hash.
  **Held** (queued behind others, or with a worker that has not marked it yet, or with a dead worker
  whose messages recovery has not given back yet): its suspicion starts over.
- **Missing** (in neither) is not lost yet: a look can miss a message that moves while it looks, and
  kombu records a popped message a moment after its BRPOP. It is lost, and sent again, once it stayed
  missing for ``confirm_s`` and at least two looks.

Durations are measured on the caller's own clock (a monotonic one: the sweeper's), never on Redis's:
a jump of the server's clock can make a job overdue early, never shorten a confirmation.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Unseen:
    """One unseen job as a sweep read it."""

    task_id: str
    #: Accepted longer than the grace ago (by Redis's clock).
    overdue: bool
    #: The queue moved past it (a later job of the queue was received) or holds nothing.
    behind: bool


class UnseenJobs:
    """The sweeper's view of one queue's unseen jobs, from sweep to sweep."""

    def __init__(self, *, confirm_s: float) -> None:
        self.confirm_s = confirm_s
        self._suspect: dict[str, float] = {}  # task id -> since
        self._missing: dict[str, tuple[float, int]] = {}  # task id -> (since, looks)
        self._looking: list[str] = []

    @property
    def tracked(self) -> int:
        """Jobs this view remembers (suspect or missing): bounded by the queue's unseen jobs."""
        return len(self._suspect)

    def sweep(self, now: float, jobs: Iterable[Unseen]) -> list[str]:
        """A sweep read the queue's unseen jobs (all of them: one left out is forgotten): the ids to
        look for in the queue's lists, suspect long enough."""
        suspects: set[str] = set()
        self._looking = []
        for job in jobs:
            if not (job.overdue and job.behind):
                continue
            suspects.add(job.task_id)
            if now - self._suspect.setdefault(job.task_id, now) >= self.confirm_s:
                self._looking.append(job.task_id)
        for task_id in set(self._suspect) - suspects:  # received, finished or caught up since
            self.settled(task_id)
        return list(self._looking)

    def looked(self, now: float, held: Collection[str]) -> list[str]:
        """What the look for ``sweep``'s ids found held (queued, or with a worker): the ids to send
        again."""
        lost = []
        for task_id in self._looking:
            if task_id in held:
                self._suspect[task_id] = now  # on its way: suspect afresh
                self._missing.pop(task_id, None)
                continue
            since, looks = self._missing.get(task_id, (now, 0))
            self._missing[task_id] = (since, looks + 1)
            if looks + 1 >= 2 and now - since >= self.confirm_s:
                lost.append(task_id)
        self._looking = []
        return lost

    def sent(self, task_id: str) -> None:
        """``task_id`` was sent again (accepted anew, with a new place in the queue)."""
        self.settled(task_id)

    def settled(self, task_id: str) -> None:
        """``task_id`` is not lost: forget it."""
        self._suspect.pop(task_id, None)
        self._missing.pop(task_id, None)
