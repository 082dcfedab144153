"""How ttsq opens one Redis client, and its error policy; ``ttsq.records.owner`` is the only caller of ``connect``.

Every client gets ttsq's socket limits (fail fast when Redis is gone instead of hanging on a dead TCP
connection), answers ``str``, and names its connections (``CLIENT SETNAME``). Failures surface as
``BrokerError`` with the password masked; a worker's calls may be retried for a while (``patiently``)
so it rides out a Redis restart instead of failing the jobs it holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import redis

from ttsq.constants import REDIS_CONNECT_TIMEOUT_S, REDIS_HEALTH_CHECK_INTERVAL_S, REDIS_SOCKET_TIMEOUT_S
from ttsq.errors import BrokerError
from ttsq.redaction import redact_url

logger = logging.getLogger(__name__)
T = TypeVar("T")


def connect(url: str, *, name: str | None = None) -> redis.Redis:
    """A Redis client (one connection pool) with ttsq's timeouts, its connections named ``name``.

    Answers are ``str``; a byte that is not UTF-8 (a raw message someone pushed onto a queue) reads as
    U+FFFD instead of failing a metrics scrape or a search of the queue for a task id.
    """
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        health_check_interval=REDIS_HEALTH_CHECK_INTERVAL_S,
        decode_responses=True,
        encoding_errors="replace",
        client_name=name,
    )


def address(client: redis.Redis) -> str:
    """Where ``client`` connects, as a URL with the password masked, for messages and logs."""
    kwargs = client.get_connection_kwargs()
    db = kwargs.get("db") or 0
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
            if not isinstance(exc.__cause__, redis.exceptions.ConnectionError) or time.monotonic() >= give_up:
                raise
            logger.warning("Redis at %s unreachable; trying again", redact_url(url))
            time.sleep(0.5)


@contextmanager
def redis_errors(url: str) -> Iterator[None]:
    """Redis failures as ``BrokerError``, with the password masked."""
    try:
        yield
    except redis.exceptions.ConnectionError as exc:
        raise BrokerError(f"cannot reach the cache Redis at {redact_url(url)}: {exc}") from exc
    except redis.exceptions.RedisError as exc:
        raise BrokerError(f"cache Redis at {redact_url(url)} failed: {exc}") from exc
