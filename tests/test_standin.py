"""The GPU stand-in (``ttsq.testing.standin``): audio as long as speech, the batch cost it declares.
(The engine contract, tests/test_engine_contract.py, covers the protocol; no time is measured here.)"""

from __future__ import annotations

import pytest

from ttsq.config import Settings
from ttsq.engines import create_engine
from ttsq.engines.base import EngineOutput
from ttsq.job import SynthesisRequest
from ttsq.testing.standin import CHARS_PER_SECOND, SAMPLE_RATE, StandInEngine, batch_seconds, speech_frames


def test_a_row_lasts_as_long_as_its_text_read_aloud_and_clips_differ() -> None:
    engine = create_engine(Settings(engine="standin", standin_a_us=0, standin_b_us=0))
    assert isinstance(engine, StandInEngine)
    engine.load()
    text = "x" * 140  # ten seconds at 14 characters a second
    other = "y" * 140
    first, second = engine.synthesize_batch([SynthesisRequest(text=text), SynthesisRequest(text=other)])
    assert isinstance(first, EngineOutput) and isinstance(second, EngineOutput)
    assert first.samples.size == 10 * SAMPLE_RATE == round(140 / CHARS_PER_SECOND * SAMPLE_RATE)
    assert not first.truncated and first.sample_rate == SAMPLE_RATE
    assert (first.samples != second.samples).any()  # cut from different places of the buffer
    assert 0.01 < float(abs(first.samples).mean()) < 0.5  # quiet, but not silence


def test_the_batch_cost_is_a_plus_b_rows_per_second_of_the_longest_audio() -> None:
    assert batch_seconds(0.25, 0.005, 64, 2.0) == pytest.approx((0.25 + 0.32) * 2.0)
    assert speech_frames("a" * 28) == 25  # two seconds of 12.5 frames
    assert speech_frames("hi") == 6  # the shortest clip
    # The defaults are the published H100 figures of the docs: 3.98 audio-s/s alone, 111.9 at 64 rows.
    settings = Settings()
    a, b = settings.standin_a_us / 1e6, settings.standin_b_us / 1e6
    assert 1 / batch_seconds(a, b, 1, 1.0) == pytest.approx(3.98, rel=0.01)
    assert 64 / batch_seconds(a, b, 64, 1.0) == pytest.approx(111.9, rel=0.01)
