"""The espeak engine, for real: every Qwen3-TTS language, one failing item, the frame cap."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest

from ttsq.config import Settings
from ttsq.engines import REGISTRY, create_engine
from ttsq.engines.base import Engine, EngineOutput
from ttsq.engines.espeak import guess_language
from ttsq.errors import ConfigError, EngineError
from ttsq.job import LANGUAGES, SynthesisRequest

SENTENCES = {
    "chinese": "今天天气很好。",
    "english": "The weather is nice today.",
    "japanese": "今日はいい天気です。",
    "korean": "오늘은 날씨가 좋네요.",
    "german": "Heute ist schönes Wetter.",
    "french": "Il fait beau aujourd'hui.",
    "russian": "Сегодня хорошая погода.",
    "portuguese": "Hoje o tempo está bom.",
    "spanish": "Hoy hace buen tiempo.",
    "italian": "Oggi fa bel tempo.",
}


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = create_engine(Settings(engine="espeak"))
    engine.load()
    engine.warmup()
    yield engine
    engine.close()


def test_identity_names_the_library_version(engine: Engine) -> None:
    assert engine.identity.engine == "espeak"
    assert engine.identity.revision.count(".") == 2
    assert set(engine.identity.languages) == set(LANGUAGES)


@pytest.mark.parametrize("language", sorted(SENTENCES))
def test_every_qwen_language_speaks(engine: Engine, language: str) -> None:
    (output,) = engine.synthesize_batch(
        [SynthesisRequest.from_dict({"text": SENTENCES[language], "language": language})]
    )
    assert isinstance(output, EngineOutput)
    seconds = output.samples.size / output.sample_rate
    assert 0.5 < seconds < 6
    assert np.sqrt(np.mean(output.samples.astype(np.float64) ** 2)) > 300  # speech, not silence


def test_auto_language_follows_the_script() -> None:
    assert guess_language("안녕하세요") == "korean"
    assert guess_language("こんにちは、世界") == "japanese"
    assert guess_language("你好") == "chinese"
    assert guess_language("Привет") == "russian"
    assert guess_language("Hello") == "english"


def test_one_bad_item_fails_alone(engine: Engine) -> None:
    # "..." is refused at the edge (nothing to speak); an engine handed it anyway fails only that row.
    requests = [SynthesisRequest.from_dict({"text": t}) for t in ("one", "x", "two")]
    requests[1] = dataclasses.replace(requests[1], text="...")
    outputs = engine.synthesize_batch(requests)
    assert isinstance(outputs[0], EngineOutput) and isinstance(outputs[2], EngineOutput)
    assert isinstance(outputs[1], EngineError)


def test_unhonoured_fields_are_reported_and_the_frame_cap_truncates(engine: Engine) -> None:
    request = SynthesisRequest.from_dict(
        {"text": "A sentence long enough to be cut short.", "instruct": "a calm voice", "seed": 3, "max_new_tokens": 10}
    )
    (output,) = engine.synthesize_batch([request])
    assert isinstance(output, EngineOutput)
    assert output.truncated
    assert output.samples.size == int(10 / 12.5 * output.sample_rate)
    assert set(output.ignored) == {"instruct", "seed"}


def test_unknown_and_unavailable_engines_fail_clearly() -> None:
    with pytest.raises(ConfigError, match="TTSQ_ENGINE"):
        create_engine(Settings(engine="festival"))
    assert "qwen" in REGISTRY
    with pytest.raises(ConfigError, match="TTSQ_QWEN_MODEL"):
        create_engine(Settings(engine="qwen"))
