"""One reader of one job's stream, without I/O: entries and clock ticks in, what to do out.

``ttsq.client.AudioStream`` (blocking reads) and the gateway's ``SpeechAudio`` (one shared async read)
both drive a ``Playback``, so the rules of reading a stream (``ttsq.records.streams``) are written once:

- A ``start`` opens a run; its ``audio`` entries play in ``seq`` order (``Play``). A second run
  (another ``start``, or pieces that name another run) after audio was played is ``Broken``: a
  sampling model's second take is never spliced onto the first. A reader that played nothing follows it.
- The stream keeps a window, not the clip. A reader whose next piece is gone (it came late, fell
  behind the window, or came back after the stream expired) goes on from the stored file at the
  sample it had reached (``FromStored``): the same samples, since the pieces of a clip are its stored
  WAV's samples. The driver reads the job's result for that, once the job is over. A gap is a trim only
  at the head of what one read returned (Redis trims from the front); a piece missing between two
  entries of one read is a broken stream.
- ``end`` after every piece: ``Done``; before any piece (a cache hit at the worker, or nothing played):
  ``FromStored(0)``. ``error``: ``Failed``, the worker's own word.
- Words (a job that asked for timestamps): each ``Play`` carries the words its piece completes, among
  those known by then; words that become known after their audio was played (a ``words`` entry behind
  its pieces, the ``end``'s result) come at once as ``Words``. A driver that goes on from the stored
  file hands out the rest from the job's result the same way (``WordFeed``). Never a word twice, never
  out of order, each once its audio has been played.
- Time: nothing played by ``first_audio_by`` is ``Broken("timeout")``; a run that started and sends
  nothing for ``stall_s`` is ``Broken``; while nothing is playing (before a start, or waiting for the
  stored file), and after ``check_s`` of silence in any case, ``CheckState`` asks the driver whether
  the job is over, and the driver answers ``job_over()`` once a last read found nothing more.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ttsq.alignment import Word, parse_words
from ttsq.errors import CorruptRecord
from ttsq.records.streams import StreamEntry

#: A started stream with no new piece for this long is broken (seconds): its worker stalled or died
#: (the job itself comes back by redelivery and completes).
STALL_S = 30.0
#: While a reader plays nothing (no start yet, or waiting for the stored file), and after this much
#: silence in any case, the job's state is read this often (seconds).
STATE_CHECK_S = 2.0
#: The rates a stream's ``start`` may name (Hz); anything else is a record ttsq did not write.
RATES = range(4_000, 192_001)


#: A word ends within this much of a piece's end is completed by it (seconds): stored times are
#: rounded to the millisecond.
WORD_SLACK_S = 0.001


class WordFeed:
    """The words of one clip, handed out in order, each once the audio that completes it has played.

    ``learn`` what is known (from any index on: a stream's ``words`` entries, a result's whole list);
    ``due`` the words that end by a point of the audio; ``rest`` what is left once all of it played."""

    def __init__(self) -> None:
        self.known: list[Word] = []
        #: How many words were handed out.
        self.said = 0

    def learn(self, words: Iterable[Word], first: int = 0) -> bool:
        """Words from index ``first`` on; what was said already stays said. False (nothing learned) for
        words that leave a gap after those known: a later, whole list fills it."""
        if first > len(self.known):
            return False
        words = list(words)
        if first + len(words) <= self.said:
            return True
        self.known[first:] = words
        return True

    def due(self, played_s: float) -> tuple[Word, ...]:
        """The known words not said yet that end by ``played_s`` seconds (in order: a word still being
        said holds back the ones after it)."""
        start = self.said
        while self.said < len(self.known) and self.known[self.said].end <= played_s + WORD_SLACK_S:
            self.said += 1
        return tuple(self.known[start : self.said])

    def rest(self) -> tuple[Word, ...]:
        """Every known word not said yet (the audio has all played)."""
        start, self.said = self.said, max(self.said, len(self.known))
        return tuple(self.known[start:])


def result_words(result: object, field: str = "words") -> list[Word]:
    """The ``words`` of a job's result (a stream's ``end``, a stored result): checked, ``CorruptRecord``
    naming ``field`` when they are not words; none when the result has none."""
    if not isinstance(result, dict) or result.get("words") is None:
        return []
    return parse_words(result["words"], field=field)


@dataclass(frozen=True)
class Play:
    """Play these samples (16-bit mono PCM, little-endian) at ``sample_rate``; ``words``: the words
    these samples complete (docs/timestamps.md, "Streams")."""

    pcm: bytes
    sample_rate: int
    words: tuple[Word, ...] = ()


@dataclass(frozen=True)
class Words:
    """Words whose audio was played before they were known."""

    words: tuple[Word, ...]


@dataclass(frozen=True)
class FromStored:
    """Play the job's stored file from sample ``offset`` (what was played before it), to its end; then done."""

    offset: int


