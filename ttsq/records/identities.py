"""Engine identities: the model each mode of a deployment is served by, announced by its live workers.

A worker announces its model under each of its modes when it starts and with every heartbeat;
producers read them to predict content keys and to route (or refuse) each mode. An announcement that
is not repeated goes stale: a mode whose workers all stopped is no longer served.

One queue, one model: each worker also keeps an entry of its own (``ttsq:fleet-nodes:<queue>``), and a
worker starting with another model than a live worker serves on one of its modes is refused, atomically
(``claim``). A worker that stops withdraws its entry (``leave``); one that died stops counting after
``FLEET_LIVE_S``. Producers keep trusting the per-mode announcement longer (``IDENTITY_MAX_AGE_S``),
so a restarting worker does not make its mode look unserved.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ttsq.constants import FLEET_LIVE_S, FLEET_NODES_PREFIX, FLEET_PREFIX, IDENTITY_MAX_AGE_S
from ttsq.records.connection import address, patiently
from ttsq.records.scripts import register

if TYPE_CHECKING:
    import redis

#: What two workers on one queue must agree on: the identity's part of every content key (``ttsq.keys``).
SAME_MODEL_FIELDS = ("engine", "model", "revision", "sample_rate")


@dataclass(frozen=True)
class Rival:
    """A live worker of the deployment that serves one of a claimant's modes with another model."""

    node: str
    identity: dict[str, Any]


class Identities:
    """The identities announced per deployment (``ttsq:fleet:<queue>``), in the cache database."""

    def __init__(self, client: redis.Redis, *, patience_s: float = 0.0) -> None:
        self.url = address(client)
        self.patience_s = patience_s
        self._redis = client
        self._claim = register(client, "claim_identity")

    def publish(self, queue: str, identity: dict[str, Any]) -> None:
        """Announce the model a worker serves, under each of its modes. ``queue`` is the deployment's
        base queue (``TTSQ_QUEUE``): deployments sharing a Redis stay apart."""
        payload = json.dumps({**identity, "announced_at": time.time()}, sort_keys=True)
        modes = identity.get("modes") or ("voice_design",)
        mapping = dict.fromkeys(modes, payload)
        patiently(lambda: self._redis.hset(FLEET_PREFIX + queue, mapping=mapping), self.url, self.patience_s)

    def claim(self, queue: str, node: str, identity: dict[str, Any]) -> Rival | None:
        """Announce ``identity`` as worker ``node``'s (as ``publish`` does, and under the node), unless a
        live worker of the deployment serves one of its modes with another model: then announce nothing
        and return that worker. One step in Redis, so of two workers that start together with different
        models exactly one wins; a worker of the same model is always accepted."""
        now = time.time()
        modes = list(identity.get("modes") or ("voice_design",))
        payload = json.dumps({**identity, "modes": modes, "announced_at": now}, sort_keys=True)
        answer = patiently(
            lambda: self._claim(
                keys=[FLEET_PREFIX + queue, FLEET_NODES_PREFIX + queue],
                args=[node, payload, now - FLEET_LIVE_S, now - IDENTITY_MAX_AGE_S, json.dumps(SAME_MODEL_FIELDS)],
            ),
            self.url,
            self.patience_s,
        )
        if not answer:
            return None
        rival, raw = answer
        other = json.loads(raw)
        other.pop("announced_at", None)
        return Rival(node=str(rival), identity=other)

    def leave(self, queue: str, node: str) -> None:
        """Withdraw worker ``node``'s own entry as it stops. The per-mode announcement stays for producers
        (``read``): another worker of the model may serve on, or this one come back."""
        patiently(lambda: self._redis.hdel(FLEET_NODES_PREFIX + queue, node), self.url, self.patience_s)

    def workers(self, queue: str, max_age_s: float = FLEET_LIVE_S) -> list[str]:
        """The nodes of the deployment ``queue`` running now (announced within ``max_age_s``), sorted."""
        raw = patiently(lambda: self._redis.hgetall(FLEET_NODES_PREFIX + queue), self.url, self.patience_s)
        now, live = time.time(), []
        for node, value in raw.items():
            try:
                announced_at = float(json.loads(value).get("announced_at", 0.0))
            except (ValueError, TypeError, AttributeError):
                continue  # not what ttsq writes: no worker
            if now - announced_at <= max_age_s:
                live.append(str(node))
        return sorted(live)

    def modes_served(self, queue: str, max_age_s: float = FLEET_LIVE_S) -> set[str]:
        """The modes the nodes of the deployment ``queue`` running now serve (``workers``' nodes)."""
        raw = patiently(lambda: self._redis.hgetall(FLEET_NODES_PREFIX + queue), self.url, self.patience_s)
        now, modes = time.time(), set[str]()
        for value in raw.values():
            try:
                identity = json.loads(value)
                if now - float(identity.get("announced_at", 0.0)) <= max_age_s:
                    modes.update(str(mode) for mode in identity.get("modes") or ("voice_design",))
            except (ValueError, TypeError, AttributeError):
                continue  # not what ttsq writes: no worker
        return modes

    def read(self, queue: str, max_age_s: float = IDENTITY_MAX_AGE_S) -> dict[str, dict[str, Any]]:
        """The models announced by live workers of the deployment ``queue``, by mode (empty: none running)."""
        raw = patiently(lambda: self._redis.hgetall(FLEET_PREFIX + queue), self.url, self.patience_s)
        now, live = time.time(), {}
        for mode, value in raw.items():
            identity = json.loads(value)
            if now - float(identity.pop("announced_at", 0.0)) <= max_age_s:
                live[str(mode)] = identity
        return live
