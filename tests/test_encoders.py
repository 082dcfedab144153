"""The worker's encoder pool (``ttsq.worker.encoding.Encoders``): the same files as ``ttsq.audio.encode``,
made on at most ``threads`` pool threads, never on a pool thread for a format that costs nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from ttsq.audio import encode
from ttsq.batching.jobs import BatchItem
from ttsq.engines.base import EngineOutput
from ttsq.job import SynthesisRequest
from ttsq.testing.standin import SAMPLE_RATE, speech_like
from ttsq.worker.encoding import Encoders


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


def resolved(seconds: float) -> Future[BatchItem]:
    """A batch future as the batcher resolves it: ``seconds`` of stand-in audio."""
    future: Future[BatchItem] = Future()
    future.set_result(
        BatchItem(EngineOutput(speech_like(seconds), SAMPLE_RATE), batch_id=1, batch_size=1, synthesis_s=0)
    )
    return future


def test_the_backlog_counts_a_turn_from_its_batch_to_its_encode(encoders: Encoders) -> None:
    mp3 = [SynthesisRequest.from_dict({"text": "x", "format": "mp3"})]
    encoders.encode(speech_like(1.0), SAMPLE_RATE, "mp3")  # learns what an mp3 second costs
    assert encoders.busy_s(mp3) == 0.0
    turn = encoders.turn("mp3")
    batch = resolved(4.0)
    turn.batched(batch)  # the done callback, as the batcher thread runs it
    held = encoders.busy_s(mp3)
    assert held > 0
    # Nothing of a WAV queues on the pool: a group holding one is never held back.
    assert encoders.busy_s([*mp3, SynthesisRequest.from_dict({"text": "x", "format": "wav"})]) == 0.0
    encoders.encode(batch.result().output.samples, SAMPLE_RATE, "mp3", turn)
    assert encoders.busy_s(mp3) == 0.0  # encoded: no longer counted


def test_a_job_that_leaves_before_its_batch_returns_is_never_counted(encoders: Encoders) -> None:
    mp3 = [SynthesisRequest.from_dict({"text": "x", "format": "mp3"})]
    encoders.encode(speech_like(1.0), SAMPLE_RATE, "mp3")
    turn = encoders.turn("mp3")
    turn.close()  # the task thread timed out and left; its batch returns later
    turn.batched(resolved(4.0))
    assert encoders.busy_s(mp3) == 0.0
    failed: Future[BatchItem] = Future()
    failed.set_exception(RuntimeError("the batch failed"))
    encoders.turn("mp3").batched(failed)  # no audio, nothing to count
    assert encoders.busy_s(mp3) == 0.0
