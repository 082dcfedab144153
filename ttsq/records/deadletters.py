"""Dead letters: the messages a worker refused, kept raw in a bounded list in the broker's Redis.

The worker's envelope gate (``ttsq.worker.gate``) puts a message here instead of running it; ``ttsq
dead`` lists them, never their text. The list is ``ttsq:dead``, newest first.

Every letter is bounded whatever the message carried: its raw copy is cut at ``MAX_DEAD_LETTER_BYTES``
(256 KiB), each text field (``id``, ``task``, ``queue``, ``detail``) at ``MAX_FIELD_CHARS`` (512
characters), and the stored record is at most ``MAX_DEAD_LETTER_RECORD_BYTES`` (384 KiB) in all: at most
about 384 MB for the whole list. The fields are kept as the message had them (cut, not escaped): whoever
prints them escapes them (``ttsq.redaction.printable``).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ttsq.constants import DEAD_LETTERS_KEY

if TYPE_CHECKING:
    from collections.abc import Sequence

    import redis

#: Dead letters kept (newest first); older ones are dropped.
MAX_DEAD_LETTERS = 1000
#: Longest raw message kept in a dead letter; a longer one is cut (and says so).
MAX_DEAD_LETTER_BYTES = 256 * 1024
#: Longest text field kept in a dead letter (``id``, ``task``, ``queue``, ``detail``), in characters.
MAX_FIELD_CHARS = 512
#: Largest stored dead letter, in bytes: the raw copy in base64 (349,528 bytes at most) and the fields,
#: each character of which JSON writes in at most 6 bytes (``\uXXXX``): under this by construction.
MAX_DEAD_LETTER_RECORD_BYTES = 384 * 1024


@dataclass(frozen=True)
class DeadLetter:
    """A refused message as ``ttsq dead`` lists it: never its text."""

    #: The record as stored, which identifies it for ``DeadLetters.purge``.
    stored: str = field(repr=False, compare=False)
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
            # Unique, so that ``purge`` finds the newest letter it listed by its value alone.
            "letter": uuid.uuid4().hex,
            "at": time.time(),
            "queue": _cut(queue),
            "reason": _cut(reason),
            "detail": _cut(detail),
            "id": _cut(task_id) if isinstance(task_id, str) else None,
            "task": _cut(task) if isinstance(task, str) else None,
            "bytes": len(data),
            # Raw, as the broker held it: an operator may inspect or re-send it by hand.
            "raw": base64.b64encode(data[:MAX_DEAD_LETTER_BYTES]).decode("ascii"),
            "truncated": len(data) > MAX_DEAD_LETTER_BYTES,
        }
        stored = json.dumps(record)
        if len(stored) > MAX_DEAD_LETTER_RECORD_BYTES:  # cannot happen with the bounds above; kept honest
            raise ValueError(f"a dead letter of {len(stored)} bytes; the bound is {MAX_DEAD_LETTER_RECORD_BYTES}")
        with self._redis.pipeline() as pipe:
            pipe.lpush(DEAD_LETTERS_KEY, stored)
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
                        stored=raw.decode() if isinstance(raw, bytes) else raw,
                        at=float(data["at"]),
                        queue=str(data["queue"]),
                        reason=str(data["reason"]),
                        detail=str(data["detail"]),
                        task_id=_text_or_none(data.get("id")),
                        task=_text_or_none(data.get("task")),
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

    def purge(self, listed: Sequence[DeadLetter]) -> int:
        """Drop the letters ``listed`` (a ``letters()`` answer) and none that arrived after it; return
        how many were dropped (fewer than listed if the list's bound dropped some meanwhile).

        Letters only arrive at the head and leave at the tail, so what was listed is everything from the
        newest listed letter to the tail: the list is cut just above it, in one transaction."""
        if not listed:
            return 0
        newest = listed[0].stored
        dropped = 0

        def cut(pipe: redis.client.Pipeline) -> None:
            nonlocal dropped
            index: Any = pipe.lpos(DEAD_LETTERS_KEY, newest)
            length = int(pipe.llen(DEAD_LETTERS_KEY))
            pipe.multi()
            if index is None:  # every listed letter was dropped by the bound already
                dropped = 0
                return
            dropped = length - int(index)
            if index == 0:
                pipe.delete(DEAD_LETTERS_KEY)
            else:
                pipe.ltrim(DEAD_LETTERS_KEY, 0, int(index) - 1)

        self._redis.transaction(cut, DEAD_LETTERS_KEY)
        return dropped


def _cut(text: str) -> str:
    return text[:MAX_FIELD_CHARS]


def _text_or_none(value: Any) -> str | None:
    return value[:MAX_FIELD_CHARS] if isinstance(value, str) else None
