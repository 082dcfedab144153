"""Qwen3-ForcedAligner's text side (``ttsq.alignment.forced``), without torch: the units, the prompt,
the encoder's audio length, the repair of slot times, and words timed from slots. The model itself is
tested on a tiny checkpoint in tests/test_qwen_aligner.py."""

from __future__ import annotations

import pytest

from ttsq.alignment import ALIGNERS, create_aligner
from ttsq.alignment.forced import audio_tokens, monotonic, prompt, units, word_times
from ttsq.config import Settings
from ttsq.errors import ConfigError


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("Monday,", ["Monday"]),
        ("don't", ["don't"]),
        ("e-mail", ["email"]),
        ("42", ["42"]),
        ("-", []),
        ("...", []),
        ("今天", ["今", "天"]),
        ("在park散步", ["在", "park", "散", "步"]),
        ("こんにちは", ["こ", "ん", "に", "ち", "は"]),
        ("안녕하세요.", ["안녕하세요"]),
        ("Grüße!", ["Grüße"]),
    ],
)
def test_units_keep_letters_digits_and_apostrophes_and_split_cjk_and_kana(word: str, expected: list[str]) -> None:
    assert units(word) == expected


def test_a_text_cannot_smuggle_the_prompts_special_tokens() -> None:
    """Untrusted text spelling ``<timestamp>`` or ``<|audio_pad|>`` would add slots or audio places;
    units keep letters, digits and apostrophes only, so the prompt's special tokens are the aligner's."""
    found = [unit for word in ["<timestamp>", "<|audio_pad|><|audio_end|>"] for unit in units(word)]
    assert found == ["timestamp", "audiopadaudioend"]
    assert prompt(found, 1).count("<timestamp>") == 4
    assert prompt(found, 1).count("<|audio_pad|>") == 1


def test_the_prompt_is_the_audio_then_each_unit_with_two_slots() -> None:
    assert prompt(["Hi", "you"], 2) == (
        "<|audio_start|><|audio_pad|><|audio_pad|><|audio_end|>Hi<timestamp><timestamp>you<timestamp><timestamp>"
    )


@pytest.mark.parametrize(("frames", "tokens"), [(1, 1), (8, 1), (9, 2), (99, 13), (100, 13), (101, 14), (250, 33)])
def test_audio_tokens_follow_the_encoders_convolutions(frames: int, tokens: int) -> None:
    """Three stride-2 convolutions over each window of 100 frames: 13 per whole window."""
    assert audio_tokens(frames) == tokens


@pytest.mark.parametrize(
    ("raw", "repaired"),
    [
        ([], []),
        ([80, 160, 240], [80, 160, 240]),
        ([80, 4000, 160, 240], [80, 80, 160, 240]),  # a lone outlier takes its nearer neighbour
        ([80, 160, 0, 400], [80, 160, 160, 400]),
        ([500, 80, 160], [80, 80, 160]),  # at the start: the first kept value
        ([80, 160, 240, 320, 0, 0, 0, 800], [80, 160, 240, 320, 440, 560, 680, 800]),  # a long run: spread
        ([80, 160, 240, 9, 9, 9], [80, 160, 240, 240, 240, 240]),  # a long run at the end copies its neighbour
        ([320, 320, 80, 320], [320, 320, 320, 320]),  # equal values are rising
    ],
)
def test_monotonic_keeps_the_longest_rising_run_and_mends_the_rest(raw: list[float], repaired: list[float]) -> None:
    assert monotonic(raw) == repaired


def test_words_take_their_first_units_start_and_last_units_end() -> None:
    text = "今天 好 - park"
    # units: 今, 天 | 好 | (none) | park
    slots = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9, 1.2]
    words = word_times(text, [2, 1, 0, 1], slots, duration_s=1.0)
    assert [(w.word, w.start, w.end) for w in words] == [
        ("今天", 0.1, 0.4),
        ("好", 0.5, 0.6),
        ("-", 0.6, 0.9),  # no unit: spread over the gap before the next word
        ("park", 0.9, 1.0),  # clipped into the clip
    ]


def test_words_and_slots_that_do_not_match_are_refused() -> None:
    with pytest.raises(ValueError, match="2 words"):
        word_times("two words", [1, 1], [0.0, 0.1], duration_s=1.0)


def test_the_qwen_aligner_is_registered_by_name_and_needs_its_checkpoint() -> None:
    assert ALIGNERS["qwen-aligner"] == "ttsq.engines.qwen.aligner:QwenForcedAligner"
    with pytest.raises(ConfigError, match="TTSQ_QWEN_ALIGNER_MODEL"):
        Settings(aligner="qwen-aligner")
    with pytest.raises(ConfigError, match="TTSQ_ALIGNER"):
        Settings(aligner="forced")
    with pytest.raises(ConfigError, match="TTSQ_ALIGNER"):
        create_aligner("forced", Settings())
