"""How ttsq opens one Redis client, and its error policy; ``ttsq.records.owner`` is the only caller of ``connect``.

Every client gets ttsq's socket limits (fail fast when Redis is gone instead of hanging on a dead TCP
connection), answers ``str``, and names its connections (``CLIENT SETNAME``). Failures surface as
``BrokerError`` with the password masked; a worker's calls may be retried for a while (``patiently``)
so it rides out a Redis restart instead of failing the jobs it holds.

Behind Sentinel (a ``sentinel://`` URL) the client asks the Sentinels for the primary on every new
connection; a connection to a primary that died, went silent or was demoted fails as a
``ConnectionError``, is dropped, and the next one goes to the new primary. So "unreachable" covers the
seconds of a failover, and ``patiently`` rides them out like a restart.

How a connection learns that its node is no longer the primary, for reads as for writes:

- a node that stopped answering (frozen, ``DEBUG SLEEP``, a partition) is given up after
  ``TTSQ_REDIS_SOCKET_TIMEOUT_S``, a few seconds (without a timeout a client waits as long as the node
  sleeps, then goes on with it);
- a demoted node refuses writes (``READONLY``, which redis-py turns into a lost connection), but it
  answers reads, from a copy that lacks what was written on the new primary: a job accepted there is
  "unknown". Its own ``ROLE`` does not say so in time either: an old primary that comes back still
  calls itself primary until the Sentinels reconfigure it, which takes them seconds (about ten). So
  each connection asks the Sentinels, the authority on who the primary is, at most once every
  ``TTSQ_REDIS_HEALTH_CHECK_S`` (``SentinelConnection``): when the pool hands it out, and when it
  sends (a connection held across commands, as kombu's waiting ``BRPOP``). Handed out, it is made
  again to the node they name and the call goes on there; held, it is dropped as a lost connection.
  Asking also moves the pool's idea of the primary, and redis-py then drops its idle connections to
  the old one, and each busy one when it comes back to the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import redis
from redis.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from ttsq.config import is_sentinel_url, parse_sentinel_url
from ttsq.constants import (
    REDIS_CONNECT_TIMEOUT_S,
    REDIS_HEALTH_CHECK_INTERVAL_S,
    REDIS_MAX_CONNECTIONS,
    REDIS_SOCKET_TIMEOUT_S,
)
from ttsq.errors import BrokerError, ConfigError
from ttsq.redaction import redact_url

if TYPE_CHECKING:
    from ttsq.config import Settings

logger = logging.getLogger(__name__)
T = TypeVar("T")


#: How a primary with ``min-replicas-to-write`` refuses a write while too few replicas are connected.
NO_REPLICAS = "NOREPLICAS"
#: How long one question to one Sentinel may take (seconds): a Sentinel that does not answer is skipped
#: for the next one, so a dead Sentinel costs a failover this long, not a socket timeout.
SENTINEL_TIMEOUT_S = 1.0


class SentinelConnection(SentinelManagedConnection):
    """redis-py's Sentinel-managed connection, reconnecting through the Sentinels whatever path
    reconnects it: redis-py 8.1 sends on a dropped connection by reconnecting to the address it had
    (``connect_check_health``), which after a failover is the dead primary (redis-py #3560, #3874).

    ``NOREPLICAS`` (a primary with ``min-replicas-to-write`` whose replicas are not back yet, just after
    a failover; or an old primary restarted alone) is a lost connection here, as redis-py already makes
    ``READONLY``: kombu takes any other error on its ``BRPOP`` for an unrecoverable one and ends the
    worker, while a lost connection is reconnected after a pause."""

    #: When this connection next asks the Sentinels whether its node is still the primary (monotonic seconds).
    _primary_check_at = 0.0

    def connect_to(self, address: Any) -> None:
        super().connect_to(address)  # type: ignore[no-untyped-call]
        # Connecting asked the Sentinels just now.
        self._primary_check_at = time.monotonic() + (self.health_check_interval or 0)

    def connect(self) -> None:
        # A pool hands a connection out through here, before the first command of each use (so never
        # between a WATCH and its EXEC): one that leads to a node the Sentinels no longer name is made
        # again, to the node they name, and the call goes on there without an error.
        if self._sock is not None and self._primary_moved():
            self.disconnect()
        super().connect()  # type: ignore[no-untyped-call]  # a no-op while connected; else through the Sentinels

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        # redis-py's connection classes are untyped; these are their public methods.
        if self._sock is not None and check_health and self._primary_moved():
            # A connection held across commands (kombu's waiting BRPOP connection, a pipeline's) is
            # dropped as a lost one: its holder reconnects, through the Sentinels.
            self.disconnect()
            raise redis.exceptions.ConnectionError(f"{self.host}:{self.port} is no longer the primary")
        if self._sock is None:
            self.connect()  # asks the Sentinels for the primary's address first
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    def _primary_moved(self) -> bool:
        """Whether the Sentinels, asked at most once per health-check interval, name another node than
        the one this connection leads to. Not inside a subscription (``check_health`` false), where
        nothing but (un)subscribing may be sent, and only for a pool of the primary."""
        pool = self.connection_pool
        if not self.health_check_interval or not pool.is_master or time.monotonic() < self._primary_check_at:
            return False
        self._primary_check_at = time.monotonic() + self.health_check_interval
        primary = primary_address(pool.get_master_address)
        return primary is not None and primary != (self.host, self.port)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.exceptions.ResponseError as exc:
            if not str(exc).startswith(NO_REPLICAS):
                raise
            self.disconnect()  # type: ignore[no-untyped-call]
            raise redis.exceptions.ConnectionError(f"the primary cannot write yet: {exc}") from exc


def connect(url: str, *, name: str | None = None, settings: Settings | None = None) -> redis.Redis:
    """A Redis client (one connection pool) with ttsq's timeouts, its connections named ``name``.

    Answers are ``str``; a byte that is not UTF-8 (a raw message someone pushed onto a queue) reads as
    U+FFFD instead of failing a metrics scrape or a search of the queue for a task id. A ``sentinel://``
    URL needs ``settings`` (the master's name, the Sentinels' credentials): the client then follows
    the primary through failovers.
    """
    options: dict[str, Any] = {
        **socket_limits(settings),
        "decode_responses": True,
        "encoding_errors": "replace",
        "client_name": name,
        "max_connections": REDIS_MAX_CONNECTIONS,
    }
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    master_name, sentinels, credentials = sentinel_parts(url, settings)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs(settings), **options)  # type: ignore[no-untyped-call,unused-ignore]
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]
        master_name, redis_class=redis.Redis, connection_class=SentinelConnection, **credentials, **options
    )
    return client


def socket_limits(settings: Settings | None) -> dict[str, int]:
    """redis-py's timeouts and health-check interval from ``settings`` (ttsq's defaults without them),
    for every Redis client ttsq makes, sync or async."""
    if settings is None:
        return {
            "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
            "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
            "health_check_interval": REDIS_HEALTH_CHECK_INTERVAL_S,
        }
    return {
        "socket_connect_timeout": settings.redis_connect_timeout_s,
        "socket_timeout": settings.redis_socket_timeout_s,
        "health_check_interval": settings.redis_health_check_s,
    }


def primary_address(ask: Callable[[], Any]) -> tuple[str, int] | None:
    """The primary's address as ``ask`` (a Sentinel pool's ``get_master_address``) got it from the
    Sentinels; None when none of them names one (all unreachable, or all see the primary down: a failover
    under way), which is no reason to drop a connection that may well lead to the primary still."""
    try:
        host, port = ask()
    except redis.exceptions.ConnectionError:  # MasterNotFoundError is one
        return None
    return str(host), int(port)


def sentinel_parts(url: str, settings: Settings | None) -> tuple[str, list[tuple[str, int]], dict[str, Any]]:
    """What a Sentinel-backed client is built from: the master's name, the Sentinels' addresses, and
    the primary's database and credentials."""
    if settings is None or not settings.redis_master_name:
        raise ConfigError("TTSQ_REDIS_MASTER_NAME", f"must be set to connect to {redact_url(url)}")
    parsed = parse_sentinel_url(url)
    credentials: dict[str, Any] = {"db": parsed.db}
    if parsed.password is not None:
        credentials.update(username=parsed.username, password=parsed.password)
    return settings.redis_master_name, list(parsed.sentinels), credentials


