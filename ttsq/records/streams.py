"""A job's audio while it is being made: one Redis stream per streaming job, ``ttsq:stream:<task id>``.

The worker appends, in order: a ``start`` entry (sample rate, the run's name), ``audio`` entries
(16-bit mono PCM, little-endian, the bytes themselves in ``raw``, with a sequence number from 0, the
sample it starts at and the run's name; workers before ``raw`` wrote base64 in ``pcm``, still read),
then one final entry, ``end`` (the job's result, JSON) or ``error`` (its error type and message). A
job that asked for timestamps also gets its words, as soon as the worker knows them: on an ``audio``
entry, the words its audio completes, or in ``words`` entries of their own (words known after their
audio was written); either way the run's words from the index ``from`` on (JSON
``[{"word", "start", "end"}]``, seconds of the run's audio, which is the stored file's). The ``end``'s
result carries them all.
The whole file is still encoded, stored once and indexed as for any job; the stream is only the
early copy for the readers that are live while it is made. It holds what they still need and
nothing after: the worker appends what it has in one round trip (``append``), trimming with its first
entry every piece more than ``TTSQ_STREAM_WINDOW_S`` seconds of audio behind it (``XADD ... MINID``,
exact; never a piece of the same write), the ``end`` trims to the window from the clip's end, and the
key expires ``TTSQ_STREAM_GRACE_S`` after its ``end`` or ``error`` (``STREAM_LIVE_TTL_S`` after any
other entry, so the stream of a worker that died goes by itself). Redis holds about one window per
stream (docs/deployment.md, "Redis sizing").

Readers never block the writer: they ``XREAD`` after the last entry id they got, so a reader that
reconnects resumes where it stopped, and take the answer as bytes (``NOT_DECODED``: the samples are
not text). A reader that comes late, falls behind the window or comes back after the grace continues
from the stored file at the sample it had reached (``ttsq.records.playback``, the one reader both
``ttsq.client.AudioStream`` and the gateway drive). A job run again (its worker died and the message
came back) writes a second ``start``, and its pieces carry the new run's name: a reader that already
played pieces of the first run cannot splice a sampling model's second take onto them, and ends with
an error instead of a short or mixed clip (``ttsq.errors.StreamBroken``); a reader that had played
nothing follows the rerun.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from redis.client import NEVER_DECODE

from ttsq.alignment import Word, parse_words, words_to_json
from ttsq.constants import STREAM_LIVE_TTL_S, STREAM_PREFIX
from ttsq.errors import CorruptRecord
from ttsq.records.connection import address, patiently

if TYPE_CHECKING:
    import redis

#: Entries one read takes at most.
READ_COUNT = 256
#: ``execute_command`` options for an answer left as bytes (the samples of ``audio`` entries are not text).
NOT_DECODED: dict[str, Any] = {NEVER_DECODE: []}

#: The most words a ``words`` entry may say it follows (a clip of the longest text has a few thousand).
MAX_WORDS = 1_000_000


@dataclass(frozen=True)
class StreamEntry:
    """One entry of a job's stream, as a reader gets it."""

    #: The Redis entry id: pass it back as ``after`` to resume behind this entry.
    id: str
    #: ``start``, ``audio``, ``words``, ``end`` or ``error``.
    kind: str
    sample_rate: int = 0
    #: Piece number (``audio``), from 0 in each run.
    seq: int = -1
    #: The sample of the run's audio this piece starts at (``audio``; -1 where the writer did not say).
    at: int = -1
    #: The run's name (``start``, and ``audio`` where the writer said).
    run: str = ""
    #: 16-bit mono PCM, little-endian (``audio``).
    pcm: bytes = b""
    #: The job's result (``end``) or error (``error``: ``type`` and ``message``).
    payload: dict[str, Any] | None = None
    #: The run's words from index ``first_word`` on (``words``), in seconds of the run's audio.
    words: tuple[Word, ...] = ()
    first_word: int = 0


