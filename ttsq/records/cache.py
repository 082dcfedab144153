"""The cache index in Redis: content key → stored object, plus single-flight claims.

The index is written only after the object is stored, so an entry never points at nothing. A
single-flight claim (``SET NX EX``) makes concurrent identical submits, from any producer on any
host, share the one task that is already producing the audio.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ttsq.constants import CACHE_PREFIX, INFLIGHT_PREFIX
from ttsq.document import read_document
from ttsq.records.connection import address, patiently
from ttsq.records.scripts import register

if TYPE_CHECKING:
    import redis

    from ttsq.job import StoredAudio

T = TypeVar("T")


class CacheIndex:
    """Content-key index and single-flight claims in the cache database."""

    def __init__(self, client: redis.Redis, *, ttl_s: int, patience_s: float = 0.0) -> None:
        self.url = address(client)
        self.ttl_s = ttl_s
        self.patience_s = patience_s
        self._redis = client
        self._release = register(client, "release_if_holder")

    def get(self, key: str) -> StoredAudio | None:
        """The index entry for a content key, if the audio is stored."""
        raw = self._do(lambda: self._redis.get(CACHE_PREFIX + key))
        return None if raw is None else json.loads(raw)

    def put(self, key: str, entry: StoredAudio) -> None:
        """Index stored audio; call only once the object is in storage."""
        payload = json.dumps(entry, sort_keys=True)
        self._do(lambda: self._redis.set(CACHE_PREFIX + key, payload, ex=self.ttl_s or None))

    def document(self, key: str) -> dict[str, Any] | None:
        """The index record of a stitched document (``ttsq.document``), if there is one."""
        return self._do(lambda: read_document(self._redis, key))

    def claim(self, key: str, task_id: str, ttl_s: int) -> str | None:
        """Claim the right to produce ``key``; return None if claimed, else the owner's task id."""

        def attempt() -> str | None:
            if self._redis.set(INFLIGHT_PREFIX + key, task_id, nx=True, ex=ttl_s):
                return None
            owner = self._redis.get(INFLIGHT_PREFIX + key)
            # The owner released between our SET and GET: try once more rather than report nobody.
            if owner is None and self._redis.set(INFLIGHT_PREFIX + key, task_id, nx=True, ex=ttl_s):
                return None
            return owner if isinstance(owner, str) else None

        return self._do(attempt)

    def release(self, key: str, task_id: str) -> None:
        """Drop the claim on ``key`` if ``task_id`` still holds it: a claim that expired and was taken
        by another producer is not released by this job finishing late."""
        self._do(lambda: self._release(keys=[INFLIGHT_PREFIX + key], args=[task_id]))

    def _do(self, call: Callable[[], T]) -> T:
        return patiently(call, self.url, self.patience_s)
