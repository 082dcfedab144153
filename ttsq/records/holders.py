"""Holders: which worker process holds which unacknowledged message, so a dead one's go back at once.

kombu's Redis transport keeps every delivered, unacknowledged message in one hash (``unacked``) and
gives it back to its queue only when it is older than the visibility timeout (an hour by default):
it cannot tell a message held by a dead process from one a live worker is still running. Each worker
process (an *incarnation*: its node name and pid) therefore keeps, in the broker's database beside
kombu's hash, the set of delivery tags it holds (``ttsq:held:<incarnation>``, written in the same
pipelines as kombu's own bookkeeping, ``ttsq.delivery.transport``) and a heartbeat (``ttsq:holder:<incarnation>``,
a short TTL, renewed every few seconds). When the heartbeat is gone, or the launcher that saw the
process die marks it dead, ``ttsq.worker.recovery`` gives exactly those tags back: never a message a
live process holds. Why this is safe and what stays for the visibility timeout: docs/guarantees.md,
"A worker that dies".
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from ttsq.constants import HELD_PREFIX, HOLDER_PREFIX, HOLDERS_KEY, UNACKED_INDEX_KEY, UNACKED_KEY
from ttsq.records.scripts import register

if TYPE_CHECKING:
    from collections.abc import Collection

    import redis

#: What the launcher writes in place of a heartbeat when it has seen the process exit.
DEAD = "dead"
#: How long a dead mark stays: long enough for any worker to act on it.
DEAD_MARK_TTL_S = 300


def incarnation(node: str, pid: int) -> str:
    """The name of one worker process: its node name and pid (a restarted worker is a new incarnation)."""
    return f"{node}#{pid}"


def held_key(name: str) -> str:
    """The set of delivery tags incarnation ``name`` holds (in the broker's database)."""
    return HELD_PREFIX + name


class Holders:
    """The worker processes holding messages, and their heartbeats, in the broker's database."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client
        self._claim = register(client, "claim_held")
        self._retire = register(client, "retire_holder")

    def beat(self, name: str, *, ttl_s: float, info: dict[str, Any] | None = None) -> None:
        """Incarnation ``name`` is alive for ``ttl_s`` more seconds."""
        record = json.dumps({**(info or {}), "at": time.time()}, sort_keys=True)
        pipe = self._redis.pipeline()
        pipe.sadd(HOLDERS_KEY, name)
        pipe.set(HOLDER_PREFIX + name, record, px=int(ttl_s * 1000))
        pipe.execute()

    def mark_dead(self, name: str) -> None:
        """The launcher saw incarnation ``name`` exit: whatever it held may go back now."""
        pipe = self._redis.pipeline()
        pipe.sadd(HOLDERS_KEY, name)
        pipe.set(HOLDER_PREFIX + name, DEAD, ex=DEAD_MARK_TTL_S)
        pipe.execute()

    def states(self) -> dict[str, str]:
        """Every known incarnation: ``alive``, ``dead`` (marked by its launcher) or ``silent`` (no heartbeat)."""
        names = sorted(str(name) for name in self._redis.smembers(HOLDERS_KEY))
        if not names:
            return {}
        values = self._redis.mget([HOLDER_PREFIX + name for name in names])
        return {
            name: "silent" if value is None else DEAD if value == DEAD else "alive"
            for name, value in zip(names, values, strict=True)
        }

    def server(self) -> str:
        """The run id of the Redis these records are read from: it changes when Redis restarts or fails
        over, which may lose the heartbeats."""
        return str(self._redis.info("server").get("run_id", ""))

    def held(self, name: str) -> list[str]:
        """The delivery tags incarnation ``name`` still holds."""
        return sorted(str(tag) for tag in self._redis.smembers(held_key(name)))

    def keep_alive(self, tags: Collection[str]) -> int:
        """Renew the delivery time of ``tags``, the messages a live process is still working on, so that
        kombu's visibility timeout never gives them to a second worker (a long stitch, a long batch):
        what a dead process held goes back through recovery instead. Return how many were renewed."""
        if not tags:
            return 0
        now = time.time()  # kombu's clock for the index: the worker host's, as when it delivered them
        # XX: only tags still in kombu's index; one acked meanwhile is not brought back.
        return int(self._redis.zadd(UNACKED_INDEX_KEY, dict.fromkeys(tags, now), xx=True, ch=True) or 0)

    def acknowledge(self, name: str, tags: Collection[str]) -> int:
        """Acknowledge ``tags`` that incarnation ``name`` finished after the connection they came on was
        lost: drop them from kombu's ``unacked`` hash and index and from ``name``'s set, as kombu's own ack
        does, in one transaction. Return how many were still there.

        Only for entries of ``name``'s own whose job has its final result, and no copy of which ``name``
        runs again (``ttsq.delivery.acks.on_new_connection``, read through ``entries`` just before): the
        rest are left to whoever holds them, or given back. kombu's ``restore_by_tag`` watches the hash,
        so a tag is never both given back and dropped."""
        if not tags:
            return 0
        pipe = self._redis.pipeline(transaction=True)
        pipe.hdel(UNACKED_KEY, *tags)
        pipe.zrem(UNACKED_INDEX_KEY, *tags)
        pipe.srem(held_key(name), *tags)
        return int(pipe.execute()[0] or 0)

    def entries(self, name: str, tags: Collection[str]) -> dict[str, tuple[Any, bool]]:
        """kombu's ``unacked`` entry of each of ``tags`` (None where it is gone), and whether incarnation
        ``name``'s held set has the tag."""
        ordered = list(tags)
        if not ordered:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        pipe.hmget(UNACKED_KEY, ordered)
        for tag in ordered:
            pipe.sismember(held_key(name), tag)
        raws, *mine = pipe.execute()
        return {tag: (raw, bool(held)) for tag, raw, held in zip(ordered, raws, mine, strict=True)}

    def claim(self, name: str, tag: str, *, into: str) -> bool:
        """Move ``tag`` from incarnation ``name``'s held set to ``into``'s (the process about to give it
        back), unless ``name`` beats again or another process moved it first: whether ``into`` may give
        it back."""
        keys = [HOLDER_PREFIX + name, held_key(name), held_key(into)]
        return bool(self._claim(keys=keys, args=[tag, DEAD]))

    def retire(self, name: str) -> bool:
        """Forget incarnation ``name``, whose messages went back, unless it beats again or still holds a
        tag; whether it was forgotten."""
        keys = [HOLDERS_KEY, HOLDER_PREFIX + name, held_key(name)]
        return bool(self._retire(keys=keys, args=[name, DEAD]))
