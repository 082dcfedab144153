"""A lease in Redis: one holder at a time, renewed while it works, lost on its own when the holder dies.

The sweeper (``ttsq.worker.sweeper``) runs on the one worker of a deployment that holds its lease.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ttsq.records.scripts import register

if TYPE_CHECKING:
    import redis


class Lease:
    """The lease ``key``, as ``holder`` (a worker's node name) takes, renews and gives it up."""

    def __init__(self, client: redis.Redis, key: str, holder: str, *, ttl_s: float) -> None:
        self.key = key
        self.holder = holder
        self.ttl_ms = int(ttl_s * 1000)
        self._redis = client
        self._renew = register(client, "renew_if_holder")
        self._release = register(client, "release_if_holder")

    def take(self) -> bool:
        """Take the lease if nobody holds it; whether this call took it."""
        return bool(self._redis.set(self.key, self.holder, nx=True, px=self.ttl_ms))

    def renew(self) -> bool:
        """Extend the lease if ``holder`` still holds it; whether it does."""
        return bool(self._renew(keys=[self.key], args=[self.holder, self.ttl_ms]))

    def give_up(self) -> None:
        """Let another holder take the lease now rather than when it expires."""
        self._release(keys=[self.key], args=[self.holder])
