"""Words compared as speech is heard: normalized (case, punctuation, digits as words) and aligned by
word edit distance. The fidelity check (``ttsq.testing.fidelity``) scores transcripts with them, and the
recogniser-based aligner (``ttsq.alignment.whisper``) matches a recogniser's words to the known text.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

import numpy as np

# fmt: off
_ONES = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
         "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen")
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
# fmt: on
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_WORD = re.compile(r"[^\W_]+")


def number_words(n: int) -> str:
    """An integer in English words ("one hundred twenty three"); past the millions, digit by digit."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + number_words(n % 100))
    for size, name in ((1_000_000, "million"), (1000, "thousand")):
        if size <= n < size * 1000:
            rest = n % size
            return number_words(n // size) + " " + name + ("" if rest == 0 else " " + number_words(rest))
    return " ".join(_ONES[int(digit)] for digit in str(n))


def _spell_number(match: re.Match[str]) -> str:
    token = match.group(0)
    if re.fullmatch(r"\d{1,3}(?:,\d{3})+", token):  # 1,500
        return number_words(int(token.replace(",", "")))
    whole, _, fraction = token.replace(",", ".").partition(".")
    words = number_words(int(whole))
    if fraction:
        words += " point " + " ".join(_ONES[int(digit)] for digit in fraction if digit.isdigit())
    return " " + words + " "


def normalize(text: str) -> list[str]:
    """The words of ``text`` as both sides are compared: lowercase, no punctuation, digits as words."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = re.sub(r"['\u2019\u02bc]", "", text)  # don't -> dont, on both sides alike
    text = _NUMBER.sub(_spell_number, text)
    return _WORD.findall(text)


def align(reference: Sequence[str], hypothesis: Sequence[str]) -> list[tuple[int | None, int | None]]:
    """A minimum word edit alignment: (reference index, hypothesis index) pairs in order; None on one
    side is a deletion (the word is not heard) or an insertion (a word the reference does not have)."""
    n, m = len(reference), len(hypothesis)
    vocabulary: dict[str, int] = {}
    ref = np.array([vocabulary.setdefault(word, len(vocabulary)) for word in reference], dtype=np.int64)
    hyp = np.array([vocabulary.setdefault(word, len(vocabulary)) for word in hypothesis], dtype=np.int64)
    table = np.empty((n + 1, m + 1), dtype=np.int32)
    table[0] = np.arange(m + 1)
    columns = np.arange(m + 1, dtype=np.int32)
    for i in range(1, n + 1):
        # D[i][j] = min(D[i-1][j] + 1, D[i-1][j-1] + cost, D[i][j-1] + 1); the last term, a running
        # minimum along the row, is j + cummin(t[k] - k) over the first two.
        step = np.empty(m + 1, dtype=np.int32)
        step[0] = i
        step[1:] = np.minimum(table[i - 1, 1:] + 1, table[i - 1, :-1] + (hyp != ref[i - 1]))
        table[i] = np.minimum.accumulate(step - columns) + columns
    pairs: list[tuple[int | None, int | None]] = []
    i, j = n, m
    while i or j:
        if i and j and table[i, j] == table[i - 1, j - 1] + (reference[i - 1] != hypothesis[j - 1]):
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
        elif i and table[i, j] == table[i - 1, j] + 1:
            pairs.append((i - 1, None))
            i -= 1
        else:
            pairs.append((None, j - 1))
            j -= 1
    pairs.reverse()
    return pairs