class AudioStreams:
    """Writes and reads the per-job audio streams in the cache database."""

    def __init__(
        self, client: redis.Redis, *, window_s: float = 5.0, grace_s: int = 30, patience_s: float = 0.0
    ) -> None:
        """``window_s``: seconds of audio a writer keeps behind its newest piece (``TTSQ_STREAM_WINDOW_S``);
        ``grace_s``: how long a stream stays readable after its ``end`` or ``error``
        (``TTSQ_STREAM_GRACE_S``)."""
        self.url = address(client)
        self.window_s = window_s
        self.grace_s = grace_s
        self.patience_s = patience_s
        self._redis = client

    # Writing (the worker) -----------------------------------------------------------------------

    def start(self, task_id: str, *, sample_rate: int, run: str, keep_from: str | None = None) -> str:
        """A run of the job begins producing audio at ``sample_rate``; ``run`` names the run (a rerun
        after a worker died writes a new start with another name). Its entry id."""
        return self.append(task_id, [start_fields(sample_rate=sample_rate, run=run)], keep_from=keep_from)[0]

    def audio(
        self,
        task_id: str,
        seq: int,
        pcm: bytes,
        *,
        at: int = -1,
        run: str = "",
        keep_from: str | None = None,
        words: Sequence[Word] = (),
        first_word: int = 0,
    ) -> str:
        """Piece ``seq`` of the run: 16-bit mono PCM, little-endian, starting at sample ``at`` of the run;
        ``words``: the run's words from index ``first_word`` on that this piece completes.
        ``keep_from``: an entry id; every entry before it is trimmed in the same call (the writer's
        window). Its entry id."""
        fields = audio_fields(seq, pcm, at=at, run=run, words=words, first_word=first_word)
        return self.append(task_id, [fields], keep_from=keep_from)[0]

    def words(self, task_id: str, first: int, words: Sequence[Word], *, run: str, keep_from: str | None = None) -> str:
        """The run's words from index ``first`` on, now that the worker knows when they are said. Its entry id."""
        fields = {"kind": "words", "from": str(first), "run": run, "words": json.dumps(words_to_json(words))}
        return self.append(task_id, [fields], keep_from=keep_from)[0]

    def append(
        self, task_id: str, entries: Sequence[Mapping[str, str | bytes]], *, keep_from: str | None = None
    ) -> list[str]:
        """``entries`` (``start_fields``, ``audio_fields``, ...) in order, in one round trip; their ids.
        ``keep_from``: an entry id; every entry before it is trimmed by the first of them (the writer's
        window), never one of ``entries`` itself."""
        key = STREAM_PREFIX + task_id

        def add() -> Any:
            # MULTI/EXEC: a reader blocked on the stream wakes once the whole write is in and takes it
            # in one read, not once at its first entry and again for the rest.
            pipe = self._redis.pipeline(transaction=len(entries) > 1)
            for index, fields in enumerate(entries):
                if index or keep_from is None:
                    pipe.xadd(key, fields)  # type: ignore[arg-type]
                else:  # exact: an approximate MINID trims whole nodes of 100 entries, about a minute of audio
                    pipe.xadd(key, fields, minid=keep_from, approximate=False)  # type: ignore[arg-type]
            pipe.expire(key, max(self.grace_s, STREAM_LIVE_TTL_S))
            return pipe.execute()[:-1]

        ids = patiently(add, self.url, self.patience_s)
        return [entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id) for entry_id in ids]

    def end(self, task_id: str, result: dict[str, Any], *, keep_from: str | None = None) -> None:
        """The job succeeded: its result (the stored file's URL and facts) closes the stream, which goes
        ``grace_s`` later. ``keep_from``: as for ``append`` (the writer's window at the clip's end)."""
        fields = {"kind": "end", "payload": json.dumps(result, sort_keys=True)}
        self._add(task_id, fields, keep_from=keep_from, ttl_s=self.grace_s)

    def error(self, task_id: str, error: BaseException) -> None:
        """The job failed: its error type and message close the stream (never the input text: ttsq's
        errors name fields, not their contents), which goes ``grace_s`` later."""
        payload = {"type": type(error).__name__, "message": str(error)[:500]}
        self._add(task_id, {"kind": "error", "payload": json.dumps(payload, sort_keys=True)}, ttl_s=self.grace_s)

    def _add(self, task_id: str, fields: dict[str, str], *, keep_from: str | None = None, ttl_s: int = 0) -> str:
        key = STREAM_PREFIX + task_id

        def add() -> Any:
            pipe = self._redis.pipeline(transaction=False)
            if keep_from is None:
                pipe.xadd(key, fields)  # type: ignore[arg-type]
            else:  # exact, as in ``append``
                pipe.xadd(key, fields, minid=keep_from, approximate=False)  # type: ignore[arg-type]
            pipe.expire(key, ttl_s or max(self.grace_s, STREAM_LIVE_TTL_S))
            return pipe.execute()[0]

        entry_id = patiently(add, self.url, self.patience_s)
        return entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)

    # Reading (producers, the gateway) -----------------------------------------------------------

    def exists(self, task_id: str) -> bool:
        """Whether the job has a stream (it was submitted to stream and a worker has started it)."""
        return bool(patiently(lambda: self._redis.exists(STREAM_PREFIX + task_id), self.url, self.patience_s))

    def read(self, task_id: str, *, after: str = "0-0", block_s: float = 1.0) -> list[StreamEntry]:
        """The entries after ``after`` (an entry id), waiting up to ``block_s`` for the first of them."""
        key = STREAM_PREFIX + task_id
        command = xread_command({key: after}, count=READ_COUNT, block_ms=max(1, int(block_s * 1000)))
        answer: Any = patiently(
            lambda: self._redis.execute_command(*command, keys=[key], **NOT_DECODED),  # type: ignore[no-untyped-call]
            self.url,
            self.patience_s,
        )
        return [parse_entry(entry_id, fields) for _, entries in read_answer(answer) for entry_id, fields in entries]


