"""Dead letters: the messages a worker refused, kept raw in a bounded list in the broker's Redis.

The worker's envelope gate (``ttsq.worker.gate``) puts a message here instead of running it; ``ttsq
dead`` lists them, never their text. The list is ``ttsq:dead``, newest first.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ttsq.constants import DEAD_LETTERS_KEY

if TYPE_CHECKING:
    import redis

#: Dead letters kept (newest first); older ones are dropped.
MAX_DEAD_LETTERS = 1000
#: Longest raw message kept in a dead letter; a longer one is cut (and says so).
MAX_DEAD_LETTER_BYTES = 256 * 1024


@dataclass(frozen=True)
class DeadLetter:
    """A refused message as ``ttsq dead`` lists it: never its text."""

    at: float
    queue: str
    reason: str
    detail: str
    task_id: str | None
    task: str | None
    size: int

    def summary(self) -> dict[str, Any]:
        """Plain JSON for ``ttsq dead --json``."""
        return {
            "at": self.at,
            "queue": self.queue,
            "reason": self.reason,
            "detail": self.detail,
            "id": self.task_id,
            "task": self.task,
            "bytes": self.size,
        }


class DeadLetters:
    """The bounded list of refused messages, kept raw in the broker's Redis (``ttsq:dead``)."""

    def __init__(self, client: redis.Redis, *, limit: int = MAX_DEAD_LETTERS) -> None:
        self._redis = client
        self.limit = limit

    def put(
        self,
        raw: bytes | str,
        *,
        queue: str,
        reason: str,
        detail: str,
        task_id: str | None = None,
        task: str | None = None,
    ) -> None:
        """Keep one refused message (newest first; beyond the limit the oldest are dropped)."""
        data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
        record = {
            "at": time.time(),
            "queue": queue,
            "reason": reason,
            "detail": detail,
            "id": task_id if isinstance(task_id, str) else None,
            "task": task if isinstance(task, str) else None,
            "bytes": len(data),
            # Raw, as the broker held it: an operator may inspect or re-send it by hand.
            "raw": base64.b64encode(data[:MAX_DEAD_LETTER_BYTES]).decode("ascii"),
            "truncated": len(data) > MAX_DEAD_LETTER_BYTES,
        }
        with self._redis.pipeline() as pipe:
            pipe.lpush(DEAD_LETTERS_KEY, json.dumps(record))
            pipe.ltrim(DEAD_LETTERS_KEY, 0, self.limit - 1)
            pipe.execute()

    def letters(self) -> list[DeadLetter]:
        """Every kept dead letter, newest first."""
        letters = []
        for raw in self._redis.lrange(DEAD_LETTERS_KEY, 0, -1):
            try:
                data = json.loads(raw)
                letters.append(
                    DeadLetter(
                        at=float(data["at"]),
                        queue=str(data["queue"]),
                        reason=str(data["reason"]),
                        detail=str(data["detail"]),
                        task_id=data.get("id"),
                        task=data.get("task"),
                        size=int(data["bytes"]),
                    )
                )
            except (ValueError, KeyError, TypeError):
                continue  # not one of ours: skip it rather than fail the listing
        return letters

    def raw(self) -> list[bytes]:
        """The raw messages kept, newest first (cut at ``MAX_DEAD_LETTER_BYTES``)."""
        out = []
        for raw in self._redis.lrange(DEAD_LETTERS_KEY, 0, -1):
            try:
                out.append(base64.b64decode(json.loads(raw)["raw"]))
            except (ValueError, KeyError, TypeError, binascii.Error):
                continue
        return out

    def purge(self) -> int:
        """Drop every dead letter; return how many there were."""
        with self._redis.pipeline() as pipe:
            pipe.llen(DEAD_LETTERS_KEY)
            pipe.delete(DEAD_LETTERS_KEY)
            count, _ = pipe.execute()
        return int(count)
