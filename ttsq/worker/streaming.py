"""A streaming job's side of the worker: its audio, from the engine to the job's Redis stream.

The engine hands a streaming row its samples on the batcher thread (``ttsq.engines.base.Piece``),
where nothing may wait on Redis; ``StreamWriter.put`` only queues them. The job's task thread, which
waits for the job anyway, writes them (``ttsq.records.streams``) while it waits: what has queued up
since its last write goes out as one piece, so a slow Redis makes pieces longer, never the engine
slower. An engine that does not stream hands over nothing; its clip is written when the call returns,
before it is encoded and stored. The stream is the early copy: when Redis refuses it, the job still
stores its file and its result, and its readers end with an error instead of a short clip.

A job that asked for timestamps gets its words in the stream as soon as the worker has them. An
engine that times its words while it speaks hands them over beside its samples (``put_words``); each
rides on the first audio entry whose audio completes it, so a reader gets a word with the piece that
ends it (``ttsq.records.playback``). Words whose audio is already out wait for the next piece; what is
left when the engine call returns (an engine that times its words only then) goes out as one ``words``
entry before the file is encoded (``finish``). Words timed by the worker's aligner come with the result
in the ``end``.

The writer keeps the stream to its window: each piece carries the sample it starts at, and each write
(one round trip, at most a window of audio) trims, with its first entry, every entry whose audio ends
more than ``AudioStreams.window_s`` seconds before the write's first piece (the ``start`` goes with the
run's first piece); the ``end`` trims the same way from the clip's end (``end_trim``). Readers further
behind continue from the stored file (``ttsq.records.playback``), so Redis holds about one window per
stream, not the clip (two at most, while a clip handed over at once is written).
"""

from __future__ import annotations

import collections
import logging
import queue
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np

from ttsq.audio import pcm_pieces
from ttsq.records.streams import audio_fields, start_fields

if TYPE_CHECKING:
    import numpy.typing as npt

    from ttsq.alignment import Word
    from ttsq.batching.jobs import BatchItem
    from ttsq.engines.base import EngineOutput
    from ttsq.observer import Observer
    from ttsq.records.streams import AudioStreams

logger = logging.getLogger(__name__)

#: Seconds of audio per piece when a whole clip is written at once.
PIECE_S = 1.0
#: The future resolved: the queue holds nothing after it.
_DONE = object()


