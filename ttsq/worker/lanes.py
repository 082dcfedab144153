"""Lanes and fair shares on the worker: which queue it takes its next message from, and the release of
tenants' deferred jobs into their queues (docs/scheduling.md).

``ttsq.delivery.cycle.LaneCycle`` orders the queues of kombu's ``BRPOP`` (interactive first, bulk its
share), in the channel the worker consumes through.

``Releaser`` is the other half of fair shares: producers defer a job while its queue's list is full
(``AcceptedJobs.defer``), and every worker, a few times a second, releases deferred jobs into the room
its queues' lists have, tenant by tenant in round robin (``AcceptedJobs.release``). Under a per-tenant
cap (``TTSQ_TENANT_MAX_IN_FLIGHT``) a tenant at its cap passes its turn, so its next job goes out within
a release of one of its jobs finishing; every lost-job grace one releaser of the fleet also ages the
tenants' counts (``AcceptedJobs.age_in_flight``): a job that ended without its record finished stops
counting.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ttsq.job import lane_of
from ttsq.sending import send_released

if TYPE_CHECKING:
    from celery import Celery

    from ttsq.config import Settings
    from ttsq.records.accepted import AcceptedJobs

logger = logging.getLogger(__name__)

#: How often a worker releases deferred jobs into the room its queues have (seconds): a list of 64 jobs
#: lasts a busy fleet far longer, so the lists never run dry between two releases.
RELEASE_INTERVAL_S = 0.05
#: Jobs one release takes out at most when there is no window (a cap alone): what a window would allow.
RELEASE_MOST = 64
#: After a release that failed (Redis restarting), the next try waits this long (seconds).
RELEASE_RETRY_S = 1.0


class Releaser:
    """Releases deferred jobs of this worker's queues and sends them, a few times a second, on a thread.
    Every worker runs one: a release is one atomic script, so several never release more than the room."""

    def __init__(self, app: Celery, settings: Settings, accepted: AcceptedJobs, queues: list[str]) -> None:
        """``app`` is the worker's own: released jobs are sent through it."""
        self._app = app
        self._accepted = accepted
        self._queues = queues
        self._window = settings.release_window
        self._weights = settings.weights
        self._cap = settings.tenant_max_in_flight
        #: Under a cap, a tenant's freed places go to the first of its queues with jobs waiting: every
        #: ``_bulk_every``-th release offers them to the bulk lane first, so its bulk work never starves
        #: behind its own interactive backlog (the share ``LaneCycle`` gives bulk messages).
        self._bulk_every = max(1, round(100 / settings.bulk_share_percent))
        self._releases = 0
        self._scope = settings.queue
        #: How often the tenants' in-flight counts are aged (seconds): a lost-job grace, as for lost jobs,
        #: by one worker of the fleet a period (the others find the period's mark and skip it).
        self._age_every_s = settings.lost_job_grace_s
        self._aged_at = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ttsq-releaser", daemon=True)

    def start(self) -> None:
        if (self._window > 0 or self._cap > 0) and self._queues:
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=RELEASE_RETRY_S + 10)

    def release(self) -> int:
        """One round: release what the room allows and send it; return how many were sent."""
        self._releases += 1
        queues = self._queues
        if self._cap > 0 and self._releases % self._bulk_every == 0:
            queues = sorted(queues, key=lambda queue: lane_of(queue) != "bulk")
        released = self._accepted.release(
            queues,
            window=self._window,
            most=self._window or RELEASE_MOST,
            weights=self._weights,
            cap=self._cap,
            scope=self._scope,
        )
        for job in released:
            # A send that fails leaves the job unseen with its new seq: the sweeper sends it again.
            send_released(self._app, job)
        return len(released)

    def age(self) -> int:
        """Drop from the tenants' in-flight counts the jobs that ended without finishing their record;
        return how many (the count of a job still in flight never drops: its record names it)."""
        dropped = self._accepted.age_in_flight(self._scope, every_s=self._age_every_s)
        if dropped:
            logger.info("%d jobs no longer in flight left their tenants' counts", dropped)
        return dropped

    def _run(self) -> None:
        wait = RELEASE_INTERVAL_S
        while not self._stop.wait(wait):
            try:
                if self._cap > 0 and time.monotonic() - self._aged_at >= self._age_every_s:
                    self._aged_at = time.monotonic()
                    self.age()
                self.release()
                wait = RELEASE_INTERVAL_S
            except Exception as exc:  # Redis or the broker restarting, most likely: try again shortly
                logger.warning("releasing deferred jobs failed: %s: %s", type(exc).__name__, exc)
                wait = RELEASE_RETRY_S
