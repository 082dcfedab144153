"""Captions (``ttsq.captions``): cues by sentence, capped in characters and seconds, in order, no overlap."""

from __future__ import annotations

import itertools
import re

import pytest

from ttsq.alignment import Word
from ttsq.captions import MAX_CUE_S, MAX_LINE_CHARS, captions, make_cues, srt, vtt


def timed(text: str, seconds_per_word: float = 0.3, gap: float = 0.05) -> list[Word]:
    words, at = [], 0.0
    for word in text.split():
        words.append(Word(word, at, at + seconds_per_word))
        at += seconds_per_word + gap
    return words


def test_a_cue_ends_at_each_sentence() -> None:
    cues = make_cues(timed("Hello there. How are you? Fine, thanks!"))
    assert [cue.text for cue in cues] == ["Hello there.", "How are you?", "Fine, thanks!"]


def test_long_sentences_are_cut_to_two_lines_of_42_and_seven_seconds() -> None:
    text = " ".join(["antidisestablishment word"] * 40) + "."
    cues = make_cues(timed(text))
    assert " ".join(cue.text for cue in cues) == text
    for cue in cues:
        assert len(cue.lines) <= 2 and all(len(line) <= MAX_LINE_CHARS for line in cue.lines)
    slow = make_cues(timed("one two three four five six seven eight nine ten eleven", seconds_per_word=1.5))
    assert len(slow) > 1 and all(cue.end - cue.start <= MAX_CUE_S for cue in slow)


def test_cues_are_ordered_never_overlap_and_end_by_the_audio() -> None:
    words = [Word("One.", 0.0, 0.2), Word("Two.", 0.1, 0.4), Word("Three", 0.5, 0.6), Word("four.", 0.6, 2.9)]
    cues = make_cues(words, duration_s=2.5)
    for before, after in itertools.pairwise(cues):
        assert before.start <= before.end <= after.start <= after.end
    assert cues[-1].end == 2.5
    # An overlap from the aligner moves the next cue's start; a short cue lingers into the silence
    # after it, never into the next cue.
    assert cues[0].end == pytest.approx(0.2) and cues[1].start == pytest.approx(0.2)
    assert cues[1].end == pytest.approx(0.5)


def test_srt_and_vtt_formats() -> None:
    words = [Word("Hi", 0.0, 0.4), Word("<b>&", 0.5, 1.0), Word("-->now.", 3661.5, 3662.25)]
    text = srt(make_cues(words))
    assert text.startswith("1\n00:00:00,000 --> ")
    assert "2\n01:01:01,500 --> 01:01:02,250\n-->now.\n\n" in text
    web = vtt(make_cues(words))
    assert web.startswith("WEBVTT\n\n00:00:00.000 --> ")
    assert "&lt;b&gt;&amp;" in web and "--&gt;now." in web
    assert len(re.findall(r"-->", web)) == 2  # only the timing lines
    assert captions(words, "srt") == text
    with pytest.raises(ValueError, match="srt or vtt"):
        captions(words, "ass")
