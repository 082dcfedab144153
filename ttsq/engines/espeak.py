"""espeak-ng: real, intelligible speech on any CPU, from the ``espeakng-loader`` wheel.

It is the embedded default and the engine of the tests: formant synthesis in a few milliseconds per
sentence, so the queue's own costs stay visible. It cannot follow a voice description or sampling
settings; it says so in each result's ``ignored`` list instead of dropping them silently.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import unicodedata
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ttsq.alignment import Word, fill_gaps, text_words
from ttsq.engines.base import FRAMES_PER_SECOND, EngineIdentity, EngineOutput, Piece, word_sink
from ttsq.errors import EngineError, EngineUnavailable, InvalidRequest

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.job import SynthesisRequest

logger = logging.getLogger(__name__)

#: Qwen3-TTS language names -> espeak-ng voices. All ten Qwen languages exist in espeak-ng.
VOICES = {
    "chinese": "cmn",
    "english": "en-us",
    "japanese": "ja",
    "korean": "ko",
    "german": "de",
    "french": "fr",
    "russian": "ru",
    "portuguese": "pt",
    "spanish": "es",
    "italian": "it",
}
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000  # without it a failed init exits the whole process
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_IGNORED = ("instruct", "seed", "temperature", "top_p", "top_k", "repetition_penalty")


class _Event(ctypes.Structure):
    """espeak-ng's ``espeak_EVENT`` (speak_lib.h): what its synthesis callback reports beside the audio."""

    _fields_ = (
        ("type", ctypes.c_int),
        ("unique_identifier", ctypes.c_uint),
        ("text_position", ctypes.c_int),  # 1-based, in characters of the text (espeakCHARS_UTF8)
        ("length", ctypes.c_int),
        ("audio_position", ctypes.c_int),  # milliseconds
        ("sample", ctypes.c_int),  # samples since the start of the synthesis: the exact position
        ("user_data", ctypes.c_void_p),
        ("id", ctypes.c_void_p),
    )


_EVENT_LIST_TERMINATED = 0
_EVENT_WORD = 1
_EVENT_END = 5  # the end of a clause or sentence
_SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


