"""Start one Celery worker process for ttsq: threads pool, engine loaded before consuming.

The threads pool is deliberate: CUDA does not survive ``fork``, so a GPU worker is one process whose
task threads hand requests to the batcher thread that owns the device.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING

from ttsq.errors import ConfigError
from ttsq.tasks import make_app
from ttsq.worker import WorkerRuntime

if TYPE_CHECKING:
    from ttsq.config import Settings


def run_worker(settings: Settings, *, hostname: str | None = None) -> int:
    """Run a worker in this process until it is told to stop; return its exit code."""
    logging.basicConfig(level=settings.log_level,
                        format="%(asctime)s %(levelname)s %(processName)s %(name)s: %(message)s")
    node = hostname or f"{settings.engine}@{socket.gethostname()}"
    # A launcher pins each child to one GPU; NVML numbers GPUs regardless, so it needs the same list.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = None if visible is None else [d.strip() for d in visible.split(",") if d.strip()]
    # Load and warm the engine first: a model that cannot load stops the process here, with one
    # clear error, before the worker takes a single message off the queue.
    runtime = WorkerRuntime(settings, node=node, device=visible or "", gpus=gpus)
    if settings.metrics_port:
        # Before the engine loads: a port already taken stops the process at once, not after a
        # minute of loading weights.
        try:
            runtime.metrics.serve(settings.metrics_port)
        except OSError as exc:
            raise ConfigError("TTSQ_METRICS_PORT", f"cannot serve metrics on port {settings.metrics_port}: "
                              f"{exc.strerror or exc}") from None
        logging.getLogger(__name__).info("metrics on :%d/metrics", settings.metrics_port)
    runtime.start()
    app = make_app(settings, runtime=runtime)
    app.set_default()  # pool threads resolve the app through Celery's process default
    worker = app.Worker(
        hostname=node,
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
