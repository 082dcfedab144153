"""The Qwen3-ForcedAligner path (``TTSQ_ALIGNER=qwen-aligner``) on a tiny random-weight checkpoint built
here in the published layout: the real load (strict, by the reference's parameter names), features,
prompt, forward pass and repair, on espeak audio.

Random weights give random classes, so the tests hold shape and order, not accuracy: one (start, end)
per word of the text, starts never going back, each end at or after its start, all inside the clip.

The checkpoint (``ttsq.testing.aligner_checkpoint``) names and shapes its tensors from the reference
implementation (``qwen-asr`` 0.0.6, ``Qwen3ASRForConditionalGeneration`` with a forced-aligner thinker),
written out there, not from ttsq's model: a renamed or reshaped parameter fails the strict load.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from support import WorkerProcess

from ttsq.alignment import Word, create_aligner, parse_words, text_words
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.engines.espeak import EspeakEngine
from ttsq.errors import ConfigError, EngineUnavailable
from ttsq.job import SynthesisRequest

pytest.importorskip("torch", reason="the qwen aligner needs: pip install 'ttsq[qwen]'")
pytest.importorskip("transformers", reason="the qwen aligner needs: pip install 'ttsq[qwen]'")
from ttsq.testing.aligner_checkpoint import CLASSES, SEGMENT_MS, build  # after the skips: it imports torch

#: Whole-file: torch and a model load, several seconds on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ENGLISH = "The small library opened early on Monday, and the children ran inside - to find their books."
CHINESE = "今天 天气很好。 我们去 park 散步吧!"
StartWorker = Callable[..., WorkerProcess]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Only the first 64 bins (5.1 s) can win, so that random times fall mostly inside a short clip and
    # the repair and the clipping both have work to do.
    return build(tmp_path_factory.mktemp("aligner") / "Qwen3-ForcedAligner-tiny", "tiny", live_bins=64)


@pytest.fixture(scope="module")
def aligner(checkpoint: Path) -> Iterator[object]:
    settings = Settings(aligner="qwen-aligner", qwen_aligner_model=str(checkpoint), qwen_device="cpu")
    built = create_aligner("qwen-aligner", settings)
    assert built.name == "qwen-aligner"
    yield built


@pytest.fixture(scope="module")
def espeak() -> Iterator[EspeakEngine]:
    engine = EspeakEngine(Settings(engine="espeak"))
    engine.load()
    yield engine
    engine.close()


def speak(engine: EspeakEngine, text: str, language: str) -> tuple[np.ndarray, int]:
    output = engine.synthesize_batch([SynthesisRequest.from_dict({"text": text, "language": language})])[0]
    assert not isinstance(output, Exception), output
    return output.samples, output.sample_rate


def assert_shape_and_order(words: list[Word], text: str, duration_s: float) -> None:
    assert [word.word for word in words] == [word for word, _, _ in text_words(text)]
    last = 0.0
    for word in words:
        assert last <= word.start <= word.end <= duration_s + 1e-9, (word, last, duration_s)
        last = word.start


def test_english_espeak_audio_gets_one_time_per_word_in_order_inside_the_clip(
    aligner: object, espeak: EspeakEngine
) -> None:
    samples, rate = speak(espeak, ENGLISH, "english")
    words = aligner.align(samples, rate, ENGLISH, "english")  # type: ignore[attr-defined]
    assert_shape_and_order(words, ENGLISH, samples.shape[0] / rate)
    # A lone dash has no unit to time: it is spread between its neighbours, not lost.
    dash = next(index for index, word in enumerate(words) if word.word == "-")
    assert words[dash - 1].start <= words[dash].start <= words[dash + 1].start


def test_chinese_words_are_timed_by_their_characters(aligner: object, espeak: EspeakEngine) -> None:
    samples, rate = speak(espeak, CHINESE, "chinese")
    words = aligner.align(samples, rate, CHINESE, "chinese")  # type: ignore[attr-defined]
    assert_shape_and_order(words, CHINESE, samples.shape[0] / rate)


def test_a_tone_of_any_rate_and_int16_samples_align(aligner: object) -> None:
    rate = 24_000
    tone = (np.sin(np.arange(int(2.3 * rate)) * 2 * np.pi * 220 / rate) * 12_000).astype(np.int16)
    text = "one two three four"
    assert_shape_and_order(aligner.align(tone, rate, text, "english"), text, tone.shape[0] / rate)  # type: ignore[attr-defined]


def test_slots_are_whole_bins_two_per_unit(aligner: object, espeak: EspeakEngine) -> None:
    """The raw slot times, before the repair: the argmax class of each of the two slots per unit times
    80 ms, inside the head's 5000 bins; the prompt's slots and the units match one to one."""
    samples, rate = speak(espeak, "Hello there, friend", "english")
    slots = aligner.slot_times(samples, rate, ["Hello", "there", "friend"])  # type: ignore[attr-defined]
    assert len(slots) == 6
    assert all(ms % SEGMENT_MS == 0 and 0 <= ms < CLASSES * SEGMENT_MS for ms in slots), slots


def test_the_same_audio_and_text_give_the_same_times(aligner: object, espeak: EspeakEngine) -> None:
    samples, rate = speak(espeak, "Hello there, friend", "english")
    first = aligner.align(samples, rate, "Hello there, friend", "english")  # type: ignore[attr-defined]
    assert aligner.align(samples, rate, "Hello there, friend", "english") == first  # type: ignore[attr-defined]


def test_a_text_spelling_the_special_tokens_is_aligned_as_words(aligner: object) -> None:
    text = "say <timestamp> and <|audio_pad|> aloud"
    tone = np.sin(np.arange(32_000) * 2 * np.pi * 330 / 16_000).astype(np.float32) * 0.3
    assert_shape_and_order(aligner.align(tone, 16_000, text, "english"), text, 2.0)  # type: ignore[attr-defined]


def test_silence_too_short_to_hear_and_punctuation_alone_are_spread_not_run(aligner: object) -> None:
    words = aligner.align(np.zeros(100, dtype=np.float32), 16_000, "too short", "english")  # type: ignore[attr-defined]
    assert [(w.word, w.start) for w in words] == [("too", 0.0), ("short", words[1].start)]
    assert_shape_and_order(words, "too short", 100 / 16_000)
    dashes = aligner.align(np.zeros(16_000, dtype=np.float32), 16_000, "- ...", "english")  # type: ignore[attr-defined]
    assert_shape_and_order(dashes, "- ...", 1.0)


def test_a_checkpoint_whose_tensors_do_not_fit_is_refused_naming_them(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for item in checkpoint.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["thinker.classifier.weight"] = tensors.pop("thinker.lm_head.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    settings = Settings(aligner="qwen-aligner", qwen_aligner_model=str(broken), qwen_device="cpu")
    with pytest.raises(EngineUnavailable, match=r"thinker\.lm_head\.weight"):
        create_aligner("qwen-aligner", settings).align(np.zeros(16_000), 16_000, "a word", "english")


def test_a_folder_that_is_not_a_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    settings = Settings(aligner="qwen-aligner", qwen_aligner_model=str(tmp_path), qwen_device="cpu")
    with pytest.raises(ConfigError, match="TTSQ_QWEN_ALIGNER_MODEL"):
        create_aligner("qwen-aligner", settings)


def test_a_worker_times_a_wordless_engines_words_with_the_qwen_aligner(
    checkpoint: Path, settings: Settings, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TTSQ_ALIGNER=qwen-aligner`` through a real worker: the aligner is built by name from the
    settings, loads the checkpoint in the worker, and times the stored file's words."""
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    wordless = settings.replace(
        engine="wordless_engine:WordlessEngine",
        aligner="qwen-aligner",
        qwen_aligner_model=str(checkpoint),
        qwen_device="cpu",
    )
    worker = start_worker(wordless)
    with Client(wordless) as client:
        result = client.submit(ENGLISH, timestamps="word", language="english").wait(timeout=240)
    words = parse_words(result["words"])
    assert [w.word for w in words] == ENGLISH.split()
    # Inside the clip: a word ending at its end too (times rounded down to the millisecond).
    assert all(0 <= w.start <= w.end <= result["duration_s"] for w in words), (words, result["duration_s"])
    assert all(a.start <= b.start for a, b in itertools.pairwise(words))
    assert f"aligned {len(words)} words with qwen-aligner" in worker.log()
