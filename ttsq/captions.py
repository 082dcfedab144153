"""Captions from word times: SRT and WebVTT cues, by sentence, capped as subtitle conventions want.

    cues = make_cues(words, duration_s=result["duration_s"])
    srt(cues), vtt(cues)                                   # the files' text

A cue holds the words of one sentence, or of a piece of one: a cue ends at a sentence's end, and
before it would pass ``MAX_LINE_CHARS`` characters on each of ``MAX_LINES`` lines or last longer than
``MAX_CUE_S`` (the BBC's and Netflix's guidelines: about 42 characters a line, two lines, at most 7
seconds on screen). Lines break between words, as evenly as the words allow. Cues are in order and
never overlap; a short cue lingers up to ``MIN_CUE_S`` when the next one leaves room. The text of a
cue is the words as the text has them (punctuation kept), joined by single spaces: a span of the text
with its whitespace collapsed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ttsq.alignment import Word

CaptionFormat = Literal["srt", "vtt"]
CAPTION_FORMATS: tuple[str, ...] = ("srt", "vtt")
CONTENT_TYPES = {"srt": "application/x-subrip", "vtt": "text/vtt"}

MAX_LINE_CHARS = 42
MAX_LINES = 2
MAX_CUE_S = 7.0
MIN_CUE_S = 1.0
#: What ends a sentence, at the end of a word (closing quotes and brackets after it allowed).
_SENTENCE_ENDS = ".!?…。！？"
_CLOSERS = "\"'”’)]»」』"


@dataclass(frozen=True)
class Cue:
    """One caption on screen: from ``start`` to ``end`` (seconds), its lines."""

    start: float
    end: float
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        """The cue's words on one line."""
        return " ".join(self.lines)


def ends_sentence(word: str) -> bool:
    """Whether ``word`` closes a sentence (its last mark, before closing quotes, is . ! ? …)."""
    stripped = word.rstrip(_CLOSERS)
    return bool(stripped) and stripped[-1] in _SENTENCE_ENDS


def make_cues(
    words: Sequence[Word],
    *,
    duration_s: float | None = None,
    max_line_chars: int = MAX_LINE_CHARS,
    max_lines: int = MAX_LINES,
    max_cue_s: float = MAX_CUE_S,
) -> list[Cue]:
    """Cues for ``words`` (in order, as an aligner returns them), none longer than the caps allow
    (a single word longer than a line gets a cue of its own), ending by ``duration_s`` when given."""
    groups: list[list[Word]] = []
    current: list[Word] = []
    for word in words:
        if current and not _fits([*current, word], max_line_chars, max_lines, max_cue_s):
            groups.append(current)
            current = []
        current.append(word)
        if ends_sentence(word.word):
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    cues: list[Cue] = []
    for index, group in enumerate(groups):
        start = max(group[0].start, cues[-1].end if cues else 0.0)
        end = max(group[-1].end, start)
        # Linger a little when the next cue leaves room: a flash of a short word is unreadable.
        limit = groups[index + 1][0].start if index + 1 < len(groups) else (duration_s if duration_s else end)
        if end - start < MIN_CUE_S:
            end = max(end, min(start + MIN_CUE_S, limit))
        if duration_s is not None:
            end = min(end, duration_s)
            start = min(start, end)
        cues.append(Cue(start, end, tuple(_lines([w.word for w in group], max_line_chars, max_lines))))
    return cues


def _fits(group: Sequence[Word], max_line_chars: int, max_lines: int, max_cue_s: float) -> bool:
    if group[-1].end - group[0].start > max_cue_s:
        return False
    lines = _lines([w.word for w in group], max_line_chars, max_lines)
    return len(lines) <= max_lines and all(len(line) <= max_line_chars for line in lines)


def _lines(words: Sequence[str], max_line_chars: int, max_lines: int) -> list[str]:
    """The words in as few lines as fit ``max_line_chars`` (greedily), the break of two lines moved to
    even them out (a bottom-heavy pair reads best; so the first line is never the longer by much)."""
    lines: list[list[str]] = [[]]
    for word in words:
        line = lines[-1]
        if line and len(" ".join([*line, word])) > max_line_chars:
            lines.append([word])
        else:
            line.append(word)
    if len(lines) == 2 and max_lines >= 2:
        flat = [*lines[0], *lines[1]]
        best = (len(" ".join(lines[0])), len(" ".join(lines[1])))
        best_at = len(lines[0])
        for at in range(1, len(flat)):
            top, bottom = len(" ".join(flat[:at])), len(" ".join(flat[at:]))
            if top <= max_line_chars and bottom <= max_line_chars and max(top, bottom) < max(best):
                best, best_at = (top, bottom), at
        lines = [flat[:best_at], flat[best_at:]]
    return [" ".join(line) for line in lines if line]


def _clock(seconds: float, separator: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def srt(cues: Sequence[Cue]) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm --> HH:MM:SS,mmm``, a blank line after each."""
    return "".join(
        f"{number}\n{_clock(cue.start, ',')} --> {_clock(cue.end, ',')}\n" + "\n".join(cue.lines) + "\n\n"
        for number, cue in enumerate(cues, start=1)
    )


def vtt(cues: Sequence[Cue]) -> str:
    """WebVTT: the ``WEBVTT`` header, then cues with ``.`` before the milliseconds. A cue's text is
    markup to a player (``<b>``, ``-->``): ``&``, ``<`` and ``>`` are written as entities."""
    body = "".join(
        f"{_clock(cue.start, '.')} --> {_clock(cue.end, '.')}\n"
        + "\n".join(line.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;") for line in cue.lines)
        + "\n\n"
        for cue in cues
    )
    return "WEBVTT\n\n" + body


def captions(words: Sequence[Word], caption_format: str, *, duration_s: float | None = None) -> str:
    """The caption file for ``words``: ``"srt"`` or ``"vtt"``."""
    cues = make_cues(words, duration_s=duration_s)
    if caption_format == "srt":
        return srt(cues)
    if caption_format == "vtt":
        return vtt(cues)
    raise ValueError(f"unknown caption format {caption_format!r}; expected srt or vtt")
