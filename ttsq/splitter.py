"""Cutting a document into chunks a TTS model reads well: sentences packed up to a target length.

``normalize`` gives a document's normalized input; ``split`` returns chunks whose ``raw`` slices, joined,
give it back exactly, each chunk's ``text`` (what is synthesized) being its ``raw`` without the whitespace
it ends with. Chunks end at sentence ends and never cross a paragraph break. The rules for the normalized
input, sentence ends and cuts inside a long sentence: docs/documents.md, step 1 ("Split").
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field
from typing import Literal

#: Bump when the same text and settings would be cut differently: it is part of the document key.
SPLITTER_VERSION = 2

#: How a chunk ends, which decides the join to the next one: a crossfade inside a sentence, a short
#: pause between sentences, a longer one between paragraphs; ``end`` is the last chunk.
Boundary = Literal["split", "sentence", "paragraph", "end"]

PARAGRAPH = "\n\n"
_PARAGRAPH_RUN = re.compile(r"\s*\n\s*\n\s*|\s*[\u2029]\s*")
_SPACE_RUN = re.compile(r"\s+")

_LATIN_ENDS = ".!?…‼⁇⁈⁉"
_CJK_ENDS = "。！？｡．"
# Right after a sentence mark these close a quote or bracket, whatever they open elsewhere: German
# „…“ and ‚…‘, and »…« in German style.
_CLOSERS = "\"'”’»›“‘«‹)]}」』）】〕〉》〗〙〛"
# French sets its closing guillemets off with a space: « Bonjour. »
_SPACED_CLOSERS = "»›"
# Japanese quotative particles: 「…。」と言った goes on after the closing bracket.
_QUOTATIVE = "とっ"
# Clause marks that make a fair cut inside a long sentence. CJK ones need no space after them.
_CLAUSE_MARKS = ",;:—–"
_CJK_CLAUSE_MARKS = "，、；：﹐﹑"
# Words that end with a dot but rarely end a sentence (English, German, Spanish, French, Italian,
# Portuguese, Russian).
_ABBREVIATIONS = frozenset(
    {
        "nr",
        "hr",
        "fr",
        "str",
        "tel",
        "sig",
        "sigg",
        "dott",
        "ing",
        "avv",
        "exmo",
        "exma",
        "ул",
        "им",
        "проф",
        "тов",
        "mr",
        "mrs",
        "ms",
        "dr",
        "prof",
        "sr",
        "jr",
        "st",
        "vs",
        "al",
        "e.g",
        "i.e",
        "no",
        "nos",
        "vol",
        "fig",
        "figs",
        "approx",
        "dept",
        "est",
        "inc",
        "ltd",
        "co",
        "corp",
        "jan",
        "feb",
        "mar",
        "apr",
        "jun",
        "jul",
        "aug",
        "sep",
        "sept",
        "oct",
        "nov",
        "dec",
        "mt",
        "ft",
        "cf",
        "ca",
        "p",
        "pp",
        "ed",
        "eds",
        "rev",
        "gen",
        "gov",
        "sen",
        "rep",
        "u.s",
        "u.k",
        "a.m",
        "p.m",
        "z.b",
        "d.h",
        "usw",
        "bzw",
        "sra",
        "sres",
        "dra",
        "srta",
        "av",
        "ud",
        "uds",
        "a.c",
        "d.c",
    }
)


@dataclass(frozen=True)
class Sentence:
    """A sentence (or a piece of an over-long one) inside a chunk, by offsets into the normalized input."""

    start: int
    end: int


@dataclass(frozen=True)
class Chunk:
    """One synthesis job's worth of a document."""

    #: The exact slice of the normalized input, trailing whitespace included.
    raw: str
    #: Offsets of ``raw`` in the normalized input.
    start: int
    end: int
    boundary: Boundary
    #: The sentences (or pieces) it holds, offsets into the normalized input, trailing space excluded.
    sentences: tuple[Sentence, ...] = field(default=())

    @property
    def text(self) -> str:
        """What is synthesized: ``raw`` without its trailing whitespace."""
        return self.raw.rstrip()


