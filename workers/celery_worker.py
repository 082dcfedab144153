"""Start one Celery worker process for ttsq: threads pool, engine loaded before consuming.

The threads pool is deliberate: CUDA does not survive ``fork``, so a GPU worker is one process whose
task threads hand requests to the batcher thread that owns the device.
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
import warnings
from typing import TYPE_CHECKING

from celery.exceptions import SecurityWarning

import ttsq.tracing as tracing
from ttsq.delivery.transport import GatedConsumer
from ttsq.engines.base import has_cpu_tensors
from ttsq.errors import ConfigError
from ttsq.worker.runtime import WorkerRuntime
from ttsq.worker.tasks import worker_app

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.engines.base import Engine

logger = logging.getLogger(__name__)

#: Buffers this large and larger (one second of 16-bit audio is 44 KB) are mapped from the OS and
#: handed back when freed. By default glibc raises this threshold after the first such buffer is
#: freed and serves later ones from its heaps, which fragment across the task threads: a 10,000-job
#: soak grew each worker by 30 MiB without one leaked object (tracemalloc showed nothing). Fixed at
#: 64 KiB, the same soak stays flat.
MMAP_THRESHOLD_BYTES = 64 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter numbers
_M_TRIM_THRESHOLD = -1
#: glibc's own default, and what its dynamic rule would pair with a 64 KiB mmap threshold.
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES
#: glibc reads this at start and fixes the threshold itself: the operator's choice, kept.
_GLIBC_VARIABLE = "MALLOC_MMAP_THRESHOLD_"
#: The start of the warning Celery's worker prints, several lines long, at every start as root (or in group
#: sudo or wheel): ``celery.platforms.check_privileges``.
_CELERY_ROOT_WARNING = r"You're running the worker with superuser privileges"
#: The groups Celery's check counts as superuser privileges.
_SUPERUSER_GROUPS = ("sudo", "wheel")
#: The worker process's GIL switch interval (seconds); Python's default is 0.005 (see ``run_worker``).
GIL_SWITCH_INTERVAL_S = 0.0005


def tune_heap(engine: Engine) -> str:
    """Fix glibc's mmap threshold, unless the engine computes in this heap; say what was done.

    Called once the engine is loaded and warm (it knows its device only then), before the first
    job. An engine whose tensors live on the CPU keeps glibc's adaptive threshold: fixed at 64 KiB,
    every intermediate tensor of a stock qwen batch became a fresh mapping, faulted in page by page
    and unmapped again (2.5x the page faults and twice the kernel time of a batch of 16), and through
    the queue the stock engine ran at 0.72x a direct call instead of 0.99x (docs/benchmarks.md). Such
    a worker's heap is the model's (a 2,000-job soak of tiny qwen workers: +14 to +20 MiB on 950, against
    +2.5 fixed, docs/guarantees.md). Once fixed, glibc never adapts the threshold again, hence the
    order. glibc's own ``MALLOC_MMAP_THRESHOLD_``, set in the environment, overrides both choices.
    """
    if os.environ.get(_GLIBC_VARIABLE):
        return f"glibc's mmap threshold set by {_GLIBC_VARIABLE}={os.environ[_GLIBC_VARIABLE]}, left as it is"
    if has_cpu_tensors(engine):
        return "glibc's mmap threshold left adaptive (the engine computes on the CPU, in this heap)"
    if not sys.platform.startswith("linux"):
        return "allocator untuned (not Linux)"
    try:
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return "allocator untuned (no glibc mallopt)"
    mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    # glibc maps a large block only when no free heap memory can serve it. Loading the engine may have
    # freed a big mapped block, which raised the trim threshold to twice its size and let the heap's
    # top keep megabytes that audio buffers would be carved from: the trim threshold back at its
    # default and one trim give that back now. (Free chunks inside the heap still serve what fits.)
    mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    malloc_trim(0)
    return f"glibc's mmap threshold fixed at {MMAP_THRESHOLD_BYTES // 1024} KiB (audio buffers go back to the OS)"


def superuser() -> str:
    """How this process holds superuser privileges in Celery's sense (root, or group sudo or wheel), or ""."""
    if not hasattr(os, "geteuid"):
        return ""
    if os.getuid() == 0 or os.geteuid() == 0:
        return f"as root (uid {os.getuid()}, euid {os.geteuid()})"
    try:
        import grp

        groups = {grp.getgrgid(gid).gr_name for gid in (os.getgid(), os.getegid())}
    except (ImportError, KeyError):
        return ""  # Celery says so itself: it cannot name the group
    named = sorted(groups.intersection(_SUPERUSER_GROUPS))
    return f"in group {named[0]}" if named else ""


