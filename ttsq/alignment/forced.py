"""Qwen3-ForcedAligner's text side, without torch: the units it times, its prompt, and the repair of
its raw slot times into a rising sequence. The model itself is ``ttsq.engines.qwen.aligner``.

The aligner is shown the audio and then the text, each unit followed by two ``<timestamp>`` slots::

    <|audio_start|><|audio_pad|><|audio_end|>The<timestamp><timestamp>cat<timestamp><timestamp>

One forward pass classifies every slot into a bin of ``timestamp_segment_time`` milliseconds (80 ms):
the first slot of a unit is its start, the second its end. The classes are read independently, so
they can run backwards; ``monotonic`` keeps the longest rising run and mends the rest, as the
reference implementation (the ``qwen-asr`` package, 0.0.6) does.

Units follow ``qwen-asr``'s: a word stripped to its letters, digits and apostrophes, and every CJK
ideograph (and here every kana) a unit of its own. ``qwen-asr`` cuts Japanese into words with nagisa
and Korean with soynlp; neither is a dependency here, so Japanese kana are timed one character at a
time and Korean by its space-separated words (docs/timestamps.md).
"""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence

import numpy as np

from ttsq.alignment import Word, fill_gaps, text_words

AUDIO_START = "<|audio_start|>"
AUDIO_PAD = "<|audio_pad|>"
AUDIO_END = "<|audio_end|>"
TIMESTAMP = "<timestamp>"

#: Code point ranges timed one character at a time: the CJK ideograph blocks ``qwen-asr`` splits, and
#: the kana (Japanese, which ``qwen-asr`` splits into words with a tokenizer not installed here).
_ONE_BY_ONE = (
    (0x3040, 0x30FF),  # Hiragana, Katakana
    (0x31F0, 0x31FF),  # Katakana phonetic extensions
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0xFF66, 0xFF9F),  # half-width Katakana
    (0x20000, 0x2A6DF),  # CJK extension B
    (0x2A700, 0x2CEAF),  # CJK extensions C to E
)


def _kept(ch: str) -> bool:
    return ch == "'" or unicodedata.category(ch)[0] in ("L", "N")


def _one_by_one(ch: str) -> bool:
    code = ord(ch)
    return any(low <= code <= high for low, high in _ONE_BY_ONE)


def units(word: str) -> list[str]:
    """The units the aligner times for one whitespace-separated word: its letters, digits and
    apostrophes, with each CJK ideograph and kana a unit of its own; none for punctuation alone."""
    out: list[str] = []
    run: list[str] = []
    for ch in word:
        if not _kept(ch):
            continue
        if _one_by_one(ch):
            if run:
                out.append("".join(run))
                run = []
            out.append(ch)
        else:
            run.append(ch)
    if run:
        out.append("".join(run))
    return out


def prompt(unit_list: Sequence[str], audio_tokens: int) -> str:
    """The aligner's input text: the audio's ``audio_tokens`` placeholders, then every unit followed
    by its two ``<timestamp>`` slots (a start and an end)."""
    return AUDIO_START + AUDIO_PAD * audio_tokens + AUDIO_END + "".join(unit + TIMESTAMP * 2 for unit in unit_list)


def audio_tokens(frames: int) -> int:
    """How many audio embeddings the encoder makes of ``frames`` mel frames (100 a second): 13 for each
    whole window of 100 frames, and the three stride-2 convolutions' output of the rest."""
    rest = frames % 100
    after_first = (rest - 1) // 2 + 1
    return ((after_first - 1) // 2 + 1 - 1) // 2 + 1 + (frames // 100) * 13


def monotonic(values: Sequence[float]) -> list[float]:
    """``values`` made non-decreasing the way ``qwen-asr`` repairs slot times: the longest
    non-decreasing subsequence stays (the earliest such on ties); a run of at most two others takes the
    nearer kept neighbour's value (the earlier on a tie), a longer run is spread evenly between its
    kept neighbours (or copies the one it has)."""
    data = np.asarray(values, dtype=np.float64)
    n = int(data.size)
    if n == 0:
        return []
    length = np.ones(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    for i in range(1, n):
        eligible = np.flatnonzero(data[:i] <= data[i])
        if eligible.size:
            best = eligible[np.argmax(length[eligible])]  # argmax: the first of the longest
            if length[best] + 1 > length[i]:
                length[i] = length[best] + 1
                parent[i] = best
    kept = np.zeros(n, dtype=bool)
    at = int(np.argmax(length))
    while at != -1:
        kept[at] = True
        at = int(parent[at])
    out: list[float] = data.tolist()
    i = 0
    while i < n:
        if kept[i]:
            i += 1
            continue
        j = i
        while j < n and not kept[j]:
            j += 1
        left = out[i - 1] if i > 0 else None  # the run's neighbours are kept (or the ends)
        right = out[j] if j < n else None
        for k in range(i, j):
            if right is None:
                out[k] = left if left is not None else out[k]  # a kept value always exists: never the else
            elif left is None:
                out[k] = right
            elif j - i <= 2:
                out[k] = left if k - (i - 1) <= j - k else right
            else:
                out[k] = left + (right - left) / (j - i + 1) * (k - i + 1)
        i = j
    return out


def word_times(text: str, unit_counts: Sequence[int], slots_s: Sequence[float], duration_s: float) -> list[Word]:
    """Every word of ``text`` timed from the repaired slot times (seconds, two per unit, in order):
    a word runs from its first unit's start to its last unit's end; a word with no units (punctuation
    alone) is spread between its neighbours (``fill_gaps``), which also keeps every time in the clip."""
    words = [word for word, _, _ in text_words(text)]
    if len(unit_counts) != len(words) or len(slots_s) != 2 * sum(unit_counts):
        raise ValueError(f"{len(words)} words, {len(unit_counts)} unit counts and {len(slots_s)} slot times")
    placed: list[tuple[float, float] | None] = []
    at = 0
    for count in unit_counts:
        placed.append((slots_s[2 * at], slots_s[2 * (at + count) - 1]) if count else None)
        at += count
    return fill_gaps(words, placed, duration_s)
