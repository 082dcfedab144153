"""Redis connections: the one factory every part of ttsq opens Redis through, and its error policy.

Every client gets ttsq's socket limits (fail fast when Redis is gone instead of hanging on a dead TCP
connection) and answers ``str`` unless asked for bytes. Failures surface as ``BrokerError`` with the
password masked; a worker's calls may be retried for a while (``patiently``) so it rides out a Redis
restart instead of failing the jobs it holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import redis

from ttsq.constants import REDIS_CONNECT_TIMEOUT_S, REDIS_HEALTH_CHECK_INTERVAL_S, REDIS_SOCKET_TIMEOUT_S
from ttsq.errors import BrokerError
from ttsq.redaction import redact_url

logger = logging.getLogger(__name__)
T = TypeVar("T")


def connect(
    url: str,
    *,
    decode: bool = True,
    socket_timeout: float = REDIS_SOCKET_TIMEOUT_S,
    connect_timeout: float = REDIS_CONNECT_TIMEOUT_S,
) -> redis.Redis:
    """A Redis client with ttsq's timeouts; ``decode=False`` answers ``bytes`` (the broker's lists)."""
    return redis.Redis.from_url(
        url,
        socket_connect_timeout=connect_timeout,
        socket_timeout=socket_timeout,
        health_check_interval=REDIS_HEALTH_CHECK_INTERVAL_S,
        decode_responses=decode,
    )


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
