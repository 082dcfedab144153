"""The plans of running documents: what the stitch joins, stored once, and whether the fan-out was sent.

A document's plan (every chunk's content key, offsets, boundary and sentence weights) is written once
by its fan-out, keyed by the document's task id, instead of riding in every chunk message as part of
the chord's body (at 1,559 chunks that was 376 KB per message, quadratic in the document's length).
The stitch reads it back, as untrusted as any record (``ttsq.worker.documents`` validates it), and the
sweeper reads its chunk count to find the document's chunk messages.

The fan-out mark makes the fan-out happen once per document: ``SET NX`` of ``sending`` with a lease as
long as a fan-out may take, then ``sent`` once the chord is out. A redelivered document task that
finds either sends nothing; a fan-out that died half way lets its lease lapse, and the next delivery
fans out again (chunk task ids are deterministic, and finished chunks are answered from the cache).
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from ttsq.constants import FANOUT_PREFIX, PLAN_PREFIX
from ttsq.errors import CorruptRecord
from ttsq.records.connection import address, patiently

if TYPE_CHECKING:
    import redis

#: The fan-out mark's two values: under way (a lease), and done.
SENDING = "sending"
SENT = "sent"


class Plans:
    """Document plans and fan-out marks, in the cache database."""

    def __init__(self, client: redis.Redis, *, ttl_s: int, patience_s: float = 0.0) -> None:
        self.url = address(client)
        self.ttl_s = ttl_s
        self.patience_s = patience_s
        self._redis = client

    def save(self, doc_id: str, plan: dict[str, Any], *, chunks: int) -> None:
        """Store the plan of document ``doc_id`` and how many chunk jobs it fans out into."""

        def write() -> None:
            pipe = self._redis.pipeline()
            pipe.hset(PLAN_PREFIX + doc_id, mapping={"plan": json.dumps(plan, separators=(",", ":")), "chunks": chunks})
            pipe.expire(PLAN_PREFIX + doc_id, self.ttl_s)
            pipe.execute()

        patiently(write, self.url, self.patience_s)

    def load(self, doc_id: str) -> Any:
        """The plan as stored (parsed JSON, not yet validated), or None if there is none."""
        raw = patiently(lambda: self._redis.hget(PLAN_PREFIX + doc_id, "plan"), self.url, self.patience_s)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise CorruptRecord(f"the plan of document {doc_id[:64]!r}", "is not JSON") from None

    def chunk_count(self, doc_id: str) -> int | None:
        """How many chunk jobs the document fanned out into, if its plan is stored."""
        raw = patiently(lambda: self._redis.hget(PLAN_PREFIX + doc_id, "chunks"), self.url, self.patience_s)
        try:
            return None if raw is None else max(0, int(raw))
        except ValueError:
            raise CorruptRecord(f"the plan of document {doc_id[:64]!r}: chunks", "is not a count") from None

    def begin_fan_out(self, doc_id: str, *, lease_s: int) -> bool:
        """Take the right to fan out ``doc_id`` (for ``lease_s``); False if it is sent or being sent."""
        taken = patiently(
            lambda: self._redis.set(FANOUT_PREFIX + doc_id, SENDING, nx=True, ex=max(1, lease_s)),
            self.url,
            self.patience_s,
        )
        return bool(taken)

    def fanned_out(self, doc_id: str) -> None:
        """The chord is sent: no delivery of this document sends it again."""
        patiently(lambda: self._redis.set(FANOUT_PREFIX + doc_id, SENT, ex=self.ttl_s), self.url, self.patience_s)

    def fan_out_state(self, doc_id: str) -> str | None:
        """``sending``, ``sent`` or None (never fanned out, or its lease lapsed)."""
        raw = patiently(lambda: self._redis.get(FANOUT_PREFIX + doc_id), self.url, self.patience_s)
        return raw if raw in (SENDING, SENT) else None

    def forget_fan_out(self, doc_id: str) -> None:
        """Let the next delivery fan out again (the sweeper found none of the document's messages)."""
        patiently(lambda: self._redis.delete(FANOUT_PREFIX + doc_id), self.url, self.patience_s)


#: The namespace of chunk task ids (uuid5 of the document's task id and the chunk's index).
_CHUNK_NAMESPACE = uuid.UUID("5b0f7f2e-6c1d-4f43-9d3e-3a7c1e0d2b11")


def chunk_task_ids(doc_id: str, total: int) -> list[str]:
    """The task ids of a document's chunk jobs: the same for every fan-out of the document."""
    return [str(uuid.uuid5(_CHUNK_NAMESPACE, f"{doc_id}/{index}")) for index in range(total)]


def chord_group_id(doc_id: str) -> str:
    """The group id of a document's chord: the same for every fan-out, so that a resumed one joins the
    first one's count (Celery counts each chunk once per task id and index)."""
    return str(uuid.uuid5(_CHUNK_NAMESPACE, f"{doc_id}/group"))
