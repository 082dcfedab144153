"""The accepted-job ledger: every job a producer accepted, from its submit until it has a final result.

kombu can lose a message between popping it and recording it as unacknowledged, and nothing in Celery
notices; this record, in the cache database and timed by Redis's own clock, is what the sweeper sends
lost jobs again from. What each step records and when a job counts as lost: docs/guarantees.md, "Lost
jobs".

While a queue's list is full, an accepted job may wait in its tenant's place instead of being sent
(``defer``), until a worker releases it in round robin between tenants (``release``; docs/scheduling.md).
Under a per-tenant cap (``TTSQ_TENANT_MAX_IN_FLIGHT``), a job also waits while its tenant has that many
jobs in flight; a job sent counts in its tenant's zset of task ids until ``finish``, and ``age_in_flight``
drops members whose job ended some other way.

Why one file over 400 lines: it is the job's one record, every script that writes it and every reader of
it; split, the fields one script writes and another reads would live in two places.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ttsq.constants import (
    ACCEPTED_PREFIX,
    ACCEPTED_TTL_S,
    CHORD_HEADER,
    CHUNKS_SUFFIX,
    DEFERRED_PREFIX,
    IN_FLIGHT_AGED_PREFIX,
    RECEIVED_KEY,
    SEQ_PREFIX,
    STITCH_TASK_NAME,
    TENANT_IN_FLIGHT_PREFIX,
    TENANT_PATTERN,
    TENANT_SET_PREFIX,
    TENANTS_IN_FLIGHT_PREFIX,
    TENANTS_PREFIX,
    TURNS_PREFIX,
    UNSEEN_PREFIX,
    WATERMARK_PREFIX,
)
from ttsq.records.connection import address, patiently
from ttsq.records.scripts import register

if TYPE_CHECKING:
    from collections.abc import Mapping

    import redis


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


#: The states a worker settles, as the record writes them (docs/guarantees.md, "A job's lifecycle"),
#: and back.
_OUTCOMES: Mapping[str, str] = {"SUCCESS": "done", "FAILURE": "failed"}
_CELERY_STATES: Mapping[str, str] = {written: state for state, written in _OUTCOMES.items()}


class AcceptedJobs:
    """The ledger in the cache database. Producers accept and forget, workers mark, the sweeper reads.

    A record is the job's one record in the ledger. Its ``state`` is what each script of the ledger
    writes as it moves the job (``accepted``, ``deferred``, ``running``, and the outcomes ``done``,
    ``failed`` and ``cancelled``: cancel and settle decide between the last three on this one field).
    A record also says whose job it is (``owner``: the tenant that submitted it) and, for a job that
    follows another tenant's identical synthesis, which job that is (``follows``). Those two fields and
    a cancel outlive the job's other fields by ``keep_s`` (the results' lifetime): the jobs API answers
    an id only to its owner (docs/security.md, "Tenants"); a settled outcome outlives them by
    ``outcome_s`` (as long as the job can be in flight: after that its stored result answers)."""

    def __init__(
        self,
        client: redis.Redis,
        *,
        patience_s: float = 0.0,
        ttl_s: int = ACCEPTED_TTL_S,
        keep_s: int = 0,
        outcome_s: int = 0,
    ) -> None:
        self.url = address(client)
        self.patience_s = patience_s
        self.ttl_s = ttl_s
        self.keep_s = keep_s
        self.outcome_s = outcome_s
        self._redis = client
        self._accept = register(client, "accept")
        self._received = register(client, "received")
        self._finish = register(client, "finish")
        self._touch = register(client, "touch")
        self._defer = register(client, "defer")
        self._release = register(client, "release")
        self._age_in_flight = register(client, "age_in_flight")
        self._cancel = register(client, "cancel")
        self._settle = register(client, "settle")

    def accept(
        self,
        task_id: str,
        *,
        task: str,
        queue: str,
        kwargs: Mapping[str, Any],
        headers: Mapping[str, Any],
        owner: str = "",
    ) -> int:
        """Record a job about to be sent (or sent again); return its seq, the header to send it with.
        ``owner``: the tenant whose job it is ("" for none)."""
        keys = [ACCEPTED_PREFIX + task_id, UNSEEN_PREFIX + queue, SEQ_PREFIX + queue, RECEIVED_KEY]
        args: list[str | int] = [
            task_id,
            task,
            queue,
            json.dumps(kwargs, ensure_ascii=False),
            json.dumps(headers),
            self.ttl_s,
            owner,
        ]
        return int(patiently(lambda: self._accept(keys=keys, args=args), self.url, self.patience_s))

    def defer(
        self,
        task_id: str,
        *,
        queue: str,
        tenant: str,
        window: int,
        cap: int = 0,
        scope: str = "",
        headers: Mapping[str, Any] | None = None,
    ) -> bool:
        """Keep an accepted job in its tenant's place instead of sending it, if ``queue`` already has
        ``window`` jobs no worker has received (0: no window), ``tenant`` has jobs waiting there, or
        ``tenant`` has ``cap`` jobs in flight in the deployment ``scope`` (its base queue; 0: no cap);
        True if it waits. A job sent under a cap counts against its tenant from here until ``finish``.
        ``headers``: what its release sends it with instead of the recorded ones (its sender's trace)."""
        keys = [
            ACCEPTED_PREFIX + task_id,
            UNSEEN_PREFIX + queue,
            f"{DEFERRED_PREFIX}{queue}:{tenant}",
            TENANTS_PREFIX + queue,
            TENANT_SET_PREFIX + queue,
            _in_flight_prefix(scope) + tenant,
            TENANTS_IN_FLIGHT_PREFIX + scope,
        ]
        args: list[str | int] = [task_id, tenant, window, cap, "" if headers is None else json.dumps(headers)]
        return bool(patiently(lambda: self._defer(keys=keys, args=args), self.url, self.patience_s))

    def release(
        self,
        queues: list[str],
        *,
        window: int,
        most: int,
        weights: Mapping[str, int] | None = None,
        cap: int = 0,
        scope: str = "",
    ) -> list[AcceptedJob]:
        """Take up to ``most`` deferred jobs of ``queues`` into the room their lists have (``window``
        unseen jobs each; 0: no window), in round robin between tenants (``weights``: jobs per turn, 1 by
        default), none of a tenant with ``cap`` jobs in flight in ``scope`` (0: no cap); each has a new
        seq and is to be sent now. A job cancelled while it waited is not released."""
        prefixes = [ACCEPTED_PREFIX, DEFERRED_PREFIX, TENANTS_PREFIX, TENANT_SET_PREFIX, TURNS_PREFIX]
        args: list[str | int] = [
            window,
            most,
            json.dumps(dict(weights or {})),
            *prefixes,
            UNSEEN_PREFIX,
            SEQ_PREFIX,
            cap,
            _in_flight_prefix(scope),
            TENANTS_IN_FLIGHT_PREFIX + scope,
            CHUNKS_SUFFIX,
            *queues,
        ]
        flat = cast("list[Any]", self._release(keys=[], args=args))
        released = []
        for at in range(0, len(flat), 6):
            queue, task_id, task, kwargs, headers, seq = (str(value) for value in flat[at : at + 6])
            job = _job(task_id, {"task": task, "queue": queue, "kwargs": kwargs, "headers": headers, "seq": seq})
            if job is not None:
                released.append(job)
        return released

    def deferred(self, queue: str) -> dict[str, int]:
        """Jobs waiting to be released from ``queue``, per tenant (a job cancelled while it waits counts
        until its turn comes)."""
        tenants = [str(t) for t in self._redis.lrange(TENANTS_PREFIX + queue, 0, -1)]
        if not tenants:
            return {}
        with self._redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.llen(f"{DEFERRED_PREFIX}{queue}:{tenant}")
            counts = pipe.execute()
        return {tenant: int(count) for tenant, count in zip(tenants, counts, strict=True) if count}

    def in_flight(self, scope: str) -> dict[str, int]:
        """Jobs in flight per tenant in the deployment ``scope`` (its base queue), as the cap counts them
        (only while ``TTSQ_TENANT_MAX_IN_FLIGHT`` is on). A name ttsq would not write is left out: it is shown."""
        members = (str(t) for t in self._redis.smembers(TENANTS_IN_FLIGHT_PREFIX + scope))
        tenants = sorted(t for t in members if TENANT_PATTERN.fullmatch(t))
        if not tenants:
            return {}
        prefix = _in_flight_prefix(scope)
        with self._redis.pipeline(transaction=False) as pipe:
            for tenant in tenants:
                pipe.zcard(prefix + tenant)
            counts = pipe.execute()
        return {tenant: int(count) for tenant, count in zip(tenants, counts, strict=True) if count}

    def in_flight_ids(self, scope: str, tenant: str) -> list[str]:
        """The task ids counted against ``tenant``'s cap in ``scope``, oldest first."""
        return [str(task_id) for task_id in self._redis.zrange(_in_flight_prefix(scope) + tenant, 0, -1)]

    def age_in_flight(self, scope: str, *, every_s: int = 0) -> int:
        """Drop from the tenants' in-flight counts of ``scope`` every job that ended without ``finish``
        (its record expired or was replaced); return how many. A backstop the releasers run now and then:
        with ``every_s``, only if no worker did in the last ``every_s`` seconds (one aging a period, fleet-wide)."""
        keys = [TENANTS_IN_FLIGHT_PREFIX + scope, IN_FLIGHT_AGED_PREFIX + scope]
        args: list[str | int] = [_in_flight_prefix(scope), ACCEPTED_PREFIX, every_s]
        return int(patiently(lambda: self._age_in_flight(keys=keys, args=args), self.url, self.patience_s))

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
            ACCEPTED_PREFIX + (document or task_id),
        ]
        args: list[str | int] = [task_id, task, "" if seq is None else seq, "1" if plain else "0"]
        return Receipt(int(self._received(keys=keys, args=args)))

    def touch(self, task_id: str) -> None:
        """A received job is making progress (a document's chunk finished): its staleness starts over."""
        self._touch(keys=[ACCEPTED_PREFIX + task_id, RECEIVED_KEY], args=[task_id])

    def finish(self, task_id: str) -> None:
        """The job has its final result: drop its record, all but its owner (kept ``keep_s``)."""
        self._close(task_id, self.keep_s)

    def forget(self, task_id: str) -> None:
        """A job that was never sent after all (the send failed, or the submit joined another job): drop
        its record whole."""
        self._close(task_id, 0)

    def _close(self, task_id: str, keep_s: int) -> None:
        keys = [ACCEPTED_PREFIX + task_id, RECEIVED_KEY]
        args: list[str | int] = [task_id, UNSEEN_PREFIX, keep_s, self.outcome_s or keep_s]
        patiently(lambda: self._finish(keys=keys, args=args), self.url, self.patience_s)

    def follow(self, task_id: str, *, owner: str, source: str, ttl_s: int) -> None:
        """Record a job of ``owner``'s that is never sent: it follows ``source``, another tenant's identical
        job already under way, whose stream and result carry its audio (``ttsq.client.Client.submit``)."""
        key = ACCEPTED_PREFIX + task_id

        def write() -> None:
            with self._redis.pipeline(transaction=True) as pipe:
                pipe.hset(key, mapping={"owner": owner, "follows": source})
                pipe.expire(key, ttl_s)
                pipe.execute()

        patiently(write, self.url, self.patience_s)

    def owner(self, task_id: str) -> tuple[str, str] | None:
        """Whose job ``task_id`` is and the job it follows ("" for its own synthesis), while its record or
        what finishing left of it lasts; None for a job ttsq keeps no record of (never accepted, expired,
        or sent by a web backend without ttsq)."""
        key = ACCEPTED_PREFIX + task_id
        raw = patiently(lambda: self._redis.hmget(key, "owner", "follows", "task"), self.url, self.patience_s)
        owner, follows, task = (None if value is None else str(value) for value in cast("list[Any]", raw))
        if owner is None and follows is None and task is None:
            return None
        return owner or "", follows or ""

    def cancel(self, task_id: str, *, ttl_s: int) -> str | None:
        """Cancel a job unless its worker has settled it (``settle``), in one transition on its record:
        None when the cancel won (its state is ``cancelled``, kept at least ``ttl_s``: a worker that
        receives its message, or one of its chunks', drops it, and one that runs it ends it REVOKED), else
        the state the worker settled (SUCCESS or FAILURE)."""
        keys = [ACCEPTED_PREFIX + task_id]
        settled = patiently(lambda: self._cancel(keys=keys, args=[ttl_s]), self.url, self.patience_s)
        return _CELERY_STATES.get(str(settled))

    def settle(self, task_id: str, state: str, *, ttl_s: int) -> bool:
        """A worker has the job's outcome (``state``: SUCCESS or FAILURE): True if it stands (kept at least
        ``ttl_s``, so a later cancel answers it), False if the job was cancelled first and ends REVOKED."""
        keys = [ACCEPTED_PREFIX + task_id]
        args: list[str | int] = [_OUTCOMES[state], ttl_s]
        return bool(patiently(lambda: self._settle(keys=keys, args=args), self.url, self.patience_s))

    def cancelled(self, task_id: str) -> bool:
        """Whether the job was cancelled (a worker about to synthesize it need not: it ends REVOKED)."""
        key = ACCEPTED_PREFIX + task_id
        return patiently(lambda: self._redis.hget(key, "state"), self.url, self.patience_s) == "cancelled"

    def state(self, task_id: str) -> str | None:
        """What the job's record says of it (``accepted``, ``deferred``, ``running``, ``done``, ``failed``
        or ``cancelled``: docs/guarantees.md, "A job's lifecycle"), None for no record."""
        key = ACCEPTED_PREFIX + task_id
        found = patiently(lambda: self._redis.hget(key, "state"), self.url, self.patience_s)
        return None if found is None else str(found)

    def unsettle(self, task_id: str) -> None:
        """Forget a settled outcome: the job is sent again (``ttsq retry``) and may be cancelled anew."""
        key = ACCEPTED_PREFIX + task_id
        patiently(lambda: self._redis.hdel(key, "state"), self.url, self.patience_s)

    def get(self, task_id: str) -> AcceptedJob | None:
        """The record of an accepted, unfinished job."""
        raw = patiently(lambda: self._redis.hgetall(ACCEPTED_PREFIX + task_id), self.url, self.patience_s)
        return _job(task_id, cast("dict[str, str]", raw)) if raw else None

    def exists(self, task_id: str) -> bool:
        """Whether ttsq accepted this job and it has not finished (what finishing leaves is not the job)."""
        key = ACCEPTED_PREFIX + task_id
        return bool(patiently(lambda: self._redis.hexists(key, "task"), self.url, self.patience_s))

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

    def tasks(self, task_ids: list[str]) -> dict[str, str]:
        """The task each of ``task_ids`` names in its record (those without a record left out), in one
        round trip."""
        with self._redis.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                pipe.hget(ACCEPTED_PREFIX + task_id, "task")
            found = pipe.execute()
        return {task_id: str(task) for task_id, task in zip(task_ids, found, strict=True) if task is not None}

    def drop_unseen(self, queue: str, task_id: str) -> None:
        """Take a job without a record out of the unseen set (its record expired)."""
        self._redis.zrem(UNSEEN_PREFIX + queue, task_id)

    def now(self) -> float:
        """Redis's clock (seconds), the one every ledger time is on."""
        seconds, micros = self._redis.time()
        return float(seconds) + float(micros) / 1e6