def xread_command(positions: Mapping[str, str], *, count: int, block_ms: int) -> list[str | int]:
    """``XREAD`` of the streams ``positions`` names, each after its entry id: the command's words, for
    ``execute_command`` with ``NOT_DECODED`` (sync or async client alike)."""
    return ["XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", *positions, *positions.values()]


def start_fields(*, sample_rate: int, run: str) -> dict[str, str | bytes]:
    """A ``start`` entry's fields, for ``AudioStreams.append``."""
    return {"kind": "start", "sample_rate": str(sample_rate), "run": run}


def audio_fields(
    seq: int, pcm: bytes, *, at: int = -1, run: str = "", words: Sequence[Word] = (), first_word: int = 0
) -> dict[str, str | bytes]:
    """An ``audio`` entry's fields (``AudioStreams.audio``), for ``AudioStreams.append``. The samples
    go as they are (``raw``): base64 cost the worker, Redis and every reader a third more bytes and an
    encode or decode of each, the largest part of a stream's cost per second of audio."""
    fields: dict[str, str | bytes] = {"kind": "audio", "seq": str(seq), "raw": pcm}
    if words:
        fields.update({"from": str(first_word), "words": json.dumps(words_to_json(words))})
    if at >= 0:
        fields["at"] = str(at)
    if run:
        fields["run"] = run
    return fields


def parse_entry(entry_id: str | bytes, raw_fields: Mapping[Any, Any]) -> StreamEntry:
    """One stream entry read back, checked: what Redis returns is untrusted (anyone may write there).
    Fields as bytes (read with ``NOT_DECODED``: an ``audio`` entry's samples are bytes) or as text."""
    entry_id = _text(entry_id)
    fields = {_text(name): value if name in _BINARY else _text(value) for name, value in raw_fields.items()}
    kind = fields.get("kind")
    try:
        if kind == "start":
            return StreamEntry(
                id=entry_id, kind=kind, sample_rate=int(fields["sample_rate"]), run=str(fields.get("run", ""))[:64]
            )
        if kind == "audio":
            first, words = _words(entry_id, fields) if "words" in fields else (0, ())
            return StreamEntry(
                id=entry_id,
                kind=kind,
                seq=int(fields["seq"]),
                pcm=_samples(fields),
                at=int(fields.get("at", -1)),
                run=str(fields.get("run", ""))[:64],
                words=words,
                first_word=first,
            )
        if kind == "words":
            first, words = _words(entry_id, fields)
            return StreamEntry(
                id=entry_id, kind=kind, run=str(fields.get("run", ""))[:64], words=words, first_word=first
            )
        if kind in ("end", "error"):
            payload = json.loads(fields["payload"])
            if not isinstance(payload, dict):
                raise ValueError("payload is not an object")
            return StreamEntry(id=entry_id, kind=kind, payload=payload)
    except (KeyError, ValueError) as exc:
        raise CorruptRecord(f"stream entry {entry_id} ({kind})", f"cannot be read: {exc}") from None
    raise CorruptRecord(f"stream entry {entry_id}", f"unknown kind {str(kind)[:20]!r}")


#: The fields that are bytes, not text: an ``audio`` entry's samples.
_BINARY = ("raw", b"raw")


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _samples(fields: dict[str, Any]) -> bytes:
    """An ``audio`` entry's samples: ``raw`` bytes, or ``pcm``, base64 (what workers wrote before ``raw``)."""
    if "raw" in fields:
        pcm = fields["raw"]
        if not isinstance(pcm, bytes):  # read as text: the bytes that were not UTF-8 are lost
            raise ValueError("raw samples read as text")
    else:
        pcm = base64.b64decode(fields["pcm"], validate=True)
    if len(pcm) % 2:
        raise ValueError(f"{len(pcm)} bytes of 16-bit samples")
    return bytes(pcm)


def _words(entry_id: str, fields: dict[str, Any]) -> tuple[int, tuple[Word, ...]]:
    """An entry's words and the index of the first: checked (``CorruptRecord`` naming the entry)."""
    first = int(fields["from"])
    if not 0 <= first <= MAX_WORDS:
        raise ValueError(f"word index {first} out of range")
    return first, tuple(parse_words(json.loads(fields["words"]), field=f"stream entry {entry_id} words"))


def read_answer(answer: Any) -> list[tuple[str, list[Any]]]:
    """An ``XREAD`` answer over any number of job streams (sync or async client, RESP2 or RESP3) as
    (task id, its raw entries) pairs; each raw entry is ``(entry id, fields)`` for ``parse_entry``
    (parsed per stream by the caller, so one bad entry fails only its own stream's readers)."""
    # RESP3 answers a map of stream -> entries, RESP2 a list of [stream, entries] pairs.
    pairs = answer.items() if isinstance(answer, dict) else [(pair[0], pair[1]) for pair in answer or []]
    return [
        (_text(name).removeprefix(STREAM_PREFIX), [(_text(entry_id), fields) for entry_id, fields in entries])
        for name, entries in pairs
    ]