@dataclass(frozen=True)
class Done:
    """Every piece was played; ``payload`` is the job's result as its ``end`` carried it."""

    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Broken:
    """The stream cannot go on: ``code`` is ``stream_broken``, ``corrupt_record`` or ``timeout``."""

    message: str
    code: str


@dataclass(frozen=True)
class Failed:
    """The job failed: its error's type and message, from the stream's ``error`` entry."""

    kind: str
    message: str


@dataclass(frozen=True)
class CheckState:
    """Ask whether the job is over; if it is, read once more and, if that finds nothing, call ``job_over``."""


Action = Play | Words | FromStored | Done | Broken | Failed | CheckState


class Playback:
    """The state of one reader of job ``task_id``'s stream."""

    def __init__(
        self,
        task_id: str,
        *,
        now: float,
        first_audio_by: float | None,
        stall_s: float = STALL_S,
        check_s: float = STATE_CHECK_S,
    ) -> None:
        self.task_id = task_id
        self.first_audio_by = first_audio_by
        self.stall_s = stall_s
        self.check_s = check_s
        #: ``waiting`` (no run yet), ``live`` (playing a run's pieces), ``behind`` (the next piece is
        #: gone: waiting for the job's end to read the stored file) or ``over``.
        self.phase = "waiting"
        self.run = ""
        self.sample_rate = 0
        #: Samples played so far.
        self.offset = 0
        self.played = False
        #: The stream had moved past this reader (it came late or fell behind the window): what it
        #: missed is in the stored file. False for a job that never streamed to it at all.
        self.trimmed = False
        #: The run's words, handed out with the pieces that complete them.
        self.words = WordFeed()
        self._expected = 0  # the next piece's seq
        self._last_news = now
        self._last_check = now

    @property
    def over(self) -> bool:
        """Whether the reader has said its last action."""
        return self.phase == "over"

    def entries(self, entries: Iterable[StreamEntry], now: float) -> list[Action]:
        """What one read returned, in order (possibly empty: then as ``idle``)."""
        actions: list[Action] = []
        head = True
        for entry in entries:
            if self.phase == "over":
                break
            self._last_news = now
            actions.extend(self._entry(entry, head))
            head = False
        if head:
            return self.idle(now)
        return actions

    def idle(self, now: float) -> list[Action]:
        """A read found nothing new by ``now``."""
        if self.phase == "over":
            return []
        if not self.played and self.first_audio_by is not None and now > self.first_audio_by:
            return self._end(Broken(f"job {self.task_id}: no audio in time", "timeout"))
        if self.phase == "live" and now - self._last_news > self.stall_s:
            silent = f"job {self.task_id}: no audio for {self.stall_s:.0f}s (its worker stalled or died)"
            return self._end(Broken(silent, "stream_broken"))
        quiet = self.phase != "live" or now - self._last_news > self.check_s
        if quiet and now - self._last_check > self.check_s:
            self._last_check = now
            return [CheckState()]
        return []

    def job_over(self) -> list[Action]:
        """The job is in a final state and its stream has nothing more for this reader (read to the end,
        or expired): its stored file, or its result's error, from where the reader is."""
        if self.phase == "over":
            return []
        return self._end(FromStored(self.offset))

    # The rules, entry by entry ------------------------------------------------------------------

    def _entry(self, entry: StreamEntry, head: bool) -> list[Action]:
        if entry.kind == "start":
            return self._start(entry)
        if entry.kind == "audio":
            return self._audio(entry, head)
        if entry.kind == "words":
            return self._words(entry)
        if entry.kind == "end":
            if self.phase == "live" and self.played:
                try:
                    self.words.learn(result_words(entry.payload, f"stream entry {entry.id} words"))
                except CorruptRecord as exc:
                    return self._end(Broken(f"job {self.task_id}: {exc}", "corrupt_record"))
                rest = self.words.rest()
                return [*([Words(rest)] if rest else []), *self._end(Done(entry.payload or {}))]
            return self._end(FromStored(self.offset))  # behind, or nothing played (a cache hit at the worker)
        payload = entry.payload or {}
        return self._end(Failed(str(payload.get("type", "error"))[:60], str(payload.get("message", ""))[:300]))

    def _start(self, entry: StreamEntry) -> list[Action]:
        if entry.run and entry.run == self.run:
            return []  # the same run, said twice
        if self.played:
            return self._rerun()
        if entry.sample_rate not in RATES:
            return self._end(
                Broken(f"job {self.task_id}: stream names a rate of {entry.sample_rate} Hz", "corrupt_record")
            )
        self.phase, self.run, self.sample_rate, self._expected = "live", entry.run, entry.sample_rate, 0
        self.words = WordFeed()  # a run that played nothing: its words start over with it
        return []

    def _words(self, entry: StreamEntry) -> list[Action]:
        if self.phase != "live" or (entry.run and entry.run != self.run):
            return []  # another run's, or the stored file plays: the result has them
        self.words.learn(entry.words, entry.first_word)
        due = self.words.due(self.offset / self.sample_rate)
        return [Words(due)] if due else []

    def _audio(self, entry: StreamEntry, head: bool) -> list[Action]:
        if entry.run and self.run and entry.run != self.run:  # a rerun whose start was trimmed
            if self.played:
                return self._rerun()
            self.phase, self.run, self.trimmed = "behind", entry.run, True  # came late to the rerun
            return []
        if self.phase == "behind":
            return []  # the stored file has it
        if self.phase == "waiting" or entry.seq > self._expected:
            if head or self.phase == "waiting":  # trimmed before this reader got it
                self.phase, self.trimmed = "behind", True
                self.run = self.run or entry.run
                return []
            return self._end(
                Broken(f"job {self.task_id}: audio piece {self._expected} is missing from its stream", "stream_broken")
            )
        if entry.seq < self._expected:
            return []  # had it already
        self._expected += 1
        self.played = True
        self.offset += len(entry.pcm) // 2
        if entry.words:
            self.words.learn(entry.words, entry.first_word)
        return [Play(entry.pcm, self.sample_rate, self.words.due(self.offset / self.sample_rate))]

    def _rerun(self) -> list[Action]:
        return self._end(
            Broken(
                f"job {self.task_id} was run again after part of its audio was played (its worker stopped); "
                "the job completes: its result has the whole file",
                "stream_broken",
            )
        )

    def _end(self, action: Action) -> list[Action]:
        self.phase = "over"
        return [action]


