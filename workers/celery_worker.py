"""Start one Celery worker process for ttsq: threads pool, engine loaded before consuming.

The threads pool is deliberate: CUDA does not survive ``fork``, so a GPU worker is one process whose
task threads hand requests to the batcher thread that owns the device.
"""

from __future__ import annotations

import logging
import socket
from typing import TYPE_CHECKING

from ttsq.tasks import make_app
from ttsq.worker import WorkerRuntime

if TYPE_CHECKING:
    from ttsq.config import Settings


def run_worker(settings: Settings, *, hostname: str | None = None) -> int:
    """Run a worker in this process until it is told to stop; return its exit code."""
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    # Load and warm the engine first: a model that cannot load stops the process here, with one
    # clear error, before the worker takes a single message off the queue.
    runtime = WorkerRuntime(settings)
    runtime.start()
    app = make_app(settings, runtime=runtime)
    app.set_default()  # pool threads resolve the app through Celery's process default
    worker = app.Worker(
        hostname=hostname or f"{settings.engine}@{socket.gethostname()}",
        pool_cls="threads",
        # Twice the batch: while one batch runs, the next one is already waiting in the batcher.
        concurrency=settings.concurrency,
        queues=runtime.queues,
        loglevel=settings.log_level,
        without_mingle=True,
        without_gossip=True,
    )
    try:
        worker.start()
    finally:
        runtime.close()  # after the pool has joined: the batches in flight have finished
    return int(worker.exitcode or 0)