def say_privileges() -> None:
    """Say once, at INFO, that the worker runs with superuser privileges, in place of Celery's banner.

    Celery's warning is about pickle, which would let whoever can write to the broker run code as root;
    ttsq's workers take JSON only (``ttsq.app``'s ``accept_content``), where Celery itself only advises
    another user. Only that warning is silenced (Celery's ``SecurityError`` for pickle, or its warning
    when it cannot name the group, stay as they are)."""
    warnings.filterwarnings("ignore", message=_CELERY_ROOT_WARNING, category=SecurityWarning)
    how = superuser()
    if how:
        logger.info(
            "running %s: the workers take JSON messages only, so Celery's warning about pickle does not "
            "apply; the image, the compose file, the systemd units and the Kubernetes manifests run them as "
            "the user ttsq (uid 10001), and docs/deployment.md#running-as-another-user shows how",
            how,
        )


def run_worker(settings: Settings, *, hostname: str | None = None) -> int:
    """Run a worker in this process until it is told to stop; return its exit code."""
    node = hostname or f"{settings.engine}@{socket.gethostname()}"
    # Each line names its worker: a launcher's workers all write to the launcher's output. (A '%' in a
    # node name would be read as a format field.) TTSQ_LOG_FORMAT=json: one object a line, with the
    # trace and span ids of the job it was written in.
    handler = logging.StreamHandler()
    handler.setFormatter(
        tracing.log_formatter(
            settings.log_format,
            f"%(asctime)s %(levelname)s {node.replace('%', '%%')} %(name)s: %(message)s",
            {"node": node},
        )
    )
    logging.basicConfig(level=settings.log_level, handlers=[handler])
    # A launcher pins each child to one GPU; NVML numbers GPUs regardless, so it needs the same list.
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = None if visible is None else [d.strip() for d in visible.split(",") if d.strip()]
    # Load and warm the engine first: a model that cannot load stops the process here, with one
    # clear error, before the worker takes a single message off the queue.
    # The consumer's event loop takes messages in on its own thread, which waits for the GIL behind
    # busy task threads: at Python's default 5 ms switch interval an interactive message bound for a
    # free slot waited tens of ms in a saturated worker (benchmarks/lanes.py: queue wait p95 0.13-0.23 s
    # over a bulk backlog, 0.10-0.11 s at 0.5 ms), with no loss of throughput (docs/benchmarks.md#lanes).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    runtime = WorkerRuntime(settings, node=node, device=visible or "", gpus=gpus)
    if settings.metrics_port:
        # Before the engine loads: a port already taken stops the process at once, not after a
        # minute of loading weights.
        try:
            runtime.metrics.serve(settings.metrics_port, settings.metrics_host, health=runtime.health)
        except OSError as exc:
            raise ConfigError(
                "TTSQ_METRICS_PORT", f"cannot serve metrics on port {settings.metrics_port}: {exc.strerror or exc}"
            ) from None
        logging.getLogger(__name__).info(
            "metrics on %s:%d/metrics, probes /livez and /readyz", settings.metrics_host, settings.metrics_port
        )
    runtime.start()
    logger.info("heap: %s", tune_heap(runtime.engine))
    app = worker_app(settings, runtime)
    say_privileges()  # before Celery's own check, in app.Worker below
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
        consumer_cls=GatedConsumer,
    )
    try:
        worker.start()
    finally:
        runtime.close()  # after the pool has joined: the batches in flight have finished
    return int(worker.exitcode or 0)
