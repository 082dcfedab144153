"""The launcher: one ``ttsq worker`` process per device, kept alive, drained on SIGTERM.

``ttsq worker --devices`` runs a ``Supervisor``. Each child is a plain ``ttsq worker`` pinned to its
device, restarted after a backoff when it dies (not after exit code 2, bad settings), and drained with
Celery's warm shutdown, then its cold one: nothing a child held is lost, though a job may run twice. The
lifecycle in full: docs/deployment.md, "One GPU box".
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ttsq.ops.redis_server import parent_death_signal
from ttsq.records.holders import incarnation
from ttsq.records.owner import RedisOwner

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from ttsq.config import Settings
    from ttsq.workers.devices import Slot

logger = logging.getLogger(__name__)

#: Exit code of ``ttsq`` for bad settings or usage: restarting cannot fix it.
EXIT_CONFIG = 2


@dataclass
class _Child:
    slot: Slot
    node: str
    metrics_port: int
    process: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    #: Consecutive exits that came sooner than ``stable_s`` after a start: the backoff exponent.
    quick_exits: int = 0
    restart_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)


class Supervisor:
    """Runs and supervises one worker process per slot until told to stop."""

    def __init__(
        self,
        settings: Settings,
        slots: Sequence[Slot],
        *,
        host: str,
        environ: Mapping[str, str] | None = None,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        stable_s: float = 60.0,
        kill_grace_s: float = 10.0,
    ) -> None:
        if not slots:
            raise ValueError("a supervisor needs at least one slot")
        self.settings = settings
        #: The launcher's Redis: it counts its restarts of each worker there.
        self.redis = RedisOwner(settings, role="launcher")
        self.environ = dict(os.environ if environ is None else environ)
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.stable_s = stable_s
        self.kill_grace_s = kill_grace_s
        self.children = [
            _Child(slot, f"{slot.name}@{host}", settings.metrics_port + index if settings.metrics_port else 0)
            for index, slot in enumerate(slots)
        ]
        self._signals = 0

    # Signals -----------------------------------------------------------------------------------

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._signals += 1
        # Only a flag here: the loop acts on it, outside the signal handler.

    # Running -----------------------------------------------------------------------------------

    def run(self) -> int:
        """Start every child and supervise them; return the exit code once all have stopped."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            return self._supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.redis.close()

    def _supervise(self) -> int:
        for child in self.children:
            self._spawn(child)
        draining_since: float | None = None
        hard_since: float | None = None
        killed = False
        code = 0
        while True:
            now = time.monotonic()
            if self._signals and draining_since is None:
                draining_since = now
                live = self._send(signal.SIGTERM)
                logger.info(
                    "draining: SIGTERM sent to %d worker(s); they finish the batches in flight "
                    "(up to %ds; send SIGTERM again to stop harder)",
                    live,
                    self.settings.drain_timeout_s,
                )
            if (
                draining_since is not None
                and hard_since is None
                and (self._signals >= 2 or now - draining_since >= self.settings.drain_timeout_s)
            ):
                hard_since = now
                why = "second signal" if self._signals >= 2 else f"drain timeout ({self.settings.drain_timeout_s}s)"
                live = self._send(signal.SIGQUIT)
                logger.warning(
                    "%s: cold shutdown (SIGQUIT) of %d worker(s); SIGKILL in %.0fs if still running. "
                    "Unfinished jobs return to the queue (at once, or after the visibility timeout)",
                    why,
                    live,
                    self.kill_grace_s,
                )
                code = 1
            if hard_since is not None and not killed and now - hard_since >= self.kill_grace_s:
                killed = True
                live = self._send(signal.SIGKILL)
                if live:
                    logger.warning("SIGKILL sent to %d worker(s)", live)

            for child in self.children:
                code = max(code, self._check(child, stopping=draining_since is not None))
                if code == EXIT_CONFIG and draining_since is None:
                    self._signals = max(self._signals, 1)  # stop the others: the fleet cannot run
            if draining_since is not None and all(child.process is None for child in self.children):
                break
            time.sleep(0.1)
        logger.info("all workers stopped")
        return code

    def _check(self, child: _Child, *, stopping: bool) -> int:
        """Reap a child that exited and schedule its restart; return an exit code to report."""
        process = child.process
        if process is None:
            if not stopping and child.restart_at is not None and time.monotonic() >= child.restart_at:
                self._spawn(child)
            return 0
        returncode = process.poll()
        if returncode is None:
            return 0
        child.process = None
        child.exit_codes.append(returncode)
        self._mark_dead(child, process.pid)
        lived = time.monotonic() - child.started_at
        how = _describe_exit(returncode)
        if stopping:
            logger.info("%s (pid %d) stopped: %s", child.node, process.pid, how)
            return 0 if returncode == 0 else 1
        if returncode == EXIT_CONFIG:
            logger.error(
                "%s (pid %d) exited with code 2 (bad settings or usage); not restarting it, stopping the launcher",
                child.node,
                process.pid,
            )
            return EXIT_CONFIG
        child.quick_exits = child.quick_exits + 1 if lived < self.stable_s else 1
        delay = min(self.backoff_max_s, self.backoff_initial_s * 2 ** (child.quick_exits - 1))
        child.restart_at = time.monotonic() + delay
        child.restarts += 1
        total = self._count_restart(child)
        logger.warning(
            "%s (pid %d) died: %s after %.1fs; restart #%d in %.1fs (%s restarts recorded in Redis)",
            child.node,
            process.pid,
            how,
            lived,
            child.restarts,
            delay,
            total,
        )
        return 0

    def _spawn(self, child: _Child) -> None:
        env = {
            **self.environ,
            **self.settings.to_env(),
            "TTSQ_METRICS_PORT": str(child.metrics_port),
            "CUDA_VISIBLE_DEVICES": child.slot.cuda_visible_devices,
        }
        child.process = subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", child.node],
            env=env,
            start_new_session=True,
            preexec_fn=parent_death_signal(),
        )
        child.started_at = time.monotonic()
        child.restart_at = None
        logger.info(
            "started %s (pid %d, CUDA_VISIBLE_DEVICES=%r, metrics port %s)",
            child.node,
            child.process.pid,
            child.slot.cuda_visible_devices,
            child.metrics_port or "off",
        )

    def _send(self, sig: signal.Signals) -> int:
        """Send ``sig`` to every live child; return how many there were."""
        live = 0
        for child in self.children:
            if child.process is not None and child.process.poll() is None:
                try:
                    child.process.send_signal(sig)
                    live += 1
                except ProcessLookupError:
                    pass
        return live

    def _mark_dead(self, child: _Child, pid: int) -> None:
        """Say the process is gone: the messages it held go back to the queue within a second or two
        (``ttsq.worker.recovery``), not after its heartbeat runs out, nor the visibility timeout."""
        try:
            self.redis.holders.mark_dead(incarnation(child.node, pid))
        except Exception as exc:  # its heartbeat runs out by itself; the jobs go back a few seconds later
            logger.warning("could not mark %s dead in Redis: %s", child.node, type(exc).__name__)

    def _count_restart(self, child: _Child) -> str:
        try:
            return str(self.redis.stats.record_restart(child.node))
        except Exception as exc:  # Redis down must not stop the launcher from restarting workers
            logger.warning("could not count the restart in Redis: %s", type(exc).__name__)
            return "no"


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"
