"""A job's audio while it is being made: one Redis stream per streaming job, ``ttsq:stream:<task id>``.

The worker appends, in order: a ``start`` entry (sample rate, the run's incarnation), ``audio``
entries (16-bit mono PCM, little-endian, base64, with a sequence number from 0), then one final
entry, ``end`` (the job's result, JSON) or ``error`` (its error type and message). The whole file is
still encoded, stored once and indexed as for any job; the stream is only the early copy, capped in
entries and expiring (``STREAM_TTL_S``), so Redis never holds more than ``max_pieces`` pieces of one job.

Readers never block the writer: they ``XREAD`` after the last entry id they got, so a reader that
reconnects resumes where it stopped. A job run again (its worker died and the message came back)
writes a second ``start``: a reader that already played pieces of the first run cannot splice a
sampling model's second take onto them, and ends with an error instead of a short or mixed clip
(``ttsq.errors.StreamBroken``); a reader that had played nothing follows the rerun.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ttsq.constants import STREAM_PREFIX
from ttsq.errors import CorruptRecord
from ttsq.records.connection import address, patiently

if TYPE_CHECKING:
    import redis

#: How long a job's stream stays readable after its last entry (seconds).
STREAM_TTL_S = 900
#: Entries one stream keeps at most (pieces beyond it push the oldest out; a reader that far behind
#: gets ``StreamBroken`` and reads the stored file instead).
MAX_PIECES = 4096


@dataclass(frozen=True)
class StreamEntry:
    """One entry of a job's stream, as a reader gets it."""

    #: The Redis entry id: pass it back as ``after`` to resume behind this entry.
    id: str
    #: ``start``, ``audio``, ``end`` or ``error``.
    kind: str
    sample_rate: int = 0
    #: Piece number (``audio``), from 0 in each run.
    seq: int = -1
    #: 16-bit mono PCM, little-endian (``audio``).
    pcm: bytes = b""
    #: The job's result (``end``) or error (``error``: ``type`` and ``message``).
    payload: dict[str, Any] | None = None


class AudioStreams:
    """Writes and reads the per-job audio streams in the cache database."""

    def __init__(
        self, client: redis.Redis, *, ttl_s: int = STREAM_TTL_S, max_pieces: int = MAX_PIECES, patience_s: float = 0.0
    ) -> None:
        self.url = address(client)
        self.ttl_s = ttl_s
        self.max_pieces = max_pieces
        self.patience_s = patience_s
        self._redis = client

    # Writing (the worker) -----------------------------------------------------------------------

    def start(self, task_id: str, *, sample_rate: int, run: str) -> None:
        """A run of the job begins producing audio at ``sample_rate``; ``run`` names the run (a rerun
        after a worker died writes a new start with another name)."""
        self._add(task_id, {"kind": "start", "sample_rate": str(sample_rate), "run": run})

    def audio(self, task_id: str, seq: int, pcm: bytes) -> None:
        """Piece ``seq`` of the run: 16-bit mono PCM, little-endian."""
        self._add(task_id, {"kind": "audio", "seq": str(seq), "pcm": base64.b64encode(pcm).decode("ascii")})

    def end(self, task_id: str, result: dict[str, Any]) -> None:
        """The job succeeded: its result (the stored file's URL and facts) closes the stream."""
        self._add(task_id, {"kind": "end", "payload": json.dumps(result, sort_keys=True)})

    def error(self, task_id: str, error: BaseException) -> None:
        """The job failed: its error type and message close the stream (never the input text: ttsq's
        errors name fields, not their contents)."""
        payload = {"type": type(error).__name__, "message": str(error)[:500]}
        self._add(task_id, {"kind": "error", "payload": json.dumps(payload, sort_keys=True)})

    def _add(self, task_id: str, fields: dict[str, str]) -> None:
        key = STREAM_PREFIX + task_id

        def add() -> None:
            pipe = self._redis.pipeline(transaction=False)
            pipe.xadd(key, fields, maxlen=self.max_pieces, approximate=True)  # type: ignore[arg-type]
            pipe.expire(key, self.ttl_s)
            pipe.execute()

        patiently(add, self.url, self.patience_s)

    # Reading (producers, the gateway) -----------------------------------------------------------

    def exists(self, task_id: str) -> bool:
        """Whether the job has a stream (it was submitted to stream and a worker has started it)."""
        return bool(patiently(lambda: self._redis.exists(STREAM_PREFIX + task_id), self.url, self.patience_s))

    def read(self, task_id: str, *, after: str = "0-0", block_s: float = 1.0) -> list[StreamEntry]:
        """The entries after ``after`` (an entry id), waiting up to ``block_s`` for the first of them."""
        answer: Any = patiently(
            lambda: self._redis.xread({STREAM_PREFIX + task_id: after}, count=256, block=max(1, int(block_s * 1000))),
            self.url,
            self.patience_s,
        )
        # RESP3 answers a map of stream -> entries, RESP2 a list of [stream, entries] pairs.
        streams = answer.values() if isinstance(answer, dict) else [pair[1] for pair in answer or []]
        return [parse_entry(entry_id, fields) for entries in streams for entry_id, fields in entries]


def parse_entry(entry_id: str, fields: dict[str, str]) -> StreamEntry:
    """One stream entry read back, checked: what Redis returns is untrusted (anyone may write there)."""
    kind = fields.get("kind")
    try:
        if kind == "start":
            return StreamEntry(id=entry_id, kind=kind, sample_rate=int(fields["sample_rate"]))
        if kind == "audio":
            return StreamEntry(id=entry_id, kind=kind, seq=int(fields["seq"]), pcm=base64.b64decode(fields["pcm"]))
        if kind in ("end", "error"):
            payload = json.loads(fields["payload"])
            if not isinstance(payload, dict):
                raise ValueError("payload is not an object")
            return StreamEntry(id=entry_id, kind=kind, payload=payload)
    except (KeyError, ValueError) as exc:
        raise CorruptRecord(f"stream entry {entry_id} ({kind})", f"cannot be read: {exc}") from None
    raise CorruptRecord(f"stream entry {entry_id}", f"unknown kind {str(kind)[:20]!r}")


def read_answer(answer: Any) -> list[tuple[str, list[Any]]]:
    """An ``XREAD`` answer over any number of job streams (sync or async client, RESP2 or RESP3) as
    (task id, its raw entries) pairs; each raw entry is ``(entry id, fields)`` for ``parse_entry``
    (parsed per stream by the caller, so one bad entry fails only its own stream's readers)."""
    # RESP3 answers a map of stream -> entries, RESP2 a list of [stream, entries] pairs.
    pairs = answer.items() if isinstance(answer, dict) else [(pair[0], pair[1]) for pair in answer or []]
    return [
        ((name.decode() if isinstance(name, bytes) else str(name)).removeprefix(STREAM_PREFIX), list(entries))
        for name, entries in pairs
    ]
