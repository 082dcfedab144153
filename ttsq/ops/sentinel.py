"""A throwaway Sentinel topology on loopback: one primary, its replicas and three Sentinels.

For the failover tests and ``benchmarks/failover.py``: every process is a ``redis-server`` this object
started (Sentinels are ``redis-server --sentinel`` with a config file of their own, which Sentinel
rewrites as it learns the topology), on free ports, in one temporary folder, each dying with the thread
that started it. ``fail_primary`` kills the current primary outright (SIGKILL, as a crashed host would)
and ``sleep_primary`` makes it go silent (``DEBUG SLEEP``: alive, its connections open, answering
nothing); ``wait_for_failover`` waits until the Sentinels name a new one that answers as a primary.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from urllib.parse import quote

import redis

from ttsq.errors import BrokerError
from ttsq.ops.redis_server import RedisServer, free_port, parent_death_signal, redis_server_executable
from ttsq.records.connection import connect

#: The name the Sentinels monitor the primary under (``TTSQ_REDIS_MASTER_NAME``).
MASTER_NAME = "ttsq"


class SentinelTopology:
    """A primary, ``replicas`` replicas and ``sentinels`` Sentinels (quorum: a majority), stopped by ``stop()``.

    ``down_after_ms`` is how long a silent primary takes to be thought down, ``failover_timeout_ms``
    Sentinel's failover timeout (short, so a test sees a failover in seconds; production keeps Redis's
    defaults of 30 s and 3 min or close). ``password`` protects the data nodes, ``sentinel_password``
    the Sentinels; ``min_replicas_to_write`` and ``min_replicas_max_lag_s`` are every data node's
    ``min-replicas-to-write`` and ``min-replicas-max-lag`` (1 and 2 s, as docs/high-availability.md
    recommends: a restarted or partitioned old primary refuses writes until it is a replica).
    """

    def __init__(
        self,
        *,
        replicas: int = 1,
        sentinels: int = 3,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 3000,
        password: str | None = None,
        sentinel_password: str | None = None,
        min_replicas_to_write: int = 1,
        min_replicas_max_lag_s: int = 2,
        appendfsync: str = "everysec",
    ) -> None:
        self.replicas = replicas
        self.sentinel_count = sentinels
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.password = password
        self.sentinel_password = sentinel_password
        self.min_replicas_to_write = min_replicas_to_write
        self.min_replicas_max_lag_s = min_replicas_max_lag_s
        self.appendfsync = appendfsync
        self.directory = tempfile.mkdtemp(prefix="ttsq-sentinel-")
        #: Every data node (the first started as the primary), and every Sentinel's port and process.
        self.nodes: list[RedisServer] = []
        self.sentinel_ports: list[int] = []
        self._sentinels: list[subprocess.Popen[bytes]] = []

    # -- addresses ------------------------------------------------------------------------------

    def url(self, db: int) -> str:
        """``sentinel://[:password@]127.0.0.1:P1;sentinel://127.0.0.1:P2;.../db``: ttsq's form for database ``db``."""
        auth = f":{self.password}@" if self.password else ""
        addresses = ";".join(
            f"sentinel://{auth if n == 0 else ''}127.0.0.1:{port}" for n, port in enumerate(self.sentinel_ports)
        )
        return f"{addresses}/{db}"

    def ask(self, port: int) -> redis.Redis:
        """A plain client of the Sentinel on ``port`` (this harness's own look, not ttsq's)."""
        auth = f":{quote(self.sentinel_password, safe='')}@" if self.sentinel_password else ""
        return connect(f"redis://{auth}127.0.0.1:{port}")

    def node(self, port: int, db: int = 0) -> redis.Redis:
        """A plain client of the data node on ``port``."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return connect(f"redis://{auth}127.0.0.1:{port}/{db}")

    def primary_port(self) -> int:
        """The primary's port as the first Sentinel that answers names it."""
        for port in self.sentinel_ports:
            try:
                with self.ask(port) as sentinel:
                    address = sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)
            except redis.RedisError:
                continue
            if address:
                return int(address[1])
        raise BrokerError("no Sentinel names a primary")

    def primary(self) -> RedisServer:
        """The data node that is the primary now."""
        port = self.primary_port()
        return next(node for node in self.nodes if node.port == port)

    # -- starting and stopping ------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> SentinelTopology:
        """Start the primary, its replicas (waiting until each has synced) and the Sentinels (waiting
        until each sees the others and every replica)."""
        auth = ["--requirepass", self.password, "--masterauth", self.password] if self.password else []
        primary = RedisServer(
            directory=self._folder("node0"),
            appendonly=True,
            appendfsync=self.appendfsync,
            arguments=[*auth, *self._write_guard()],
        ).start()
        self.nodes.append(primary)
        for n in range(1, self.replicas + 1):
            replica = RedisServer(
                directory=self._folder(f"node{n}"),
                appendonly=True,
                appendfsync=self.appendfsync,
                arguments=[
                    *auth,
                    *self._write_guard(),
                    "--replicaof",
                    "127.0.0.1",
                    str(primary.port),
                ],
            ).start()
            self.nodes.append(replica)
        self._wait(lambda: self._synced(primary.port) >= self.replicas, timeout, "replicas to sync")
        quorum = self.sentinel_count // 2 + 1
        for n in range(self.sentinel_count):
            port = free_port()
            folder = self._folder(f"sentinel{n}")
            lines = [
                f"port {port}",
                "bind 127.0.0.1",
                f"dir {folder}",
                f"sentinel monitor {MASTER_NAME} 127.0.0.1 {primary.port} {quorum}",
                f"sentinel down-after-milliseconds {MASTER_NAME} {self.down_after_ms}",
                f"sentinel failover-timeout {MASTER_NAME} {self.failover_timeout_ms}",
                f"sentinel parallel-syncs {MASTER_NAME} 1",
            ]
            if self.password:
                lines.append(f"sentinel auth-pass {MASTER_NAME} {self.password}")
            if self.sentinel_password:
                lines.append(f"requirepass {self.sentinel_password}")  # also what Sentinels use with each other
            config = os.path.join(folder, "sentinel.conf")
            with open(config, "w", encoding="utf-8") as out:
                out.write("\n".join(lines) + "\n")
            with open(os.path.join(folder, "sentinel.log"), "ab") as log:
                self._sentinels.append(
                    subprocess.Popen(
                        [redis_server_executable(), config, "--sentinel"],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        preexec_fn=parent_death_signal(),
                    )
                )
            self.sentinel_ports.append(port)
        self._wait(self._sentinels_agree, timeout, "Sentinels to see each other and the replicas")
        return self

    def stop(self) -> None:
        """Stop every process this topology started, and remove its folder."""
        for process in self._sentinels:
            if process.poll() is None:
                process.kill()
            process.wait()
        for node in self.nodes:
            if node.process is not None:
                node.process.send_signal(signal.SIGCONT)  # a paused node cannot die of SIGTERM
            node.stop(crash=True, keep_data=True)
        self._sentinels, self.nodes = [], []
        shutil.rmtree(self.directory, ignore_errors=True)

    # -- failing --------------------------------------------------------------------------------

    def fail_primary(self) -> RedisServer:
        """Kill the primary outright (SIGKILL); the node, for ``restart``."""
        primary = self.primary()
        assert primary.process is not None
        primary.process.kill()
        primary.process.wait()
        return primary

    def pause_primary(self) -> RedisServer:
        """Freeze the primary (SIGSTOP): alive, its connections open, silent, as behind a network
        partition; ``resume`` lets it go on where it stopped."""
        primary = self.primary()
        assert primary.process is not None
        primary.process.send_signal(signal.SIGSTOP)
        return primary

    def sleep_primary(self, seconds: int) -> RedisServer:
        """Make the primary stop answering for ``seconds`` (``DEBUG SLEEP``): alive, its connections open,
        silent, then awake as if nothing happened (still calling itself primary until the Sentinels
        demote it). Returns once the node has taken the command; the node."""
        primary = self.primary()
        client = self.node(primary.port)
        connection = client.connection_pool.get_connection()
        # Sent once, on a connection open already (the node reads it at once), and its answer awaited
        # past the sleep: a client's own retry would send it again.
        connection.send_command("DEBUG", "SLEEP", seconds)  # type: ignore[no-untyped-call]

        def answer() -> None:
            with contextlib.suppress(redis.RedisError):
                if connection.can_read(timeout=seconds + 10):
                    connection.read_response()
            connection.disconnect()  # type: ignore[no-untyped-call]
            client.connection_pool.release(connection)
            client.close()

        threading.Thread(target=answer, name="ttsq-debug-sleep", daemon=True).start()
        return primary

    def resume(self, node: RedisServer) -> None:
        """Let a paused node go on (SIGCONT): a healed partition, the Sentinels then demote it."""
        assert node.process is not None
        node.process.send_signal(signal.SIGCONT)

    def stop_sentinel(self, index: int) -> None:
        """Kill the Sentinel at ``index`` (the order of ``url``'s addresses) for good."""
        process = self._sentinels[index]
        process.kill()
        process.wait()

    def wait_for_failover(self, old_port: int, timeout: float = 75.0) -> int:
        """Wait until every live Sentinel names a primary other than ``old_port`` and it answers as
        one; its port. The default covers a Sentinel in TILT mode (30 s of no action after its timer
        stalled for 2 s, which a loaded 2-core machine can cause) and an election retried after it;
        on a timeout the error carries what each Sentinel saw."""

        def switched() -> bool:
            ports = set()
            for port in self.sentinel_ports:
                try:
                    ports.add(self._named_by(port))
                except redis.RedisError:
                    continue  # a Sentinel that is down has no say
            try:
                (new,) = ports
                with self.node(new) as node:
                    return new != old_port and node.role()[0] == "master"
            except (ValueError, redis.RedisError):
                return False

        try:
            self._wait(switched, timeout, "the Sentinels to promote a replica")
        except BrokerError as exc:
            raise BrokerError(f"{exc}; the Sentinels saw: {self._views()}") from None
        return self.primary_port()

    def _views(self) -> str:
        """Each Sentinel's view of the master, for an error: its address, flags and TILT state."""
        views = []
        for port in self.sentinel_ports:
            try:
                with self.ask(port) as sentinel:
                    state = sentinel.sentinel_master(MASTER_NAME)
                    tilt = sentinel.info("sentinel").get("sentinel_tilt")
                views.append(f"{port}: {state.get('ip')}:{state.get('port')} flags={state.get('flags')} tilt={tilt}")
            except redis.RedisError as exc:
                views.append(f"{port}: {type(exc).__name__}")
        return "; ".join(views)

    def restart(self, node: RedisServer) -> None:
        """Start a node that was killed again on its data: the Sentinels turn it into a replica."""
        node.start()

    # -- internals ------------------------------------------------------------------------------

    def _write_guard(self) -> list[str]:
        # A lag bound below the time a failover takes: a primary cut off from its replicas (frozen, or
        # partitioned) refuses writes by the time it could come back, instead of keeping them until
        # the Sentinels demote it and then throwing them away.
        return [
            # DEBUG SLEEP from loopback only: how ``sleep_primary`` makes a primary go silent.
            "--enable-debug-command",
            "local",
            "--min-replicas-to-write",
            str(self.min_replicas_to_write),
            "--min-replicas-max-lag",
            str(self.min_replicas_max_lag_s),
        ]

    def _folder(self, name: str) -> str:
        folder = os.path.join(self.directory, name)
        os.makedirs(folder, exist_ok=True)
        return folder

    def _named_by(self, port: int) -> int:
        with self.ask(port) as sentinel:
            return int(sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)[1])

    def _synced(self, port: int) -> int:
        with self.node(port) as node:
            info = node.info("replication")
        return sum(
            1
            for key, value in info.items()
            if key.startswith("slave") and isinstance(value, dict) and value.get("state") == "online"
        )

    def _sentinels_agree(self) -> bool:
        try:
            for port in self.sentinel_ports:
                with self.ask(port) as sentinel:
                    state = sentinel.sentinel_master(MASTER_NAME)
                if state["num-other-sentinels"] < self.sentinel_count - 1 or state["num-slaves"] < self.replicas:
                    return False
        except redis.RedisError:
            return False
        return True

    @staticmethod
    def _wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise BrokerError(f"timed out waiting for {what}")
            time.sleep(0.1)
