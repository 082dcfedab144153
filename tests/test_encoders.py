"""The worker's encoder pool (``ttsq.worker.pipeline.Encoders``): the same files as ``ttsq.audio.encode``,
made on at most ``threads`` pool threads, never on a pool thread for a format that costs nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from ttsq.audio import encode
from ttsq.testing.standin import SAMPLE_RATE, speech_like
from ttsq.worker.pipeline import Encoders


def pool_threads(prefix: str = "ttsq-encode") -> set[str]:
    return {thread.name for thread in threading.enumerate() if thread.name.startswith(prefix)}


@pytest.fixture
def encoders() -> Iterator[Encoders]:
    before = pool_threads()
    assert not before, f"another test left encoder threads running: {before}"
    pool = Encoders(threads=2)
    yield pool
    pool.close()
    assert not pool_threads()  # closed: its threads are gone


def test_the_pool_makes_the_same_files_on_at_most_its_threads(encoders: Encoders) -> None:
    clips = [speech_like(1.0, seed=seed) for seed in range(8)]
    with ThreadPoolExecutor(8) as callers:  # eight task threads whose batches returned together
        files = list(callers.map(lambda clip: encoders.encode(clip, SAMPLE_RATE, "mp3"), clips))
    assert [f.data for f in files] == [encode(clip, SAMPLE_RATE, "mp3").data for clip in clips]
    assert 1 <= len(pool_threads()) <= 2


def test_a_wav_is_written_on_the_callers_thread(encoders: Encoders) -> None:
    wav = encoders.encode(speech_like(1.0), SAMPLE_RATE, "wav")
    assert wav.data == encode(speech_like(1.0), SAMPLE_RATE, "wav").data
    assert not pool_threads()  # no hop through the pool for a header and a copy
