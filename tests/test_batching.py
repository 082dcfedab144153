"""The batcher with the real espeak engine: fill, grouping, failure isolation, stop."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from ttsq.batching.batcher import Batcher, BatchItem
from ttsq.config import Settings
from ttsq.engines import create_engine
from ttsq.engines.base import Engine, EngineOutput, Piece
from ttsq.errors import EngineError, EngineUnavailable, InvalidRequest
from ttsq.job import SynthesisRequest


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = create_engine(Settings())
    engine.load()
    yield engine
    engine.close()


def started(engine: Engine, **options: Any) -> Batcher:
    """A batcher over an already loaded engine (the wrapper keeps the batcher from reloading or closing it)."""
    batcher = Batcher(SharedEngine(engine), **options)  # type: ignore[arg-type]
    batcher.start()
    return batcher


def request(text: str, **fields: object) -> SynthesisRequest:
    return SynthesisRequest.from_dict({"text": text, **fields})


def test_a_burst_from_many_threads_fills_every_batch(engine: Engine) -> None:
    # A group that is not full runs once arrivals pause for a quarter of the window. The threads start
    # first and submit together (a barrier): on a loaded CI machine, starting 16 threads one by one
    # once took longer than that pause, and a batch of 1 ran before the rest had come.
    batcher = started(engine, max_batch=4, max_wait_s=2.0)
    together = threading.Barrier(16)

    def submit(i: int) -> BatchItem:
        together.wait(timeout=30)
        return batcher.submit(request(f"sentence number {i}")).result(10)

    with ThreadPoolExecutor(16) as pool:
        items = list(pool.map(submit, range(16)))
    batcher.stop()
    assert all(isinstance(item, BatchItem) for item in items)
    assert sorted(item.batch_size for item in items) == [4] * 16
    assert len({item.batch_id for item in items}) == 4


def test_requests_that_cannot_share_a_pass_ride_separate_batches(engine: Engine) -> None:
    batcher = started(engine, max_batch=8, max_wait_s=0.3)
    # Two seeds cannot share a pass (the seed is set once per call); two languages can.
    futures = [
        batcher.submit(request("hello", seed=seed, language=lang))
        for seed, lang in ((1, "english"), (2, "english"), (1, "korean"))
    ]
    items = [future.result(10) for future in futures]
    batcher.stop()
    assert items[0].batch_id == items[2].batch_id != items[1].batch_id
    assert (items[0].batch_size, items[1].batch_size) == (2, 1)


def test_a_failing_item_fails_only_its_own_future(engine: Engine) -> None:
    batcher = started(engine, max_batch=8, max_wait_s=0.3)
    # "..." is refused at the edge (nothing to speak); handed to the engine anyway, it fails in its slot.
    bad = dataclasses.replace(request("x"), text="...")
    futures = [batcher.submit(item) for item in (request("first"), bad, request("third"))]
    assert isinstance(futures[0].result(10), BatchItem)
    with pytest.raises(EngineError):
        futures[1].result(10)
    assert isinstance(futures[2].result(10), BatchItem)
    batcher.stop()


def test_a_mode_the_engine_does_not_serve_fails_alone(engine: Engine) -> None:
    batcher = started(engine, max_batch=8, max_wait_s=0.3)
    good = batcher.submit(request("fine"))
    bad = batcher.submit(request("fine", mode="custom_voice", speaker="Sohee"))
    assert isinstance(good.result(10), BatchItem)
    with pytest.raises(InvalidRequest, match="mode: custom_voice is not served"):
        bad.result(10)
    batcher.stop()


class SharedEngine:
    """The module's loaded espeak engine, shared by many batchers (load and close do nothing here),
    behind a boundary that fails any whole batch holding the text "poison", the way a device fault
    takes down a forward pass."""

    def __init__(self, inner: Engine) -> None:
        self.inner = inner
        self.identity = inner.identity
        self.calls: list[int] = []

    def load(self) -> None: ...
    def warmup(self) -> None: ...
    def close(self) -> None: ...

    def synthesize_batch(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        self.calls.append(len(requests))
        if any(r.text == "poison" for r in requests):
            raise RuntimeError("device fault")
        return self.inner.synthesize_batch(requests)


def test_a_batch_that_raises_is_retried_item_by_item(engine: Engine) -> None:
    crashing = SharedEngine(engine)
    batcher = Batcher(crashing, max_batch=8, max_wait_s=0.3)
    batcher.start()
    futures = [batcher.submit(request(text)) for text in ("one", "poison", "three")]
    assert isinstance(futures[0].result(10), BatchItem)
    with pytest.raises(EngineError, match="device fault"):
        futures[1].result(10)
    assert isinstance(futures[2].result(10), BatchItem)
    batcher.stop()
    assert crashing.calls == [3, 1, 1, 1]


def test_stopped_batcher_refuses_new_work(engine: Engine) -> None:
    batcher = started(engine, max_batch=2, max_wait_s=0.01)
    batcher.stop()
    with pytest.raises(EngineError):
        batcher.submit(request("late")).result(1)


class UnloadableEngine(SharedEngine):
    def load(self) -> None:
        raise EngineUnavailable("weights not found")


def test_engine_load_errors_surface_from_start(engine: Engine) -> None:
    batcher = Batcher(UnloadableEngine(engine), max_batch=2, max_wait_s=0.01)
    with pytest.raises(EngineUnavailable, match="weights not found"):
        batcher.start()
    with pytest.raises(EngineError):
        batcher.submit(request("never")).result(1)


def test_stop_finishes_what_was_queued_before_it(engine: Engine) -> None:
    batcher = Batcher(SharedEngine(engine), max_batch=2, max_wait_s=0.2)
    batcher.start()
    futures = [batcher.submit(request(f"queued {i}")) for i in range(5)]
    assert batcher.stop(timeout=30) is True
    assert all(isinstance(future.result(0), BatchItem) for future in futures)


def test_mixed_traffic_fills_a_batch_per_group(engine: Engine) -> None:
    """Interleaved jobs of two groups (two seeds): each group fills its own full batch, instead of
    every collection being split into half-empty passes."""
    batcher = started(engine, max_batch=4, max_wait_s=1.0)
    futures = [batcher.submit(request(f"job {i}", seed=i % 2)) for i in range(16)]
    items = [future.result(10) for future in futures]
    batcher.stop()
    assert [item.batch_size for item in items] == [4] * 16
    assert len({item.batch_id for item in items}) == 4
    for item, future in zip(items, futures, strict=True):  # every batch holds one group only
        same_batch = [i for i, other in enumerate(items) if other.batch_id == item.batch_id]
        assert len({i % 2 for i in same_batch}) == 1, future


def test_a_lone_job_runs_after_max_wait_not_never(engine: Engine) -> None:
    batcher = started(engine, max_batch=8, max_wait_s=0.05)
    assert batcher.submit(request("alone")).result(10).batch_size == 1
    batcher.stop()


class SlowEngine(SharedEngine):
    """Each engine call takes at least 0.3 s, like a real forward pass on a loaded device."""

    def synthesize_batch(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        import time

        time.sleep(0.3)
        return super().synthesize_batch(requests)


def test_jobs_that_arrive_during_a_batch_form_the_next_full_one(engine: Engine) -> None:
    """Even with no wait at all (max_wait 0), what queued up behind a running batch runs together."""
    import time

    batcher = Batcher(SlowEngine(engine), max_batch=8, max_wait_s=0.0)
    batcher.start()
    first = batcher.submit(request("first"))
    time.sleep(0.1)  # the first batch is on the engine now
    rest = [batcher.submit(request(f"queued {i}")) for i in range(8)]
    assert first.result(10).batch_size == 1
    assert [future.result(10).batch_size for future in rest] == [8] * 8
    batcher.stop()


def test_a_batch_waits_for_jobs_on_their_way_past_a_pause(engine: Engine) -> None:
    """Jobs a worker is still checking (``expect``) hold a batch that is not full: here past the pause
    after which a batch with nothing coming would have left alone."""
    import time

    batcher = started(engine, max_batch=4, max_wait_s=4.0)  # a pause is at least 1 s here
    coming = [batcher.expect() for _ in range(3)]
    first = batcher.submit(request("first"))
    time.sleep(1.5)
    rest = []
    for handle, text in zip(coming, ("second", "third", "fourth"), strict=True):
        rest.append(batcher.submit(request(text)))
        handle.done()
    assert [future.result(10).batch_size for future in (first, *rest)] == [4] * 4
    batcher.stop()


@pytest.mark.parametrize("announced", [False, True])
def test_a_lone_job_does_not_wait_the_whole_bound(engine: Engine, announced: bool) -> None:
    """Nothing coming (or a job announced that left without arriving, a cache hit say): the job runs
    after a pause, a quarter of the bound, not the bound itself."""
    batcher = started(engine, max_batch=8, max_wait_s=20.0)
    handle = batcher.expect() if announced else None
    future = batcher.submit(request("alone"))
    if handle is not None:
        handle.done()
    assert future.result(15).batch_size == 1  # the pause is 5 s; the bound 20 s would time out
    batcher.stop()


class StreamingShared(SharedEngine):
    """``SharedEngine`` for an engine that streams: streaming rows get their audio as it is made."""

    streams_audio = True

    def synthesize_batch(  # type: ignore[override]
        self, requests: Sequence[SynthesisRequest], pieces: Sequence[Piece | None] | None = None
    ) -> list[EngineOutput | Exception]:
        self.calls.append(len(requests))
        if any(r.text == "poison" for r in requests):
            for piece in pieces or []:
                if piece is not None:
                    piece(np.ones(10, dtype=np.int16))  # audio that must not count: the pass fails
            raise RuntimeError("device fault")
        return self.inner.synthesize_batch(requests, pieces=pieces)  # type: ignore[call-arg]


def test_a_streaming_job_waits_for_no_company(engine: Engine) -> None:
    # Without a listener, a lone job would wait a quarter of this bound (15 s) for company.
    batcher = Batcher(StreamingShared(engine), max_batch=8, max_wait_s=60.0)  # type: ignore[arg-type]
    batcher.start()
    got: list[np.ndarray | None] = []
    item = batcher.submit(request("Someone is listening.", stream=True), on_piece=got.append).result(10)
    assert item.batch_size == 1
    assert got and np.array_equal(np.concatenate([g for g in got if g is not None]), item.output.samples)
    batcher.stop()


def test_a_streaming_row_run_again_starts_its_audio_over(engine: Engine) -> None:
    streaming = StreamingShared(engine)
    batcher = Batcher(streaming, max_batch=2, max_wait_s=0.5)  # type: ignore[arg-type]
    batcher.start()
    got: list[np.ndarray | None] = []
    with ThreadPoolExecutor(2) as pool:
        poisoned = pool.submit(lambda: batcher.submit(request("poison")).result(10))
        listened = batcher.submit(request("Heard twice, kept once.", stream=True), on_piece=got.append)
        item = listened.result(10)
        with pytest.raises(EngineError):
            poisoned.result(10)
    assert streaming.calls[0] == 2  # they shared the pass that failed, then ran one by one
    # Pieces of the failed pass, then "starts over", then the audio the job keeps.
    last_restart = max(i for i, piece in enumerate(got) if piece is None)
    assert any(piece is not None for piece in got[:last_restart])
    kept = [piece for piece in got[last_restart + 1 :] if piece is not None]
    assert np.array_equal(np.concatenate(kept), item.output.samples)
    batcher.stop()


def test_a_group_whose_audio_would_queue_behind_the_encoders_waits_there_for_company(engine: Engine) -> None:
    # The encoders are busy (``downstream``): a lone job does not leave after its short window, it waits
    # until they are about to run dry, and the jobs that came meanwhile ride with it.
    busy = threading.Event()
    asked = threading.Semaphore(0)

    def downstream(requests: Sequence[SynthesisRequest]) -> float:
        if busy.is_set():
            asked.release()
            return 3600.0
        return 0.0

    batcher = started(engine, max_batch=8, max_wait_s=0.01, downstream=downstream)
    assert batcher.submit(request("a first call, so an engine call's time is known")).result(10).batch_size == 1
    busy.set()
    first = batcher.submit(request("the first to wait"))
    assert asked.acquire(timeout=10)  # the batcher asked, and held it past its 10 ms window
    others = [batcher.submit(request(f"then number {i}")) for i in range(3)]
    assert not first.done()
    busy.clear()  # the encoders run dry
    items = [future.result(10) for future in (first, *others)]
    batcher.stop()
    assert [item.batch_size for item in items] == [4] * 4
    assert len({item.batch_id for item in items}) == 1


def test_a_streaming_job_never_waits_for_the_encoders(engine: Engine) -> None:
    busy = threading.Event()
    batcher = started(engine, max_batch=8, max_wait_s=0.01, downstream=lambda _: 3600.0 if busy.is_set() else 0.0)
    assert batcher.submit(request("a first call, so an engine call's time is known")).result(10).batch_size == 1
    busy.set()
    streamed = batcher.submit(request("someone is listening"), on_piece=lambda piece: None)
    assert isinstance(streamed.result(10), BatchItem)
    batcher.stop()
