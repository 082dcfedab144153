"""Engine identities: the model each mode of a deployment is served by, announced by its live workers.

A worker announces its model under each of its modes when it starts and with every heartbeat;
producers read them to predict content keys and to route (or refuse) each mode. An announcement that
is not repeated goes stale: a mode whose workers all stopped is no longer served.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from ttsq.constants import FLEET_PREFIX, IDENTITY_MAX_AGE_S
from ttsq.records.connection import address, patiently

if TYPE_CHECKING:
    import redis


class Identities:
    """The identities announced per deployment (``ttsq:fleet:<queue>``), in the cache database."""

    def __init__(self, client: redis.Redis, *, patience_s: float = 0.0) -> None:
        self.url = address(client)
        self.patience_s = patience_s
        self._redis = client

    def publish(self, queue: str, identity: dict[str, Any]) -> None:
        """Announce the model a worker serves, under each of its modes. ``queue`` is the deployment's
        base queue (``TTSQ_QUEUE``): deployments sharing a Redis stay apart."""
        payload = json.dumps({**identity, "announced_at": time.time()}, sort_keys=True)
        modes = identity.get("modes") or ("voice_design",)
        mapping = dict.fromkeys(modes, payload)
        patiently(lambda: self._redis.hset(FLEET_PREFIX + queue, mapping=mapping), self.url, self.patience_s)

    def read(self, queue: str, max_age_s: float = IDENTITY_MAX_AGE_S) -> dict[str, dict[str, Any]]:
        """The models announced by live workers of the deployment ``queue``, by mode (empty: none running)."""
        raw = patiently(lambda: self._redis.hgetall(FLEET_PREFIX + queue), self.url, self.patience_s)
        now, live = time.time(), {}
        for mode, value in raw.items():
            identity = json.loads(value)
            if now - float(identity.pop("announced_at", 0.0)) <= max_age_s:
                live[str(mode)] = identity
        return live