class EspeakEngine:
    """espeak-ng through ctypes. Not thread-safe: only the batcher thread calls it.

    It streams (``streams_audio``): a streaming row's audio is handed over as espeak's synthesis
    callback delivers it, a clause or so at a time, while the rest of the text is still being spoken;
    with timestamps, its words follow as soon as each one's time is final (``WordClock``).
    """

    streams_audio = True

    def __init__(self, settings: Settings) -> None:
        self._lib: Any = None
        self._chunks: list[np.ndarray[Any, np.dtype[np.int16]]] = []
        #: The current call's word and clause-end events: (type, text position, sample).
        self._events: list[tuple[int, int, int]] = []
        #: Where the current row's audio goes as it is made, and how many samples it may still take.
        self._piece: Piece | None = None
        self._room = 0
        #: The current streaming row's word times, as espeak speaks, and where they go.
        self._clock: WordClock | None = None
        self._say: Callable[[Sequence[Word]], object] | None = None
        self._callback = _SynthCallback(self._collect)  # kept alive for as long as espeak holds it
        self.identity = EngineIdentity(
            engine="espeak",
            model="espeak-ng",
            revision="unloaded",
            sample_rate=22050,
            modes=("voice_design",),
            languages=("auto", *VOICES),
        )

    def load(self) -> None:
        """Load libespeak-ng from the wheel and point it at the wheel's voice data."""
        try:
            import espeakng_loader
        except ImportError as exc:
            raise EngineUnavailable("espeakng-loader is not installed: pip install espeakng-loader") from exc
        lib = ctypes.CDLL(espeakng_loader.get_library_path())
        lib.espeak_Info.restype = ctypes.c_char_p
        # The compiled-in data path points at the wheel's build machine: always pass ours.
        rate = lib.espeak_Initialize(
            _AUDIO_OUTPUT_SYNCHRONOUS, 0, espeakng_loader.get_data_path().encode(), _INITIALIZE_DONT_EXIT
        )
        if rate <= 0:
            raise EngineUnavailable("espeak-ng failed to initialize (data path missing?)")
        lib.espeak_SetSynthCallback(self._callback)
        self._lib = lib
        version = lib.espeak_Info(None).decode()
        self.identity = EngineIdentity(
            engine="espeak",
            model="espeak-ng",
            revision=version,
            sample_rate=rate,
            modes=self.identity.modes,
            languages=self.identity.languages,
        )
        logger.info("espeak-ng %s loaded (%d Hz)", version, rate)

    def warmup(self) -> None:
        """Speak two words, so the first job pays no first-call cost."""
        self._speak("warm up", "en-us")

    def synthesize_batch(
        self, requests: Sequence[SynthesisRequest], pieces: Sequence[Piece | None] | None = None
    ) -> list[EngineOutput | Exception]:
        """espeak has no batch dimension: one call per request, failures in their slots."""
        sinks = list(pieces) if pieces is not None else [None] * len(requests)
        return [self._one(request, piece) for request, piece in zip(requests, sinks, strict=True)]

    def close(self) -> None:
        """Free espeak-ng's buffers."""
        if self._lib is not None:
            self._lib.espeak_Terminate()
            self._lib = None

    def _one(self, request: SynthesisRequest, piece: Piece | None = None) -> EngineOutput | Exception:
        try:
            self.identity.check(request)
        except InvalidRequest as exc:
            return exc
        voice = VOICES.get(request.language) or VOICES[guess_language(request.text)]
        cap = None
        if request.max_new_tokens is not None:
            cap = int(request.max_new_tokens / FRAMES_PER_SECOND * self.identity.sample_rate)
        # A streaming row is handed its audio up to the cap, so its output is what it handed over.
        self._piece, self._room = piece, cap if cap is not None else -1
        say = word_sink(piece) if request.timestamps and cap is None else None
        clock = WordClock(request.text, self.identity.sample_rate, self._chunks) if say is not None else None
        self._clock, self._say = clock, say
        try:
            samples = self._speak(request.text, voice)
        finally:
            self._piece, self._clock, self._say = None, None, None
        if samples.size == 0 or not np.any(samples):
            return EngineError("espeak produced no audio for this text")
        truncated = False
        if cap is not None:
            truncated = samples.size > cap
            samples = samples[:cap]
        ignored = tuple(name for name in _IGNORED if getattr(request, name) not in (None, ""))
        words = None
        if clock is not None:  # what it handed over, and the rest: the words of ``word_times``
            clock.ready(final=True)
            words = tuple(clock.words)
        elif request.timestamps:
            words = tuple(word_times(request.text, self._events, samples, self.identity.sample_rate))
        return EngineOutput(samples, self.identity.sample_rate, truncated=truncated, ignored=ignored, words=words)

    def _speak(self, text: str, voice: str) -> np.ndarray[Any, np.dtype[np.int16]]:
        if self._lib is None:
            raise EngineError("espeak engine used before load()")
        if self._lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise EngineError(f"espeak-ng has no voice {voice!r}")
        self._chunks.clear()
        self._events.clear()
        data = text.encode("utf-8")
        self._lib.espeak_Synth(data, len(data) + 1, 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if not self._chunks:
            return np.zeros(0, dtype=np.int16)
        return np.concatenate(self._chunks)

    def _collect(self, wav: Any, n_samples: int, events: Any) -> int:
        index = 0
        clock = self._clock
        # The word events come with the audio they start in; reading them costs a few attribute
        # reads per word, so they are always kept (timestamps need no second synthesis).
        while events and (kind := events[index].type) != _EVENT_LIST_TERMINATED:
            if kind in (_EVENT_WORD, _EVENT_END):
                event = events[index]
                self._events.append((kind, event.text_position, event.sample))
                if clock is not None:
                    clock.event(kind, event.text_position, event.sample)
            index += 1
        if wav and n_samples > 0:
            # Copy the bytes out: np.ctypeslib.as_array would make (and cache forever) a ctypes array
            # type per distinct chunk length, which a soak of distinct texts sees as a steady leak.
            chunk = np.frombuffer(ctypes.string_at(wav, n_samples * 2), dtype=np.int16)
            self._chunks.append(chunk)
            if self._piece is not None and self._room != 0:
                handed = chunk if self._room < 0 else chunk[: self._room]
                if self._room > 0:
                    self._room -= handed.size
                # Words become final with a boundary's event (or, rarely, the audio up to a known one):
                # the clock reads the chunks the engine keeps, and most callbacks cost it nothing.
                if clock is not None and self._say is not None and clock.waiting and (timed := clock.ready()):
                    self._say(timed)  # before the samples that complete them: written on their piece
                self._piece(handed)
        return 0


#: ``WordClock`` waits for the next event before it looks again.
_NEVER = 2**62
#: A sample quieter than this (of int16's full scale) is silence, when a word's end is trimmed.
_SILENCE = 300


def word_times(
    text: str, events: Sequence[tuple[int, int, int]], samples: np.ndarray[Any, np.dtype[np.int16]], rate: int
) -> list[Word]:
    """Every word of ``text`` (``text_words``) timed by espeak-ng's own events over a whole clip
    (``WordClock``, run once to the end)."""
    clock = WordClock(text, rate)
    for kind, position, sample in events:
        clock.event(kind, position, sample)
    clock.audio(samples)
    clock.ready(final=True)
    return clock.words


class WordClock:
    """Word times from espeak-ng's events, a stretch at a time as it speaks.

    A word lies between the sample of the first word event inside it and its limit, the next boundary
    (the next timed word's event or a clause's end), less the silence at either end; a word with no
    event of its own (a lone dash) is spread between its neighbours (``fill_gaps``). espeak reports its
    events in the order of the audio, so a word's limit is known once any boundary after it has come,
    and its time is final once the audio up to that boundary has: ``ready`` times the words final so
    far, and, at the end (``final``), the rest, up to the end of the audio. Timed in stretches or at
    once, the words are the same."""

    def __init__(self, text: str, rate: int, chunks: list[np.ndarray[Any, np.dtype[np.int16]]] | None = None) -> None:
        """``chunks``: the clip's samples as they come (a list the caller appends to), else ``audio``'s."""
        self.rate = rate
        self._spans = text_words(text)
        self._starts = [start for _, start, _ in self._spans]
        self._event_at: list[int | None] = [None] * len(self._spans)  # each word's first event (sample)
        self._clause_ends: list[int] = []
        self._chunks = chunks if chunks is not None else []
        self._offsets: list[int] = []  # each chunk's first sample, for the chunks counted so far
        self.total = 0
        #: The words timed so far, in order.
        self.words: list[Word] = []
        self._last_event = -1  # the last word with an event: none after it has one yet
        # Nothing can be final before a new event comes or the audio reaches this sample (a call of
        # ``ready`` per callback, a few hundred a clip, mostly returns here).
        self._wait_for: int | None = None

    def event(self, kind: int, position: int, sample: int) -> None:
        """A word or clause-end event: ``position`` 1-based in the text's characters, ``sample`` where."""
        self._wait_for = None
        if kind == _EVENT_END:
            bisect.insort(self._clause_ends, sample)
            return
        index = bisect.bisect_right(self._starts, position - 1) - 1
        if 0 <= index < len(self._spans) and position - 1 < self._spans[index][2] and self._event_at[index] is None:
            self._event_at[index] = sample
            self._last_event = max(self._last_event, index)

    def audio(self, samples: np.ndarray[Any, np.dtype[np.int16]]) -> None:
        """The next samples of the clip."""
        self._chunks.append(samples)

    @property
    def waiting(self) -> bool:
        """Whether ``ready`` may find words final: events came since it last looked, or a word waits
        for the audio up to a boundary already known (else only the next event can make one final)."""
        return self._wait_for != _NEVER

    def _count(self) -> None:
        """Count the chunks that came since the last call (``total``, ``_offsets``)."""
        for chunk in self._chunks[len(self._offsets) :]:
            self._offsets.append(self.total)
            self.total += int(chunk.size)

    def ready(self, *, final: bool = False) -> list[Word]:
        """The words whose times are final now (all the rest when ``final``), appended to ``words``."""
        self._count()
        if not final and self._wait_for is not None and self.total < self._wait_for:
            return []
        first, n = len(self.words), len(self._spans)
        stop, limits = first, {}
        self._wait_for = _NEVER  # unless the scan finds a boundary whose audio is to come: the next event
        for index in range(first, min(n, self._last_event + 1) if not final else n):
            at = self._event_at[index]
            if at is None:
                continue
            limit = self._limit(index, at, final)
            if limit is None:
                break
            limits[index] = limit
            stop = index + 1
        if final:
            stop = n
        placed: list[tuple[float, float] | None] = []
        for index in range(first, stop):
            at = self._event_at[index]
            if at is None:
                placed.append(None)
                continue
            limit = min(max(limits[index], at), self.total)
            # espeak places a word's event before the pause that precedes it (after a comma, a full
            # stop): the word is said where its sound starts, and ends where its sound ends.
            span = self._samples(at, limit)
            loud = (span > _SILENCE) | (span < -_SILENCE)  # |sample| > _SILENCE, in int16
            if loud.any():
                start, end = at + int(loud.argmax()), at + loud.size - int(loud[::-1].argmax())
            else:
                start, end = at, limit
            placed.append((start / self.rate, end / self.rate))
        words = [word for word, _, _ in self._spans[first:stop]]
        timed = fill_gaps(words, placed, self.total / self.rate, before=self.words[-1] if self.words else None)
        self.words += timed
        return timed

    def _limit(self, index: int, at: int, final: bool) -> int | None:
        """Where the word at sample ``at`` must end by: the next boundary after it, once known and
        its audio has come (the end of the audio, at the end); None while it is not."""
        following = None
        for later in range(index + 1, len(self._event_at) if final else self._last_event + 1):
            if (following := self._event_at[later]) is not None:
                break
        clause = bisect.bisect_right(self._clause_ends, at)
        ends = self._clause_ends[clause] if clause < len(self._clause_ends) else None
        bounds = [bound for bound in (following, ends) if bound is not None]
        if final:
            return min([*bounds, self.total]) if at < self.total else self.total
        if not bounds:
            return None
        if min(bounds) > self.total:  # known, and its audio is still to come
            self._wait_for = min(bounds)
            return None
        return min(bounds)

    def _samples(self, start: int, stop: int) -> np.ndarray[Any, np.dtype[np.int16]]:
        """Samples ``start`` to ``stop`` of the clip so far."""
        if stop <= start:
            return np.zeros(0, dtype=np.int16)
        first = max(0, bisect.bisect_right(self._offsets, start) - 1)
        last = bisect.bisect_left(self._offsets, stop)
        joined = np.concatenate(self._chunks[first:last]) if last - first > 1 else self._chunks[first]
        base = self._offsets[first]
        return joined[start - base : stop - base]


def guess_language(text: str) -> str:
    """The language for ``auto``, from the script of the text (Hangul, kana, Han, Cyrillic, else English)."""
    counts = {"korean": 0, "japanese": 0, "chinese": 0, "russian": 0}
    for ch in text:
        name = unicodedata.name(ch, "")
        if name.startswith("HANGUL"):
            counts["korean"] += 1
        elif name.startswith(("HIRAGANA", "KATAKANA")):
            counts["japanese"] += 1
        elif name.startswith("CJK UNIFIED"):
            counts["chinese"] += 1
        elif name.startswith("CYRILLIC"):
            counts["russian"] += 1
    if counts["japanese"]:  # Japanese mixes kanji with kana; any kana decides it
        return "japanese"
    best = max(counts, key=lambda name: counts[name])
    return best if counts[best] else "english"