def sentinel_kwargs(settings: Settings | None) -> dict[str, Any]:
    """How ttsq talks to the Sentinels themselves: short timeouts (a dead Sentinel is skipped, not
    waited on), and their own credentials, which are not the data nodes'."""
    options: dict[str, Any] = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    if settings is not None and settings.sentinel_password:
        options["password"] = settings.sentinel_password
        if settings.sentinel_username:
            options["username"] = settings.sentinel_username
    return options


def address(client: redis.Redis) -> str:
    """Where ``client`` connects, as a URL with the password masked, for messages and logs."""
    kwargs = client.get_connection_kwargs()
    db = kwargs.get("db") or 0
    if isinstance(client.connection_pool, SentinelConnectionPool):
        return f"sentinel://{client.connection_pool.service_name}/{db}"
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={db}"
    scheme = "rediss" if client.connection_pool.connection_class is redis.SSLConnection else "redis"
    user = f"{kwargs.get('username') or ''}:***@" if kwargs.get("password") else ""
    return f"{scheme}://{user}{kwargs.get('host') or 'localhost'}:{kwargs.get('port') or 6379}/{db}"


def within(client: redis.Redis, timeout_s: float, *commands: tuple[str | int, ...]) -> list[Any]:
    """The raw answers to ``commands``, sent together on one of ``client``'s connections, if they all
    arrive within ``timeout_s``; ``redis.TimeoutError`` if not.

    For the reads that must not wait on a Redis that stopped answering (the batcher asking how many
    jobs are queued, a health probe) while the pool's own socket timeout stays long enough for every
    other read: a per-call deadline on the one pool, rather than a second pool with a short timeout.
    """
    pool = client.connection_pool
    connection = pool.get_connection()
    try:
        # redis-py's Connection is untyped; these are its public methods. No health check first: its
        # PING (and, behind Sentinel, the question to the Sentinels) would wait on the socket timeout,
        # not on this deadline; a stale queue depth costs a batching decision, and the next call on
        # this connection that is not ``within`` checks it.
        connection.send_packed_command(connection.pack_commands(list(commands)), check_health=False)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + timeout_s
        answers = []
        for _ in commands:
            if not connection.can_read(timeout=max(0.0, deadline - time.monotonic())):
                raise redis.exceptions.TimeoutError(f"no answer from Redis within {timeout_s}s")
            answers.append(connection.read_response())
        return answers
    except BaseException:
        # An answer still on its way would be read by the next command sent on this connection.
        connection.disconnect()  # type: ignore[no-untyped-call]
        raise
    finally:
        pool.release(connection)


