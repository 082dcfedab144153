"""qwen-fast's continuous loop when things fail: a bad job fails only itself, every job is answered,
and the loop's accounting and isolation hold. Faults come from ``tests/faulty_fast.py`` (the real
loop, engine and batcher, with faults injected where a device would raise them)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from faulty_fast import ADMIT, CODEC, DIE, DIE_ADMITTING, FRAME, SLOW_CODEC, FaultyFastEngine

from ttsq.batching.batcher import Batcher
from ttsq.config import Settings
from ttsq.errors import EngineError
from ttsq.job import SynthesisRequest

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

TIMEOUT = 120


def engine(qwen_checkpoints: dict[str, Path], slots: int) -> FaultyFastEngine:
    return FaultyFastEngine(
        Settings(
            engine="qwen-fast", qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=256, max_batch=slots
        )
    )


def request(text: str, frames: int, temperature: float | None = None) -> SynthesisRequest:
    fields: dict[str, Any] = {"text": text, "max_new_tokens": frames, "seed": 1}
    if temperature is not None:
        fields["temperature"] = temperature
    return SynthesisRequest.from_dict(fields)


@pytest.fixture
def loaded(qwen_checkpoints: dict[str, Path]) -> Iterator[FaultyFastEngine]:
    fast = engine(qwen_checkpoints, slots=2)
    fast.load()
    try:
        yield fast
    finally:
        fast.close()


@pytest.fixture
def batcher(qwen_checkpoints: dict[str, Path]) -> Iterator[Batcher]:
    running = Batcher(engine(qwen_checkpoints, slots=2), max_batch=2, max_wait_s=0.01)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def test_a_failed_admit_frees_its_slot_and_fails_only_its_job(loaded: FaultyFastEngine) -> None:
    outputs = loaded.synthesize_batch([request("Bad start.", 6, ADMIT), request("One.", 5), request("Two.", 7)])
    assert isinstance(outputs[0], EngineError) and "first code" in str(outputs[0])
    assert [getattr(out, "samples", None) is not None and out.samples.size for out in outputs[1:]] == [
        5 * 1920,
        7 * 1920,
    ]
    assert loaded.active == 0 and loaded.free_slots() == 2  # no orphan row kept decoding in the slot


def test_a_failed_codec_decode_fails_only_its_row(loaded: FaultyFastEngine) -> None:
    # Same caps, admitted before the first frame: both rows finish in the same frame and go to the codec
    # together; the joint decode fails, each row is decoded again alone.
    outputs = loaded.synthesize_batch([request("Bad audio.", 6, CODEC), request("Good audio.", 6)])
    assert isinstance(outputs[0], EngineError) and "codec" in str(outputs[0])
    assert not isinstance(outputs[1], Exception) and outputs[1].samples.size == 6 * 1920


def test_a_failed_frame_fails_only_its_culprit(batcher: Batcher) -> None:
    """The frame fails for every row in it; each is run again alone, and only the culprit fails."""
    good = batcher.submit(request("A long good one.", 60))
    bad = batcher.submit(request("The culprit.", 8, FRAME))
    after = batcher.submit(request("Behind them.", 5))
    item = good.result(TIMEOUT)
    assert item.output.samples.size == 60 * 1920
    with pytest.raises(EngineError, match="injected: the frame failed"):
        bad.result(TIMEOUT)
    assert after.result(TIMEOUT).output.samples.size == 5 * 1920


def test_an_isolated_job_is_alone_until_its_audio_is_decoded(batcher: Batcher) -> None:
    """Isolation covers the codec stage: no job joins while the isolated job's decode is pending."""
    events: list[str] = []
    lock = threading.Lock()

    def note(name: str) -> None:
        with lock:
            events.append(name)

    suspect = batcher.submit(request("Suspect.", 4, SLOW_CODEC), isolated=True)
    suspect.add_done_callback(lambda _: note("suspect done"))
    deadline = time.monotonic() + TIMEOUT
    while batcher.engine.active == 0 and not suspect.done():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline
        time.sleep(0.005)
    neighbour = batcher.submit(request("Neighbour.", 4), on_enter=lambda: note("neighbour enters"))
    suspect.result(TIMEOUT)
    neighbour.result(TIMEOUT)
    assert events == ["suspect done", "neighbour enters"]