def stored_pcm(chunks: Iterable[bytes], offset: int, piece_bytes: int) -> Iterator[bytes]:
    """A stored file's 16-bit mono PCM from sample ``offset`` on, in pieces of at most ``piece_bytes``,
    as its bytes come (``chunks``: the file, front to back). A 16-bit mono WAV (what ttsq stores for
    ``wav``) is cut out of its data chunk as it streams, byte for byte, holding one chunk at a time; any
    other file is decoded whole (and converted as the stored WAV would be)."""
    iterator = iter(chunks)
    head = b""
    for chunk in iterator:
        head += chunk
        if len(head) >= 4096:
            break
    data_at = _pcm16_data_start(head)
    if data_at is None:
        yield from _decoded_pcm(head + b"".join(iterator), offset, piece_bytes)
        return
    skip = data_at + 2 * offset
    pending = b""

    def rest() -> Iterator[bytes]:
        yield head
        yield from iterator

    for chunk in rest():
        if skip >= len(chunk):
            skip -= len(chunk)
            continue
        pending += chunk[skip:]
        skip = 0
        while len(pending) >= piece_bytes:
            yield pending[:piece_bytes]
            pending = pending[piece_bytes:]
    if pending:
        yield pending[: len(pending) - len(pending) % 2]


def _pcm16_data_start(head: bytes) -> int | None:
    """Where the samples of a 16-bit mono PCM WAV start, or None if ``head`` is not the start of one."""
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        return None
    at, fmt_ok = 12, False
    while at + 8 <= len(head):
        name, size = head[at : at + 4], int.from_bytes(head[at + 4 : at + 8], "little")
        if name == b"fmt ":
            body = head[at + 8 : at + 8 + 16]
            if len(body) < 16:
                return None
            tag, channels, bits = (int.from_bytes(body[i : i + 2], "little") for i in (0, 2, 14))
            fmt_ok = tag == 1 and channels == 1 and bits == 16
        elif name == b"data":
            return at + 8 if fmt_ok else None
        at += 8 + size + (size & 1)
    return None


def _decoded_pcm(data: bytes, offset: int, piece_bytes: int) -> Iterator[bytes]:
    """Any file libsndfile reads, decoded a piece at a time from sample ``offset`` (channels averaged and
    converted as ``ttsq.audio.decode`` and the stored WAV do): the compressed file and one piece held."""
    import io

    import soundfile as sf

    from ttsq.audio import pcm16

    step = max(1, piece_bytes // 2)
    with sf.SoundFile(io.BytesIO(data)) as decoded:
        if offset and decoded.seekable():
            decoded.seek(min(offset, decoded.frames))
        else:
            skip = offset
            while skip > 0 and (read := len(decoded.read(min(step, skip), dtype="float32", always_2d=True))):
                skip -= read
        while len(block := decoded.read(step, dtype="float32", always_2d=True)):
            yield pcm16(block.mean(axis=1))