def normalize(text: str) -> str:
    """The normalized input (see the module docstring)."""
    text = unicodedata.normalize("NFC", text).replace("\r\n", "\n").replace("\r", "\n")
    paragraphs = [_SPACE_RUN.sub(" ", part).strip() for part in _PARAGRAPH_RUN.split(text)]
    return PARAGRAPH.join(part for part in paragraphs if part)


def split(text: str, *, target_chars: int, max_chars: int) -> list[Chunk]:
    """Chunks of the normalized ``text``: each ``text`` at most ``max_chars``, sentences packed up to
    ``target_chars``, paragraphs never mixed. Raises ``ValueError`` on limits that make no sense."""
    if not 1 <= target_chars <= max_chars:
        raise ValueError(f"need 1 <= target_chars ({target_chars}) <= max_chars ({max_chars})")
    normalized = normalize(text)
    chunks: list[Chunk] = []
    position = 0
    paragraphs = normalized.split(PARAGRAPH)
    for number, paragraph in enumerate(paragraphs):
        last_paragraph = number == len(paragraphs) - 1
        units = [piece for start, end in _sentences(paragraph) for piece in _pieces(paragraph, start, end, max_chars)]
        packed = _pack(paragraph, units, target_chars, max_chars)
        base = position  # where this paragraph starts in the normalized input
        for index, (start, end, boundary) in enumerate(packed):
            raw = paragraph[start:end]
            if index == len(packed) - 1:
                boundary = "end" if last_paragraph else "paragraph"
                if not last_paragraph:
                    raw += PARAGRAPH
            sentences = tuple(
                Sentence(base + s, base + s + len(paragraph[s:e].rstrip())) for s, e, _ in units if start <= s < end
            )
            chunks.append(
                Chunk(raw=raw, start=position, end=position + len(raw), boundary=boundary, sentences=sentences)
            )
            position += len(raw)
    return chunks


def _sentences(paragraph: str) -> list[tuple[int, int]]:
    """Sentence spans of one paragraph; each span takes the spaces after it."""
    spans: list[tuple[int, int]] = []
    start = 0
    i = 0
    n = len(paragraph)
    while i < n:
        ch = paragraph[i]
        if ch in _CJK_ENDS and not (ch == "．" and _digit_around(paragraph, i)):
            j = _skip(paragraph, i + 1, _CJK_ENDS + _LATIN_ENDS)
            closed = _skip(paragraph, j, _CLOSERS)
            if closed > j and closed < n and paragraph[closed] in _QUOTATIVE:
                i = closed  # a quoted sentence inside a longer one
                continue
            j = _skip(paragraph, closed, " ")
            spans.append((start, j))
            start = i = j
            continue
        if ch in _LATIN_ENDS:
            marks = _skip(paragraph, i + 1, _LATIN_ENDS)
            j = _spaced_closers(paragraph, _skip(paragraph, marks, _CLOSERS))
            run = paragraph[i:marks]
            if (
                i > 0
                and j < n
                and _is_cjk(paragraph[i - 1])
                and _is_cjk(paragraph[j])
                and "…" not in run
                and ".." not in run
            ):  # 我想……也许: an ellipsis inside a sentence
                spans.append((start, j))  # "다.그는", "你好!我": CJK and Hangul need no space after a mark
                start = i = j
                continue
            if j < n and paragraph[j] == " " and _ends_sentence(paragraph, i, j):
                j = _skip(paragraph, j, " ")
                spans.append((start, j))
                start = i = j
                continue
            i = j
            continue
        i += 1
    if start < n:
        spans.append((start, n))
    return spans


