"""The worker's liveness check: a stuck engine ends the process, so a supervisor restarts it.

The threads pool enforces no Celery time limit, and a thread stuck inside a native library (a CUDA
kernel that never returns, a deadlocked decoder) cannot be interrupted from Python. The only
reliable cure is a new process. The watchdog thread looks at the batcher once a second; when one
engine call has run longer than the per-batch limit, or the batcher thread has died, it logs why and
exits the process at once with ``EXIT_ENGINE_STUCK`` (70). Whatever supervises the worker (systemd
``Restart=on-failure``, compose ``restart: unless-stopped``, ``ttsq worker --devices``) starts a new
one. Nothing is acknowledged on the way out, so every job the process held (the stuck batch and the
prefetched jobs) is redelivered after the visibility timeout; a job that keeps hanging the engine
is parked by the attempt ledger like one that crashes it.

The limit must fit a healthy batch: a worker whose engine can say what a batch costs (the stand-in)
refuses to start where a full batch of the longest texts would not fit (``ttsq.worker.runtime``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ttsq.constants import EXIT_ENGINE_STUCK

if TYPE_CHECKING:
    from ttsq.batching.batcher import Batcher

logger = logging.getLogger(__name__)


class Watchdog:
    """Ends the process when the batcher is stuck past ``limit_s`` or has died."""

    def __init__(
        self, batcher: Batcher, *, limit_s: float, interval_s: float = 1.0, exit: Callable[[int], object] = os._exit
    ) -> None:
        self.batcher = batcher
        self.limit_s = limit_s
        self.interval_s = interval_s
        self._exit = exit
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ttsq-watchdog", daemon=True)

    def start(self) -> None:
        """Start watching (after the engine has loaded)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop watching: the worker is shutting down and stops the batcher itself."""
        self._stopped.set()

    def check(self) -> str | None:
        """Why the worker must be restarted, or None while it is healthy."""
        busy = self.batcher.busy_s()
        if busy > self.limit_s:
            return (
                f"an engine call has run {busy:.0f}s, past the per-batch limit of {self.limit_s:.0f}s "
                "(TTSQ_BATCH_TIMEOUT_S)"
            )
        if not self.batcher.alive:
            return "the batcher thread has died"
        return None

    def _watch(self) -> None:
        while not self._stopped.wait(self.interval_s):
            reason = self.check()
            if reason is not None and not self._stopped.is_set():
                logger.critical(
                    "worker is stuck: %s; exiting with status %d so that its supervisor restarts it "
                    "(its jobs are redelivered after the visibility timeout)",
                    reason,
                    EXIT_ENGINE_STUCK,
                )
                for handler in logging.getLogger().handlers:
                    handler.flush()
                sys.stderr.flush()
                self._exit(EXIT_ENGINE_STUCK)
                return
