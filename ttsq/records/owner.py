"""The one owner of Redis in a process: one client (one connection pool) per database, and the records on them.

Each entrypoint (a worker, the gateway, a command, the launcher) builds one ``RedisOwner`` from its
settings and passes it down; nothing else in ttsq opens a Redis connection, so this is where Sentinel
plugs in: a ``sentinel://`` URL gives a client (sync or async) that asks the Sentinels for the primary
on every new connection and follows it through a failover (``ttsq.records.connection``). Every
connection names itself (``CLIENT SETNAME ttsq:<role>:<pid>:<databases>:<pool>``), so ``CLIENT LIST``
tells ttsq's pools from Celery's and kombu's. The result backend is Celery's own.
"""

from __future__ import annotations

import functools
import os
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import redis
from redis import asyncio as aioredis
from redis.asyncio import sentinel as aiosentinel
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ttsq.config import is_sentinel_url
from ttsq.constants import REPLICATED_KEY
from ttsq.errors import BrokerError
from ttsq.records.accepted import AcceptedJobs
from ttsq.records.attempts import Ledger
from ttsq.records.cache import CacheIndex
from ttsq.records.connection import (
    NO_REPLICAS,
    connect,
    patiently,
    sentinel_kwargs,
    sentinel_parts,
    socket_limits,
)
from ttsq.records.deadletters import DeadLetters
from ttsq.records.holders import Holders
from ttsq.records.identities import Identities
from ttsq.records.lease import Lease
from ttsq.records.named_voices import NamedVoices
from ttsq.records.plans import Plans
from ttsq.records.stats import FleetStats
from ttsq.records.streams import AudioStreams

if TYPE_CHECKING:
    from ttsq.config import Settings

#: Connections each async pool (the gateway's) keeps, and how long a request waits for a free one: a
#: thousand requests at once share a few dozen connections instead of opening a thousand (Redis's
#: accept backlog would refuse some).
ASYNC_POOL_SIZE = 32
ASYNC_POOL_WAIT_S = 30