def test_device_time_shares_add_up_to_no_more_than_the_wall_clock(batcher: Batcher) -> None:
    started = time.perf_counter()
    first = batcher.submit(request("First, alone for a while.", 60))
    while batcher.engine.active == 0 and not first.done():  # type: ignore[attr-defined]
        time.sleep(0.005)
    second = batcher.submit(request("Second, joins it.", 50))
    items = [first.result(TIMEOUT), second.result(TIMEOUT)]
    elapsed = time.perf_counter() - started
    assert items[1].batch_size == 2
    assert all(item.device_s > 0 for item in items)
    # Each step's time is split between the jobs in it: the shares partition the engine's busy time.
    assert sum(item.device_s for item in items) <= elapsed


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loop's death, on cue
@pytest.mark.parametrize("where", [DIE, DIE_ADMITTING])
def test_jobs_waiting_for_a_slot_are_answered_when_the_loop_dies(batcher: Batcher, where: float) -> None:
    """The loop ends by an exception no handler expects (in a frame, or while a job is admitted): every
    job, decoding, being admitted or waiting for a slot, is answered."""
    long = batcher.submit(request("Long.", 200))
    while batcher.engine.active == 0 and not long.done():  # type: ignore[attr-defined]
        time.sleep(0.005)
    dying = batcher.submit(request("Dies.", 200, where))
    queued = [batcher.submit(request(f"Queued {i}.", 5)) for i in range(3)]
    for future in [long, dying, *queued]:
        with pytest.raises(EngineError):
            future.result(TIMEOUT)
    deadline = time.monotonic() + TIMEOUT
    while batcher.alive:  # the thread ends just after it has answered them
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_cancelled_job_waiting_for_a_slot_never_runs(batcher: Batcher) -> None:
    events: list[str] = []
    long = batcher.submit(request("Long.", 40))
    while batcher.engine.active == 0 and not long.done():  # type: ignore[attr-defined]
        time.sleep(0.005)
    other = batcher.submit(request("Other.", 40))
    cancelled = batcher.submit(request("Cancelled.", 5), on_enter=lambda: events.append("entered"))
    assert cancelled.cancel()  # both slots are busy: it is still waiting
    assert long.result(TIMEOUT) and other.result(TIMEOUT)
    assert cancelled.cancelled() and events == []


def test_stop_while_decoding_finishes_the_jobs_in_flight(batcher: Batcher) -> None:
    futures: list[Future[Any]] = [batcher.submit(request(f"In flight {i}.", 30)) for i in range(3)]
    while batcher.engine.active == 0:  # type: ignore[attr-defined]
        time.sleep(0.005)
    assert batcher.stop(TIMEOUT)
    assert [future.result(0).output.samples.size for future in futures] == [30 * 1920] * 3


def test_a_job_its_caller_abandons_frees_its_slot(batcher: Batcher) -> None:
    """A worker that gave up waiting (its job timed out) abandons the job: it leaves the loop at the next
    frame instead of decoding to its cap, and the job waiting behind it takes the slot."""
    abandoned = batcher.submit(request("Nobody waits for this one.", 250))
    other = batcher.submit(request("Still wanted.", 250))
    while batcher.engine.active < 2:  # type: ignore[attr-defined]
        assert not abandoned.done()
        time.sleep(0.005)
    behind = batcher.submit(request("Behind them.", 5))
    batcher.abandon(abandoned)
    with pytest.raises(EngineError, match="cancelled while decoding"):
        abandoned.result(TIMEOUT)
    assert behind.result(TIMEOUT).output.samples.size == 5 * 1920
    # 5 frames after the slot was freed, not after a neighbour's end (its seed makes it 120 frames long)
    assert not other.done()
    assert other.result(TIMEOUT).output.samples.size > 5 * 1920