def _ends_sentence(paragraph: str, mark: int, after: int) -> bool:
    """Whether the Latin mark at ``mark`` (its run and closers end at ``after``, a space) ends a sentence."""
    following = paragraph[after:].lstrip(" ")
    if not following:
        return True
    nxt = following[0]
    if nxt.islower():  # "approx. five", "e.g. this": a sentence does not go on in lowercase
        return False
    if paragraph[mark:after].rstrip(_CLOSERS + " ") != ".":
        return True  # "!", "?", "...", "?!": no abbreviation ends that way
    word_start = mark
    while word_start > 0 and not paragraph[word_start - 1].isspace() and paragraph[word_start - 1] not in "([\"'«“‘":
        word_start -= 1
    word = paragraph[word_start:mark]
    if len(word) == 1 and word.isalpha() and word.isupper() and word != "I":
        return False  # an initial: "J. R. R. Tolkien"
    return word.lower() not in _ABBREVIATIONS


def _spaced_closers(text: str, i: int) -> int:
    """Past a French closing guillemet set off by a space (`` »`` then a space or the end), else ``i``."""
    k = _skip(text, i, " ")
    if k == i or k == len(text) or text[k] not in _SPACED_CLOSERS:
        return i
    end = _skip(text, k, _SPACED_CLOSERS)
    return end if end == len(text) or text[end] == " " else i


def _is_cjk(ch: str) -> bool:
    """A Han, kana or Hangul character: scripts that need no space after a sentence mark."""
    code = ord(ch)
    return (
        0x3040 <= code <= 0x30FF
        or 0x3400 <= code <= 0x4DBF
        or 0x4E00 <= code <= 0x9FFF
        or 0xAC00 <= code <= 0xD7A3
        or 0x1100 <= code <= 0x11FF
        or 0x3130 <= code <= 0x318F
        or 0xF900 <= code <= 0xFAFF
    )


def _digit_around(text: str, i: int) -> bool:
    return 0 < i < len(text) - 1 and text[i - 1].isdigit() and text[i + 1].isdigit()


def _skip(text: str, i: int, chars: str) -> int:
    while i < len(text) and text[i] in chars:
        i += 1
    return i


def _pieces(paragraph: str, start: int, end: int, max_chars: int) -> list[tuple[int, int, Boundary]]:
    """One sentence as units of at most ``max_chars`` (trailing spaces not counted): the sentence
    itself, or pieces cut at the best boundary available."""
    pieces: list[tuple[int, int, Boundary]] = []
    while len(paragraph[start:end].rstrip()) > max_chars:
        cut = _best_cut(paragraph, start, start + max_chars)
        pieces.append((start, cut, "split"))
        start = cut
    pieces.append((start, end, "sentence"))
    return pieces


def _best_cut(text: str, start: int, limit: int) -> int:
    """Where to cut ``text[start:]`` so the piece's text is at most ``limit - start`` long: after a
    clause mark in the later two thirds, else after the last space, else between two characters.
    The spaces after the cut stay with the piece before it."""
    floor = start + max(1, (limit - start) // 3)
    for i in range(limit, floor - 1, -1):  # i: the index just past a candidate mark
        before = text[i - 1]
        if before in _CJK_CLAUSE_MARKS or (before in _CLAUSE_MARKS and i < len(text) and text[i] == " "):
            return _skip(text, i, " ")
    for i in range(limit, start, -1):
        if text[i] == " " and i > start:
            return _skip(text, i, " ")
    cut = limit
    while cut > start + 1 and unicodedata.combining(text[cut]):
        cut -= 1  # keep an accent with its letter
    return cut


def _pack(
    paragraph: str, units: list[tuple[int, int, Boundary]], target_chars: int, max_chars: int
) -> list[tuple[int, int, Boundary]]:
    """Consecutive units grouped while the group stays within ``target_chars``; a unit never splits."""
    chunks: list[tuple[int, int, Boundary]] = []
    for start, end, boundary in units:
        if chunks:
            c_start, _, c_boundary = chunks[-1]
            length = len(paragraph[c_start:end].rstrip())
            if c_boundary == "sentence" and length <= target_chars and length <= max_chars:
                chunks[-1] = (c_start, end, boundary)
                continue
        chunks.append((start, end, boundary))
    return chunks