class _BlockingSentinelPool(aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """redis.asyncio's Sentinel pool (each new connection goes to the primary the Sentinels name now),
    bounded and waiting for a free connection like the gateway's plain pool, not failing past its size."""


class _SentinelConnection(aiosentinel.SentinelManagedConnection):
    """The async twin of ``ttsq.records.connection.SentinelConnection``: a dropped connection reconnects
    through the Sentinels, not to the address it had (the dead primary, after a failover); a connection
    to a node the Sentinels no longer name as the primary is dropped before it sends, reads as writes."""

    #: When this connection next asks the Sentinels whether its node is still the primary (monotonic seconds).
    _primary_check_at = 0.0

    async def connect_to(self, address: Any) -> None:
        await super().connect_to(address)  # type: ignore[no-untyped-call]
        self._primary_check_at = time.monotonic() + (self.health_check_interval or 0)  # asked just now

    async def connect(self) -> None:
        if self.is_connected and await self._primary_moved():
            await self.disconnect()  # handed out by the pool: made again to the primary the Sentinels name
        await super().connect()  # type: ignore[no-untyped-call]

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if self.is_connected and check_health and await self._primary_moved():
            await self.disconnect()  # held across commands: dropped as a lost connection
            raise redis.exceptions.ConnectionError(f"{self.host}:{self.port} is no longer the primary")
        if not self.is_connected:
            await self.connect()  # through the Sentinels
        await super().send_packed_command(command, check_health)

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith(NO_REPLICAS):
                raise
            await self.disconnect()
            raise redis.exceptions.ConnectionError(f"the primary cannot write yet: {exc}") from exc

    async def _primary_moved(self) -> bool:
        """``SentinelConnection._primary_moved``, on the event loop."""
        pool = self.connection_pool
        if not self.health_check_interval or not pool.is_master or time.monotonic() < self._primary_check_at:
            return False
        self._primary_check_at = time.monotonic() + self.health_check_interval
        try:
            host, port = await pool.get_master_address()
        except redis.exceptions.ConnectionError:  # no Sentinel names one now: no reason to drop this one
            return False
        return (str(host), int(port)) != (self.host, self.port)


class RedisOwner:
    """ttsq's Redis connections in one process, and the records kept there. Safe to share between threads."""

    def __init__(self, settings: Settings, *, role: str, patience_s: float = 0.0) -> None:
        """``role`` names the process in ``CLIENT LIST`` (worker, gateway, client, launcher);
        ``patience_s`` is how long the records' calls ride out a Redis that cannot be reached."""
        self.settings = settings
        self.role = role
        self.patience_s = patience_s
        self._clients: dict[str, redis.Redis] = {}
        self._async_clients: dict[str, aioredis.Redis] = {}
        self._lock = threading.Lock()

    # -- one client per database ---------------------------------------------------------------

    @property
    def broker(self) -> redis.Redis:
        """The broker's database: queue depths, unacknowledged messages, dead letters."""
        return self.client(self.settings.broker_url)

    @property
    def cache(self) -> redis.Redis:
        """The cache database: every record ttsq keeps."""
        return self.client(self.settings.cache_url)

    def client(self, url: str) -> redis.Redis:
        """The one client of the database at ``url``, opened on first use."""
        client = self._clients.get(url)  # no lock once it exists: the batcher asks every few milliseconds
        if client is None:
            with self._lock:
                client = self._clients.get(url)
                if client is None:
                    client = self._clients[url] = connect(url, name=self._name(url), settings=self.settings)
        return client

    def async_client(self, url: str) -> aioredis.Redis:
        """The one async client of the database at ``url`` (the gateway's): a bounded pool that waits
        for a free connection."""
        with self._lock:
            if url not in self._async_clients:
                options: dict[str, Any] = {
                    "max_connections": ASYNC_POOL_SIZE,
                    "timeout": ASYNC_POOL_WAIT_S,
                    # A silent node is given up within seconds, as by the sync clients: the gateway
                    # then moves to the new primary, and its blocking reads (1 s stream reads and
                    # subscription polls) stay well inside the socket timeout.
                    **socket_limits(self.settings),
                    "decode_responses": True,
                    "encoding_errors": "replace",
                    "client_name": self._name(url, "async"),
                }
                if is_sentinel_url(url):
                    master_name, sentinels, credentials = sentinel_parts(url, self.settings)
                    sentinel = aiosentinel.Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs(self.settings))  # type: ignore[no-untyped-call,unused-ignore]
                    # After a failover every idle connection still points at the old primary; a call
                    # that meets one tries once more on a new connection (to the primary the Sentinels
                    # name now) instead of failing the request: one retry, on a lost connection only.
                    retry = Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,))
                    self._async_clients[url] = sentinel.master_for(
                        master_name,
                        connection_pool_class=_BlockingSentinelPool,
                        connection_class=_SentinelConnection,
                        retry=retry,
                        **credentials,
                        **options,
                    )
                else:
                    pool = aioredis.BlockingConnectionPool.from_url(url, **options)
                    self._async_clients[url] = aioredis.Redis(connection_pool=pool)
            return self._async_clients[url]

    def _name(self, url: str, kind: str = "") -> str:
        # The settings that name this database, and a token that tells this pool from any other.
        fields = {"broker_url": "broker", "result_backend": "results", "cache_url": "cache"}
        databases = "+".join(label for field, label in fields.items() if getattr(self.settings, field) == url)
        parts = [self.role, str(os.getpid()), databases or "redis", kind, secrets.token_hex(3)]
        return "ttsq:" + ":".join(part for part in parts if part)

    # -- replication ----------------------------------------------------------------------------

    def replicated(self) -> None:
        """Return once ``TTSQ_REDIS_WAIT_REPLICAS`` replicas of the cache database's primary hold every
        write made on it so far (a producer's record of the job it is accepting, its claim); at once
        when the setting is 0. ``BrokerError`` if fewer confirmed within ``TTSQ_REDIS_WAIT_TIMEOUT_MS``:
        the caller refuses the job rather than accept one a failover could lose."""
        replicas = self.settings.redis_wait_replicas
        if replicas == 0:
            return
        timeout_ms = self.settings.redis_wait_timeout_ms

        def wait() -> int:
            # One connection for both: WAIT counts from the last write of the connection it runs on.
            pipe = self.cache.pipeline(transaction=False)
            pipe.incr(REPLICATED_KEY)
            pipe.execute_command("WAIT", replicas, timeout_ms)  # type: ignore[no-untyped-call]
            return int(pipe.execute()[1])

        confirmed = patiently(wait, self.settings.cache_url, self.patience_s)
        if confirmed < replicas:
            raise BrokerError(
                f"only {confirmed} of the {replicas} replicas required (TTSQ_REDIS_WAIT_REPLICAS) confirmed the "
                f"job's record within {timeout_ms} ms; not accepted"
            )

    # -- the records ----------------------------------------------------------------------------

    @functools.cached_property
    def cache_index(self) -> CacheIndex:
        """Content key → stored audio, and single-flight claims."""
        return CacheIndex(self.cache, ttl_s=self.settings.cache_ttl_s, patience_s=self.patience_s)

    @functools.cached_property
    def accepted(self) -> AcceptedJobs:
        """Every job a producer accepted, until it has a final result: its one record, its cancel included."""
        return AcceptedJobs(
            self.cache,
            patience_s=self.patience_s,
            keep_s=self.settings.result_ttl_s,
            outcome_s=self.settings.inflight_ttl_s,
        )

    @functools.cached_property
    def streams(self) -> AudioStreams:
        """The audio streams of streaming jobs (``ttsq.records.streams``)."""
        return AudioStreams(
            self.cache,
            window_s=self.settings.stream_window_s,
            grace_s=self.settings.stream_grace_s,
            patience_s=self.patience_s,
        )

    @functools.cached_property
    def attempts(self) -> Ledger:
        """Engine calls per job that never returned, and the jobs parked for them."""
        return Ledger(self.cache, ttl_s=self.settings.inflight_ttl_s, patience_s=self.patience_s)

    @functools.cached_property
    def plans(self) -> Plans:
        """The plans of running documents, and their fan-out marks."""
        return Plans(self.cache, ttl_s=self.settings.result_ttl_s, patience_s=self.patience_s)

    @functools.cached_property
    def identities(self) -> Identities:
        """The models live workers announced, per mode."""
        return Identities(self.cache, patience_s=self.patience_s)

    @functools.cached_property
    def named_voices(self) -> NamedVoices:
        """The voices users keep under a name (``POST /v1/audio/voices``, ``ttsq voices named``)."""
        return NamedVoices(self.cache, patience_s=self.patience_s)

    @functools.cached_property
    def stats(self) -> FleetStats:
        """Per-minute counters, heartbeats and launcher restarts of the fleet."""
        return FleetStats(self.cache)

    @functools.cached_property
    def holders(self) -> Holders:
        """Which worker process holds which unacknowledged message, and their heartbeats."""
        return Holders(self.broker)

    @functools.cached_property
    def dead_letters(self) -> DeadLetters:
        """The messages workers refused, kept in the broker's database."""
        return DeadLetters(self.broker)

    def lease(self, key: str, holder: str, *, ttl_s: float) -> Lease:
        """The lease ``key`` in the cache database, held as ``holder``."""
        return Lease(self.cache, key, holder, ttl_s=ttl_s)

    # -- closing --------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the sync pools (the async ones close with ``aclose``, on their event loop)."""
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    async def aclose(self) -> None:
        """Close the async pools."""
        with self._lock:
            clients, self._async_clients = list(self._async_clients.values()), {}
        for client in clients:
            await client.aclose()
