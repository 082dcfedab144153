"""When each word is said: word times for stored audio, and the aligners that find them.

    words = output.words or aligner_for(identity.engine, settings).align(samples, rate, text, language)

A ``Word`` is a word of the request's text (split at whitespace, punctuation kept) with its start and
end in seconds of the stored audio. Every aligner returns every word of the text, in order, inside the
clip: a word the aligner could not place is spread between its placed neighbours by its length, so a
caption never loses text.

Which aligner a job gets (docs/timestamps.md):

- **native**: the engine reports its own word times while it synthesizes (espeak-ng's word events);
  exact, and free: no second pass over the audio.
- **whisper**: faster-whisper's word timestamps matched to the known text (``ttsq.alignment.whisper``),
  on the CPU from wheels: Whisper ``tiny.en`` for English (the extra ``fidelity``), multilingual Whisper
  ``base`` for every other language (``fidelity-multilingual``).

- **qwen-aligner**: Qwen3-ForcedAligner-0.6B, vLLM-Omni's aligner for Qwen3-TTS
  (``ttsq.engines.qwen.aligner``, with its torch-free text side in ``ttsq.alignment.forced``): one
  forward pass of a local checkpoint on the qwen engines' device, for GPU deployments.

Aligners are found by name in ``ALIGNERS`` and imported only when chosen (faster-whisper and torch
stay out of producers).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ttsq.errors import ConfigError, CorruptRecord, EngineUnavailable

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from ttsq.config import Settings

#: What a request may ask for: no timestamps, or word times.
Timestamps = Literal["word"]
TIMESTAMPS: tuple[str, ...] = ("word",)
#: Bump when the word times an aligner writes change meaning (the stored ``.words.json`` is keyed by it).
WORDS_VERSION = 1


@dataclass(frozen=True)
class Word:
    """One word of the text, and when it is said: seconds from the start of the stored audio."""

    word: str
    start: float
    end: float

    def to_dict(self) -> dict[str, Any]:
        """``{"word", "start", "end"}``, times to the millisecond, rounded down: a word that ends with the
        clip stays inside its ``duration_s`` (rounded to 0.1 ms), where rounding to nearest could put its
        end half a millisecond past it."""
        return {"word": self.word, "start": _millis(self.start), "end": _millis(self.end)}

    def shifted(self, seconds: float) -> Word:
        """The same word, ``seconds`` later (a document chunk's start in the stitched file)."""
        return Word(self.word, self.start + seconds, self.end + seconds)


def _millis(seconds: float) -> float:
    # A nanosecond of slack: the same time reached by two sums (a piece's start plus a word's offset,
    # or the word's own) may differ in its last bits, and must not fall on two sides of a millisecond.
    return math.floor(seconds * 1000 + 1e-6) / 1000


def words_to_json(words: Sequence[Word]) -> list[dict[str, Any]]:
    """Plain JSON: a list of ``{"word", "start", "end"}``."""
    return [word.to_dict() for word in words]


def parse_words(value: object, *, field: str = "words") -> list[Word]:
    """Words read back from storage or a result: untrusted, checked here (strings, finite times, each
    word ending after it starts, starts in order); anything else is a ``CorruptRecord`` naming ``field``."""
    if not isinstance(value, list):
        raise CorruptRecord(field, f"is a {type(value).__name__}, not a list")
    words: list[Word] = []
    last = 0.0
    for index, item in enumerate(value):
        if not isinstance(item, dict):
            raise CorruptRecord(field, f"item {index} is not a JSON object")
        word, start, end = item.get("word"), item.get("start"), item.get("end")
        if not isinstance(word, str) or not word:
            raise CorruptRecord(field, f"item {index} has no word")
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) for t in (start, end)):
            raise CorruptRecord(field, f"item {index} has no finite start and end")
        assert isinstance(start, (int, float)) and isinstance(end, (int, float))  # for mypy: checked above
        if start < 0 or end < start or start < last:
            raise CorruptRecord(field, f"item {index} is out of order ({start}..{end} after {last})")
        last = float(start)
        words.append(Word(word, float(start), float(end)))
    return words


class Aligner(Protocol):
    """Finds when each word of ``text`` is said in ``samples`` (mono, float or int16, at ``rate``).

    Returns every whitespace-separated word of ``text`` once, in order, with times inside the clip.
    Called from one thread at a time; loads its model on first use.
    """

    name: str

    def align(self, samples: npt.NDArray[Any], rate: int, text: str, language: str) -> list[Word]: ...


#: name -> "module:factory" (the factory takes the settings). ``native`` is not here: it is the engine.
#: A string, not an import: the qwen aligner's module imports torch, which only its workers load.
ALIGNERS: dict[str, str] = {
    "whisper": "ttsq.alignment.whisper:from_settings",
    "qwen-aligner": "ttsq.engines.qwen.aligner:QwenForcedAligner",
}


def create_aligner(name: str, settings: Settings) -> Aligner:
    """The aligner registered as ``name``, built from ``settings`` (its model loads on first use)."""
    target = ALIGNERS.get(name)
    if target is None:
        raise ConfigError("TTSQ_ALIGNER", f"unknown aligner {name!r}; expected one of {', '.join(sorted(ALIGNERS))}")
    module_name, factory = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = " (pip install 'ttsq[qwen]')" if name == "qwen-aligner" else ""
        raise EngineUnavailable(f"aligner {name!r} cannot be imported ({exc}){hint}") from exc
    aligner: Aligner = getattr(module, factory)(settings)
    return aligner


def text_words(text: str) -> list[tuple[str, int, int]]:
    """The words of ``text`` as captions show them: whitespace-separated, punctuation kept, each with
    its character range in ``text``."""
    out: list[tuple[str, int, int]] = []
    start = None
    for index, ch in enumerate(text):
        if ch.isspace():
            if start is not None:
                out.append((text[start:index], start, index))
                start = None
        elif start is None:
            start = index
    if start is not None:
        out.append((text[start:], start, len(text)))
    return out


def fill_gaps(
    words: Sequence[str],
    placed: Sequence[tuple[float, float] | None],
    duration_s: float,
    before: Word | None = None,
) -> list[Word]:
    """Every word with a time: the placed ones as they are (clipped into the clip, starts made to run
    in order), each run of unplaced ones spread over the gap between its placed neighbours by length.
    ``before``: the word said before the first of these (words timed a stretch at a time, as espeak
    speaks; the stretches together are timed as the whole would be)."""
    out: list[Word] = []
    n = len(words)
    index = 0
    while index < n:
        previous = out[-1] if out else before
        floor = previous.start if previous else 0.0
        times = placed[index]
        if times is not None:
            start = min(max(times[0], floor), duration_s)
            out.append(Word(words[index], start, min(max(times[1], start), duration_s)))
            index += 1
            continue
        run_end = index
        while run_end < n and placed[run_end] is None:
            run_end += 1
        gap_start = min(max(previous.end if previous else 0.0, floor), duration_s)
        following = placed[run_end] if run_end < n else None
        gap_end = max(min(following[0], duration_s) if following is not None else duration_s, gap_start)
        weights = [max(1, len(word)) for word in words[index:run_end]]
        total = sum(weights)
        at = gap_start
        for offset, weight in enumerate(weights):
            span = (gap_end - gap_start) * weight / total
            out.append(Word(words[index + offset], at, at + span))
            at += span
        index = run_end
    return out


def duration(samples: npt.NDArray[np.generic], rate: int) -> float:
    """Seconds of audio."""
    return int(samples.shape[0]) / rate