class StreamWriter:
    """Writes one streaming job's audio to its stream; ``put`` from any thread, the rest from the job's
    task thread."""

    def __init__(
        self,
        streams: AudioStreams,
        task_id: str,
        *,
        sample_rate: int,
        observer: Observer,
        sent_at: float | None,
    ) -> None:
        self.streams = streams
        self.task_id = task_id
        self.sample_rate = sample_rate
        self.observer = observer
        #: When the producer sent the job (UNIX seconds), for the time to first audio.
        self.sent_at = sent_at
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._seq = 0
        self._at = 0  # the sample of the run the next piece starts at
        self._run: str | None = None  # the current run's name once its start is written
        #: The entries written and the sample (over every run of this writer) each one's audio ends at,
        #: oldest first: the ones still inside the window.
        self._kept: collections.deque[tuple[str, int]] = collections.deque()
        self._written = 0  # samples written, every run of this writer together
        self._keep_from: str | None = None  # the oldest entry id the stream keeps
        self._first_written = False
        self._broken = False
        self._words = 0  # the run's words written so far
        self._pending_words: list[Word] = []  # handed over, not written yet (their audio is not out)
        # Words as the engine hands them over, with the take they belong to (``put`` counts the takes:
        # None starts another). Not queued: they wait for the next samples (or the end), so a word
        # never wakes the writer on its own.
        self._handed: collections.deque[tuple[int, Sequence[Word]]] = collections.deque()
        self._takes = 0  # takes begun, as the engine's thread counts them
        self._take = 0  # the take this thread is writing

    def put(self, samples: npt.NDArray[Any] | None) -> None:
        """The engine's next samples for this row, or None: the row starts over (never blocks)."""
        if samples is None:
            self._takes += 1
        self._queue.put(samples)

    def __call__(self, samples: npt.NDArray[Any] | None) -> None:
        """``put``: the writer is the row's ``Piece``, and its ``put_words`` takes the row's words
        (``ttsq.engines.base.word_sink``)."""
        self.put(samples)

    def put_words(self, words: Sequence[Word]) -> None:
        """The row's next words, in order, times in seconds of its audio (never blocks; from the thread
        that ``put``s): each is written on the first piece whose audio ends it, handed over before or
        after it; what no piece ends goes out when the engine call returns (``finish``)."""
        self._handed.append((self._takes, tuple(words)))

    def wait(self, future: Future[BatchItem], timeout_s: float) -> BatchItem:
        """The job's batch item, writing its pieces as they come until it is done; ``FutureTimeout``
        after ``timeout_s``."""
        future.add_done_callback(lambda _: self._queue.put(_DONE))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise FutureTimeout()
            try:
                first = self._queue.get(timeout=left)
            except queue.Empty:
                raise FutureTimeout() from None
            if self._drain(first):
                return future.result(timeout=0)

    def _drain(self, first: Any) -> bool:
        """Write what has queued up, starting with ``first``; whether the future has resolved."""
        pending: list[npt.NDArray[Any]] = []
        done = False
        item = first
        while True:
            if item is _DONE:
                done = True
            elif item is None:  # starts over: what came before it is not part of the audio
                self._write(pending)
                pending = []
                self._run, self._pending_words, self._take = None, [], self._take + 1
            else:
                pending.append(item)
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
        self._write(pending)
        return done

    def finish(self, output: EngineOutput) -> None:
        """The engine call returned: an engine that streamed nothing for this row has its clip written now,
        and the words the engine timed that are not in the stream yet follow it."""
        if self._run is None and not self._broken:
            self.sample_rate = output.sample_rate
            self._write([output.samples])
        self._pending_words = []
        words = output.words[self._words :] if output.words is not None else ()
        if not words or self._broken or self._run is None:
            return
        try:
            entry = self.streams.words(self.task_id, self._words, words, run=self._run, keep_from=self._keep_from)
        except Exception as exc:  # as for audio: the job goes on, its readers end with an error
            self._broken = True
            logger.warning("job %s: could not write its stream: %s", self.task_id, type(exc).__name__)
            return
        self._kept.append((entry, self._written))
        self._words += len(words)

    def _completed(self, end: int) -> list[Word]:
        """The pending words that the audio up to sample ``end`` of the run completes (taken out)."""
        while self._handed and self._handed[0][0] <= self._take:
            take, words = self._handed.popleft()
            if take == self._take:  # an earlier take's words are not this audio's
                self._pending_words += words
        count = 0
        while count < len(self._pending_words) and self._pending_words[count].end * self.sample_rate <= end + 0.5:
            count += 1
        taken, self._pending_words = self._pending_words[:count], self._pending_words[count:]
        return taken

    def _write(self, pieces: list[npt.NDArray[Any]]) -> None:
        """What queued up since the last write: its pieces (after the run's ``start``, where it begins
        one), in one round trip per window of audio (``_send``)."""
        if not pieces or self._broken:
            return
        try:
            group: list[dict[str, str | bytes]] = []
            ends: list[int] = []  # where each entry's audio ends, over every run of this writer
            written = self._written
            if self._run is None:
                self._run = uuid.uuid4().hex[:12]
                self._seq, self._at, self._words = 0, 0, 0
                group.append(start_fields(sample_rate=self.sample_rate, run=self._run))
                ends.append(-1)  # it goes with the run's first piece: a reader needs both
            samples = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
            window = int(self.streams.window_s * self.sample_rate)
            for pcm in pcm_pieces(samples, self.sample_rate, PIECE_S):
                count = len(pcm) // 2
                if group and written + count - self._written > window:
                    self._send(group, ends)
                    group, ends = [], []
                words = self._completed(self._at + count)
                group.append(
                    audio_fields(self._seq, pcm, at=self._at, run=self._run, words=words, first_word=self._words)
                )
                self._words += len(words)
                written += count
                ends.append(written)
                if ends[0] < 0:
                    ends[0] = written
                self._seq += 1
                self._at += count
            self._send(group, ends)
        except Exception as exc:  # the early copy only: the job goes on, its readers end with an error
            self._broken = True
            logger.warning("job %s: could not write its stream: %s", self.task_id, type(exc).__name__)
            return
        if not self._first_written:
            self._first_written = True
            if self.sent_at is not None:
                self.observer.first_audio(max(0.0, time.time() - self.sent_at))

    def _send(self, group: list[dict[str, str | bytes]], ends: list[int]) -> None:
        """One round trip: ``group`` (at most a window of audio, or one piece), whose entries' audio ends
        at ``ends``, trimming the entries that end more than a window before the group's start.

        A piece per round trip cost the worker, Redis and each reader (who kept up, and took one
        entry a read) a command each: an engine that does not stream writes a whole clip at once.
        Counting the window back from the group's start, not its end, keeps every group whole until
        the one after next: a reader that keeps up, one read per group, gets every piece, where a
        group that trimmed its own pieces (a whole clip longer than the window) would cut them from
        every reader before it could read them.
        """
        if not group:
            return
        ends = [self._written if end < 0 else end for end in ends]  # a start sent before any piece
        self._trim(self._written)
        ids = self.streams.append(self.task_id, group, keep_from=self._keep_from)
        self._written = ends[-1]
        self._kept.extend(zip(ids, ends, strict=True))

    def end_trim(self) -> str | None:
        """The entry id the stream's ``end`` trims before (``AudioStreams.end``'s ``keep_from``): the
        window counted back from the clip's end, so an ended stream waiting out its grace holds one
        window, however much the last write put in. A reader still behind it plays the stored file,
        which is there by then."""
        self._trim(self._written)
        return self._keep_from

    def _trim(self, newest_end: int) -> None:
        """The entries whose audio ends more than the window before sample ``newest_end`` are out, and
        the next write trims them (``keep_from``)."""
        window = int(self.streams.window_s * self.sample_rate)
        last_out: str | None = None
        while self._kept and self._kept[0][1] <= newest_end - window:
            last_out = self._kept.popleft()[0]
        if self._kept:
            self._keep_from = self._kept[0][0]
        elif last_out is not None:  # every entry so far is out: keep only what comes after the last one
            ms, _, seq = last_out.partition("-")
            self._keep_from = f"{ms}-{int(seq or 0) + 1}"