def patiently(call: Callable[[], T], url: str, patience_s: float) -> T:
    """Run a Redis call; while Redis cannot be reached, try again for up to ``patience_s`` seconds
    (workers ride out a Redis restart), then raise ``BrokerError``."""
    give_up = time.monotonic() + patience_s
    while True:
        try:
            with redis_errors(url):
                return call()
        except BrokerError as exc:
            if not unreachable(exc.__cause__) or time.monotonic() >= give_up:
                raise
            logger.warning("Redis at %s unreachable; trying again", redact_url(url))
            time.sleep(0.5)


def unreachable(exc: BaseException | None) -> bool:
    """Whether a Redis error means "no primary to talk to right now" (worth waiting out) rather than
    a refused command: a lost or refused connection, a node that stopped answering (the socket timeout:
    the connection is dropped, and the next goes where the Sentinels say), no primary known to the
    Sentinels, a node that answers ``READONLY`` because it was a primary and has just been demoted, or
    ``NOREPLICAS`` from a primary with ``min-replicas-to-write`` whose replicas are not back yet (just
    after a failover)."""
    if isinstance(
        exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.ReadOnlyError)
    ):
        return True
    # A pipeline reports it as "Command # 1 (...) of pipeline caused error: NOREPLICAS ...".
    return isinstance(exc, redis.exceptions.ResponseError) and NO_REPLICAS in str(exc)


@contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Redis failures as ``BrokerError``, with the password masked."""
    try:
        yield
    except redis.exceptions.RedisError as exc:
        if not unreachable(exc):
            raise BrokerError(f"cache Redis at {redact_url(url)} failed: {exc}") from exc
        raise BrokerError(f"cannot reach the cache Redis at {redact_url(url)}: {exc}") from exc
