"""How ttsq opens one Redis client, and its error policy; ``ttsq.records.owner`` is the only caller of ``connect``.

Every client gets ttsq's socket limits (fail fast when Redis is gone instead of hanging on a dead TCP
connection), answers ``str``, and names its connections (``CLIENT SETNAME``). Failures surface as
``BrokerError`` with the password masked; a worker's calls may be retried for a while (``patiently``)
so it rides out a Redis restart instead of failing the jobs it holds.

Behind Sentinel (a ``sentinel://`` URL) the client asks the Sentinels for the primary on every new
connection; a connection to a primary that died or was demoted fails as a ``ConnectionError`` (redis-py
turns a demoted primary's ``READONLY`` into one), is dropped, and the next one goes to the new primary.
So "unreachable" covers the seconds of a failover, and ``patiently`` rides them out like a restart.
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
from ttsq.constants import REDIS_CONNECT_TIMEOUT_S, REDIS_HEALTH_CHECK_INTERVAL_S, REDIS_SOCKET_TIMEOUT_S
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

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        # redis-py's connection classes are untyped; these are their public methods.
        if self._sock is None:
            self.connect()  # type: ignore[no-untyped-call]  # asks the Sentinels for the primary's address first
        super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

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
        "socket_connect_timeout": REDIS_CONNECT_TIMEOUT_S,
        "socket_timeout": REDIS_SOCKET_TIMEOUT_S,
        "health_check_interval": REDIS_HEALTH_CHECK_INTERVAL_S,
        "decode_responses": True,
        "encoding_errors": "replace",
        "client_name": name,
    }
    if not is_sentinel_url(url):
        return redis.Redis.from_url(url, **options)
    master_name, sentinels, credentials = sentinel_parts(url, settings)
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_kwargs(settings), **options)  # type: ignore[no-untyped-call,unused-ignore]
    client: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call,unused-ignore]
        master_name, redis_class=redis.Redis, connection_class=SentinelConnection, **credentials, **options
    )
    return client


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
        # redis-py's Connection is untyped; these are its public methods.
        connection.send_packed_command(connection.pack_commands(list(commands)))  # type: ignore[no-untyped-call]
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
    a refused command: a lost or refused connection, no primary known to the Sentinels, a node that
    answers ``READONLY`` because it was a primary and has just been demoted, or ``NOREPLICAS`` from a
    primary with ``min-replicas-to-write`` whose replicas are not back yet (just after a failover)."""
    if isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.ReadOnlyError)):
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
