"""The cache index in Redis: content key → stored object, plus single-flight claims.

The index is written only after the object is stored, so an entry never points at nothing. A
single-flight claim (``SET NX EX``) makes concurrent identical submits, from any producer on any
host, share the one task that is already producing the audio.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from ttsq.constants import (
    CACHE_PREFIX,
    CANCELLED_PREFIX,
    FLEET_PREFIX,
    IDENTITY_MAX_AGE_S,
    INFLIGHT_PREFIX,
    STATS_PREFIX,
)
from ttsq.records.connection import connect, patiently

if TYPE_CHECKING:
    import redis

    from ttsq.job import StoredAudio

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Delete the claim only if it is still ours: a claim that expired and was re-taken by another
# producer must not be released by the first job finishing late.
_RELEASE_IF_OWNER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""


class CacheIndex:
    """Content-key index, single-flight claims, engine identities and counters in one Redis DB."""

    def __init__(self, url: str, *, ttl_s: int, patience_s: float = 0.0) -> None:
        self.url = url
        self.ttl_s = ttl_s
        self.patience_s = patience_s
        self._redis = connect(url)

    def get(self, key: str) -> StoredAudio | None:
        """The index entry for a content key, if the audio is stored."""
        raw = self._do(lambda: self._redis.get(CACHE_PREFIX + key))
        return None if raw is None else json.loads(raw)

    def put(self, key: str, entry: StoredAudio) -> None:
        """Index stored audio; call only once the object is in storage."""
        payload = json.dumps(entry, sort_keys=True)
        self._do(lambda: self._redis.set(CACHE_PREFIX + key, payload, ex=self.ttl_s or None))

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
        """Drop the claim on ``key`` if ``task_id`` still holds it."""
        self._do(lambda: self._redis.eval(_RELEASE_IF_OWNER, 1, INFLIGHT_PREFIX + key, task_id))

    def publish_identity(self, queue: str, identity: dict[str, Any]) -> None:
        """A worker announces the model it serves, under each of its modes, so producers can predict
        content keys and route (or refuse) each mode. Live workers repeat it with every heartbeat.
        ``queue`` is the deployment's base queue (``TTSQ_QUEUE``): deployments sharing a Redis stay apart."""
        payload = json.dumps({**identity, "announced_at": time.time()}, sort_keys=True)
        modes = identity.get("modes") or ("voice_design",)
        self._do(lambda: self._redis.hset(FLEET_PREFIX + queue, mapping=dict.fromkeys(modes, payload)))

    def read_identities(self, queue: str, max_age_s: float = IDENTITY_MAX_AGE_S) -> dict[str, dict[str, Any]]:
        """The models announced by live workers of the deployment ``queue``, by mode (empty: none running)."""
        raw = self._do(lambda: self._redis.hgetall(FLEET_PREFIX + queue))
        now, live = time.time(), {}
        for mode, value in raw.items():
            identity = json.loads(value)
            if now - float(identity.pop("announced_at", 0.0)) <= max_age_s:
                live[str(mode)] = identity
        return live

    def cancel(self, task_id: str, *, ttl_s: int) -> None:
        """Mark a job cancelled: a worker that receives its message (or one of its chunks') drops it."""
        self._do(lambda: self._redis.set(CANCELLED_PREFIX + task_id, 1, ex=ttl_s))

    def count(self, name: str, amount: int = 1) -> None:
        """Add to a counter (``ttsq:stats:<name>``)."""
        self._do(lambda: self._redis.incrby(STATS_PREFIX + name, amount))

    def counter(self, name: str) -> int:
        """A counter's value (0 if never counted)."""
        return int(self._do(lambda: self._redis.get(STATS_PREFIX + name)) or 0)

    def read(self, call: Callable[[redis.Redis], T]) -> T:
        """Run a read of another record kept in this database (documents), with the same error handling."""
        return self._do(lambda: call(self._redis))

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()

    def _do(self, call: Callable[[], T]) -> T:
        return patiently(call, self.url, self.patience_s)
