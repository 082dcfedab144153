from __future__ import annotations

from typing import Any

import pytest
from bad_inputs import BAD_REQUESTS

from ttsq.errors import InvalidRequest, TTSQError
from ttsq.job import LANGUAGES, SynthesisRequest


@pytest.mark.parametrize(("data", "field"), BAD_REQUESTS)
def test_each_bad_input_names_its_field(data: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        SynthesisRequest.from_dict(data)
    assert info.value.field == field
    assert field in str(info.value)
    assert isinstance(info.value, TTSQError)
    assert "\n" not in str(info.value)


def test_text_is_normalized_and_languages_take_codes() -> None:
    request = SynthesisRequest.from_dict({"text": "  안녕하세요,\n\n  반갑습니다. ", "language": "KO"})
    assert request.text == "안녕하세요, 반갑습니다."
    assert request.language == "korean"
    assert {
        SynthesisRequest.from_dict({"text": "x", "language": code}).language
        for code in ("zh", "en", "ja", "ko", "de", "fr", "ru", "pt", "es", "it")
    } == set(LANGUAGES) - {"auto"}


def test_to_dict_round_trips_as_plain_json() -> None:
    import json

    request = SynthesisRequest.from_dict({"text": "Hello", "seed": 3, "temperature": 1, "format": "FLAC"})
    wire = json.loads(json.dumps(request.to_dict()))
    assert SynthesisRequest.from_dict(wire) == request
    assert wire["temperature"] == 1.0 and wire["format"] == "flac"


def test_markup_and_emoji_are_text_not_errors() -> None:
    assert SynthesisRequest.from_dict({"text": "<speak>hi</speak> 🙂"}).text == "<speak>hi</speak> 🙂"


def test_describe_never_contains_the_text() -> None:
    request = SynthesisRequest.from_dict({"text": "secret words", "instruct": "whisper"})
    assert "secret" not in request.describe() and "whisper" not in request.describe()


def test_group_separates_what_cannot_share_a_pass() -> None:
    base = SynthesisRequest.from_dict({"text": "a", "language": "korean"})
    # Language, voice, format and frame cap are per row: they share a pass.
    for same in (
        {"text": "bb", "language": "ko", "format": "mp3"},
        {"text": "a", "language": "english"},
        {"text": "a", "instruct": "calm", "max_new_tokens": 40},
    ):
        assert base.group() == SynthesisRequest.from_dict(same).group()
    # Sampling settings and the seed are per call; the mode picks the call.
    for other in ({"seed": 1}, {"temperature": 0.5}, {"top_k": 5}, {"mode": "custom_voice", "speaker": "vivian"}):
        assert base.group() != SynthesisRequest.from_dict({"text": "a", **other}).group()
