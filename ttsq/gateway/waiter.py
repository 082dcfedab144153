"""Waiting for results without a thread per waiter: one Redis subscription per gateway process.

Celery's Redis result backend stores a task's state under ``celery-task-meta-<id>`` and publishes it on
a channel of the same name. A gateway holding a thousand requests open for their audio must not park a
thread (and a connection) on each, as ``AsyncResult.get`` would: ``ResultWaiter`` holds one pattern
subscription to every result channel on one connection (no subscribe and unsubscribe per request;
a message nobody here awaits is dropped unread), reads a waiter's key once after registering it (so a
result stored in between is not missed), and wakes the waiter when a final state arrives. If a message
is missed anyway (the connection dropped and came back), every waiter reads its key again every few
seconds. What it reads is read by ttsq's one reader of stored results (``ttsq.results.read_result``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

from ttsq.errors import BrokerError, CorruptRecord, JobTimeout
from ttsq.results import StoredResult, read_result

if TYPE_CHECKING:
    from redis import asyncio as aioredis

logger = logging.getLogger(__name__)

#: Celery's Redis result backend keeps a task's state under this prefix and publishes on the same name.
RESULT_KEY_PREFIX = "celery-task-meta-"
#: How often a waiter reads its key again, whatever the subscription says (seconds).
RECHECK_S = 2.0


class ResultWaiter:
    """Async waits for Celery task results on the result backend's Redis. One per event loop."""

    def __init__(self, client: aioredis.Redis) -> None:
        """``client``: the result backend's database, from the process's ``RedisOwner`` (a bounded pool:
        a thousand waiters share a few dozen connections)."""
        self._redis = client
        self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        self._waiters: dict[str, set[asyncio.Future[StoredResult]]] = {}
        self._reader: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """How many waits are open."""
        return sum(len(futures) for futures in self._waiters.values())

    async def stored(self, task_id: str) -> StoredResult:
        """What the result backend holds for a task (PENDING: nothing)."""
        try:
            raw = await self._redis.get(RESULT_KEY_PREFIX + task_id)
        except Exception as exc:
            raise BrokerError(f"cannot reach the result backend: {type(exc).__name__}") from exc
        return read_result(raw, task_id)

    async def wait(self, task_id: str, timeout: float) -> StoredResult:
        """The task's stored result once its state is final (SUCCESS, FAILURE, REVOKED); ``JobTimeout``
        after ``timeout`` seconds."""
        channel = RESULT_KEY_PREFIX + task_id
        loop = asyncio.get_running_loop()
        future: asyncio.Future[StoredResult] = loop.create_future()
        deadline = loop.time() + timeout
        self._waiters.setdefault(channel, set()).add(future)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read(), name="ttsq-result-reader")
        try:
            while True:
                stored = await self.stored(task_id)  # after registering: nothing stored in between is missed
                if stored.done:
                    return stored
                left = deadline - loop.time()
                if left <= 0:
                    raise JobTimeout(f"job {task_id} not done after {timeout:.0f}s")
                with contextlib.suppress(asyncio.TimeoutError):
                    return await asyncio.wait_for(asyncio.shield(future), min(left, RECHECK_S))
        finally:
            waiters = self._waiters.get(channel, set())
            waiters.discard(future)
            if not waiters:
                self._waiters.pop(channel, None)

    async def _read(self) -> None:
        """Read every result publication, for the life of the process (one pattern subscription: a
        subscribe per waiter would cost two more Redis round trips a request); wake the waiters of
        final states."""
        subscribed = False
        while True:
            try:
                if not subscribed:
                    await self._pubsub.psubscribe(RESULT_KEY_PREFIX + "*")
                    subscribed = True
                message = await self._pubsub.get_message(timeout=1.0)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis restarting: waiters fall back to reading their keys
                logger.warning("result subscription lost (%s); waiters read their results directly", type(exc).__name__)
                subscribed = False
                await asyncio.sleep(RECHECK_S)
                continue
            if not message or message.get("type") != "pmessage":
                continue
            futures = self._waiters.get(_text(message["channel"]))
            if not futures:
                continue  # a result nobody here waits for: not even decoded
            try:
                stored = read_result(message["data"], _text(message["channel"]).removeprefix(RESULT_KEY_PREFIX))
            except CorruptRecord:
                continue  # the waiter reads the key itself and reports it
            if stored.done:
                for future in futures:
                    if not future.done():
                        future.set_result(stored)

    async def close(self) -> None:
        """Stop reading and give the subscription's connection back (the pool is the owner's to close)."""
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(BaseException):
                await self._reader
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
