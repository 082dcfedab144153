"""Reading jobs' audio streams (``ttsq.records.streams``) without a connection per reader: one ``XREAD``
for every stream this gateway process is reading.

A thousand clients listening to a thousand jobs must not park a thousand blocked ``XREAD`` calls on the
gateway's one bounded async pool (they would starve API-key checks and result waits). ``StreamReader``
holds one connection of that pool (the cache database's, from the process's ``RedisOwner``) and blocks
in one ``XREAD`` over all the streams its readers follow, each after the last entry id its readers
got; it hands each reader the entries after that reader's own position. A reader that opens a new
stream wakes the blocked read (``CLIENT UNBLOCK`` on the pool, one round trip) so its first entries
are not held behind the block time. The worker only ever appends: nothing here blocks a worker.

Backpressure: each reader holds at most ``buffer_bytes`` of audio it has not taken yet
(``TTSQ_GATEWAY_STREAM_BUFFER_BYTES``). A reader at its bound is left out of the shared read, so Redis,
which keeps only a window of each stream, holds what it has not read, not this process; once its client
catches up it reads on from its own position, and if the window has moved past it, its ``Playback``
continues from the stored file (``ttsq.records.playback``). A reader that goes lets go of its buffer at
once: memory follows the readers open and their bound, never the clips.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from ttsq.constants import STREAM_PREFIX
from ttsq.errors import CorruptRecord
from ttsq.records.streams import NOT_DECODED, StreamEntry, parse_entry, read_answer, xread_command

if TYPE_CHECKING:
    from redis import asyncio as aioredis

logger = logging.getLogger(__name__)

#: The shared read blocks at most this long (milliseconds) before it looks at its readers again.
BLOCK_MS = 1000
#: Entries one read takes per stream at most.
READ_COUNT = 256
#: A wake that finds the read not yet blocked tries again this often, this many times (seconds, tries).
WAKE_RETRY_S, WAKE_TRIES = 0.005, 40
#: After Redis fails a read, the next one waits this long (seconds): readers time out on their own.
RETRY_S = 0.5


class Subscription:
    """One reader of one job's stream: ``get`` the entries after the last ones it got, one read's worth
    at a time (a gap at the head of one is a trim, inside one a broken stream: ``ttsq.records.playback``)."""

    def __init__(self, task_id: str, after: str, *, buffer_bytes: int, wake: Callable[[], None]) -> None:
        self.task_id = task_id
        self.after = after
        self.buffer_bytes = buffer_bytes
        #: Bytes of audio delivered and not taken yet.
        self.buffered = 0
        self._items: collections.deque[list[StreamEntry] | CorruptRecord] = collections.deque()
        self._ready = asyncio.Event()
        self._wake = wake

    @property
    def full(self) -> bool:
        """At its bound: left out of the shared read until its client takes some."""
        return self.buffered >= self.buffer_bytes

    async def get(self, timeout: float) -> list[StreamEntry]:
        """The next entries, or ``[]`` if none came within ``timeout`` seconds; ``CorruptRecord`` if
        the stream holds an entry that cannot be read."""
        if not self._items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), timeout)
            except asyncio.TimeoutError:
                return []
        item = self._items.popleft()
        if isinstance(item, CorruptRecord):
            raise item
        was_full = self.full
        self.buffered -= _size(item)
        if was_full and not self.full:
            self._wake()  # back in the shared read, from where it stopped
        return item

    def _deliver(self, entries: list[StreamEntry]) -> None:
        fresh = [entry for entry in entries if _order(entry.id) > _order(self.after)]
        if fresh:
            self.after = fresh[-1].id
            self.buffered += _size(fresh)
            self._put(fresh)

    def _put(self, item: list[StreamEntry] | CorruptRecord) -> None:
        self._items.append(item)
        self._ready.set()


class StreamReader:
    """The gateway process's one reader of job streams. One per event loop."""

    def __init__(self, client: aioredis.Redis, *, buffer_bytes: int = 262_144) -> None:
        """``client``: the cache database's async client, from the process's ``RedisOwner``;
        ``buffer_bytes``: the audio one reader may hold that its client has not taken."""
        self._redis = client
        self.buffer_bytes = buffer_bytes
        self._subscriptions: dict[str, set[Subscription]] = {}
        self._task: asyncio.Task[None] | None = None
        self._generation = 0  # bumped by every new subscription
        self._read_generation = -1  # the generation the read in progress covers
        self._in_read = False
        self._connection_id: int | None = None
        self._joined = asyncio.Event()  # a reader joined while every other one was full

    @property
    def reading(self) -> int:
        """How many readers are open."""
        return sum(len(subscriptions) for subscriptions in self._subscriptions.values())

    @property
    def buffered(self) -> int:
        """Bytes of audio held for readers, all of them together."""
        return sum(s.buffered for subscriptions in self._subscriptions.values() for s in subscriptions)

    @contextlib.asynccontextmanager
    async def open(self, task_id: str, *, after: str = "0-0") -> AsyncIterator[Subscription]:
        """Follow ``task_id``'s stream from after ``after`` for as long as the context lasts."""
        subscription = Subscription(task_id, after, buffer_bytes=self.buffer_bytes, wake=self._rejoin)
        self._subscriptions.setdefault(task_id, set()).add(subscription)
        self._rejoin()
        try:
            yield subscription
        finally:
            subscriptions = self._subscriptions.get(task_id, set())
            subscriptions.discard(subscription)
            if not subscriptions:
                self._subscriptions.pop(task_id, None)

    def _rejoin(self) -> None:
        """A reader joins the shared read (new, or no longer full): start it, or wake it."""
        self._generation += 1
        self._joined.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="ttsq-stream-reader")
        else:
            waking = asyncio.create_task(self._wake(self._generation), name="ttsq-stream-wake")
            waking.add_done_callback(lambda task: task.exception() if not task.cancelled() else None)

    async def _wake(self, generation: int) -> None:
        """Make the blocked read start again with the new stream among its keys."""
        for _ in range(WAKE_TRIES):
            if not self._in_read or self._read_generation >= generation:
                return  # the read under way, or the next one, covers it
            if self._connection_id is not None:
                try:
                    if await self._redis.client_unblock(self._connection_id):
                        return
                except Exception:
                    return  # the read wakes by itself within BLOCK_MS
            await asyncio.sleep(WAKE_RETRY_S)  # the read's command may not have reached Redis yet

    async def _run(self) -> None:
        """Read every followed stream until no reader is left."""
        connection = self._redis.client()  # one connection of the pool, held while anyone reads
        try:
            while True:
                if not self._subscriptions:
                    # Detached before any await: a reader that opens from here on starts a new task
                    # instead of waking this one, which is going.
                    self._task, self._connection_id = None, None
                    return
                try:
                    if self._connection_id is None:
                        self._connection_id = int(await connection.client_id())
                    # Full readers are left out: Redis holds what they have not read (a window).
                    positions = {
                        STREAM_PREFIX + task_id: min(afters, key=_order)
                        for task_id, subscriptions in self._subscriptions.items()
                        if (afters := [s.after for s in subscriptions if not s.full])
                    }
                    if not positions:  # every reader is full: wait for one to take some (it sets this)
                        self._joined.clear()
                        with contextlib.suppress(asyncio.TimeoutError):
                            await asyncio.wait_for(self._joined.wait(), BLOCK_MS / 1000)
                        continue
                    self._read_generation, self._in_read = self._generation, True
                    try:
                        command = xread_command(positions, count=READ_COUNT, block_ms=BLOCK_MS)
                        answer = await connection.execute_command(  # type: ignore[no-untyped-call]
                            *command, keys=list(positions), **NOT_DECODED
                        )
                    finally:
                        self._in_read = False
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # Redis restarting: readers time out on their own if it lasts
                    logger.warning("reading job streams failed (%s); trying again", type(exc).__name__)
                    self._connection_id = None
                    await asyncio.sleep(RETRY_S)
                    continue
                for task_id, raw in read_answer(answer):
                    self._dispatch(task_id, raw)
        finally:
            with contextlib.suppress(Exception):
                await connection.aclose()

    def _dispatch(self, task_id: str, raw: list[tuple[str, dict[str, str]]]) -> None:
        subscriptions = self._subscriptions.get(task_id, set())
        try:
            entries = [parse_entry(entry_id, fields) for entry_id, fields in raw]
        except CorruptRecord as exc:
            for subscription in subscriptions:
                subscription.after = raw[-1][0]  # past it: the next read does not meet it again
                subscription._put(exc)
            return
        for subscription in subscriptions:
            if not subscription.full:
                subscription._deliver(entries)

    async def close(self) -> None:
        """Stop reading (the pool is the owner's to close)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task


def _order(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``<ms>-<seq>``) as a sortable pair."""
    ms, _, seq = entry_id.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return (0, 0)


def _size(item: list[StreamEntry] | CorruptRecord) -> int:
    return 0 if isinstance(item, CorruptRecord) else sum(len(entry.pcm) for entry in item)