def _in_flight_prefix(scope: str) -> str:
    """The prefix of the per-tenant in-flight zsets of one deployment (its base queue)."""
    return f"{TENANT_IN_FLIGHT_PREFIX}{scope}:"


def _job(task_id: str, raw: Mapping[str, str]) -> AcceptedJob | None:
    try:
        headers = json.loads(raw["headers"])
        if CHORD_HEADER in headers and not _chord_place_ok(headers[CHORD_HEADER]):
            return None  # a document chunk's place no fan-out wrote: nothing sends it on
        return AcceptedJob(
            task_id=task_id,
            task=raw["task"],
            queue=raw["queue"],
            kwargs=json.loads(raw["kwargs"]),
            headers=headers,
            seq=int(raw["seq"]),
            accepted_at=float(raw.get("accepted_at", 0.0)),
            seen_at=float(raw["seen_at"]) if "seen_at" in raw else None,
        )
    except (KeyError, ValueError, TypeError, AttributeError):
        return None  # not a record ttsq wrote: treated as absent


def _chord_place_ok(place: Any) -> bool:
    """Whether a chunk's place in its document's chord (``CHORD_HEADER``) is what a fan-out writes: a
    group id, an index and a stitch as the chord's body, which whoever sends the chunk sends on."""
    return (
        isinstance(place, dict)
        and isinstance(place.get("group"), str)
        and isinstance(place.get("index"), int)
        and isinstance(place.get("body"), dict)
        and place["body"].get("task") == STITCH_TASK_NAME
    )
