"""qwen-fast's decode loop against stock qwen-tts, token for token, on the tiny random checkpoints.

Greedy settings (``do_sample=False`` for the talker and the sub-talker) make both deterministic, so the
codes must be equal: every codebook of every frame, for all three modes, batches of 1 to 16 rows of
mixed lengths and caps, rows joining mid-flight, and rows that stop at their end token. float32 on a
CPU, the dtype both engines use there. The stock reference is qwen-tts's own batched ``generate``
(its codes recorded on their way to the codec), run to the largest cap and cut to each row's.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ttsq.engines.qwen.decode import DecodeLoop, Prompt
from ttsq.engines.qwen.sampling import Sampling, SubSampling

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

GREEDY = {"do_sample": False, "subtalker_dosample": False}
TEXTS = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "fox",
    "Hello world. The quick brown fox. Hello again, world.",
    "world world",
    "The",
    "quick brown",
    "Hello, hello.",
    "A fox.",
    "Brown.",
    "The world is quick.",
    "Hello there, quick fox.",
    "Dog",
    "Over the world.",
    "Jumps.",
]


def load(path: Path) -> Any:
    with contextlib.redirect_stdout(io.StringIO()):  # qwen-tts's flash-attn banner
        from qwen_tts import Qwen3TTSModel
    import transformers

    transformers.logging.set_verbosity_error()
    return Qwen3TTSModel.from_pretrained(str(path), device_map="cpu", dtype=torch.float32, attn_implementation="sdpa")


@pytest.fixture(scope="module")
def models(qwen_checkpoints: dict[str, Path]) -> Iterator[dict[str, Any]]:
    yield {kind: load(path) for kind, path in qwen_checkpoints.items()}


def tone(seconds: float = 1.0, hz: float = 220.0) -> tuple[np.ndarray, int]:
    t = np.arange(int(24_000 * seconds), dtype=np.float32) / 24_000
    return (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), 24_000


class Case:
    """One mode's rows: how stock generates them all as one batch, and how to capture one row's prompt."""

    def __init__(self, kind: str, tts: Any, size: int) -> None:
        self.tts = tts
        self.texts = [TEXTS[i % len(TEXTS)] for i in range(size)]
        self.languages = ["auto" if i % 3 else "english" for i in range(size)]
        self.kind = kind
        if kind == "voice_design":
            self.extra = [{"instruct": "" if i % 2 else "A calm voice."} for i in range(size)]
        elif kind == "custom_voice":
            speakers = ["vivian", "ryan", "sohee"]
            self.extra = [{"speaker": speakers[i % 3], "instruct": "" if i % 2 else "Softly."} for i in range(size)]
        else:  # clone rows alternate in-context (reference codes + transcript) and x-vector-only prompts
            icl = tts.create_voice_clone_prompt(ref_audio=[tone(1.0)], ref_text=["Hello world."])[0]
            xvec = tts.create_voice_clone_prompt(ref_audio=[tone(0.8, 330.0)], x_vector_only_mode=True)[0]
            self.extra = [{"voice": icl if i % 2 == 0 else xvec} for i in range(size)]

    def _generate(self, rows: list[int], **kwargs: Any) -> None:
        texts = [self.texts[i] for i in rows]
        languages = [self.languages[i] for i in rows]
        extra = [self.extra[i] for i in rows]
        if self.kind == "voice_design":
            self.tts.generate_voice_design(
                text=texts, language=languages, instruct=[e["instruct"] for e in extra], **kwargs
            )
        elif self.kind == "custom_voice":
            self.tts.generate_custom_voice(
                text=texts,
                language=languages,
                speaker=[e["speaker"] for e in extra],
                instruct=[e["instruct"] for e in extra],
                **kwargs,
            )
        else:
            self.tts.generate_voice_clone(
                text=texts, language=languages, voice_clone_prompt=[e["voice"] for e in extra], **kwargs
            )

    def stock(self, caps: list[int]) -> list[Any]:
        """Stock qwen-tts's codes for every row, one batched generate, each row cut to its cap."""
        recorded: list[Any] = []
        model = self.tts.model
        original = model.generate

        def record(**kwargs: Any) -> Any:
            result = original(**kwargs)
            recorded.append(result[0])
            return result

        model.generate = record
        try:
            with torch.inference_mode():
                self._generate(list(range(len(self.texts))), max_new_tokens=max(caps) + 1, **GREEDY)
        finally:
            del model.generate
        return [codes[:cap] for codes, cap in zip(recorded[0], caps, strict=True)]

    def prompt(self, row: int) -> Prompt:
        with torch.inference_mode():
            return Prompt.capture(self.tts, lambda: self._generate([row]))


def greedy_loop(tts: Any, slots: int, *, static: bool = False) -> DecodeLoop:
    return DecodeLoop(
        tts.model, slots=slots, positions=512, max_frames=128, sub=SubSampling(do_sample=False), static=static
    )


def caps_for(size: int) -> list[int]:
    return [6 + (i * 7) % 23 for i in range(size)]


def decode_all(
    loop: DecodeLoop, case: Case, caps: list[int], *, on_step: Callable[[int], None] | None = None
) -> dict[int, Any]:
    """Run every row through the loop, admitting each as soon as a slot is free; tag -> finished row."""
    waiting = list(range(len(caps)))
    done: dict[int, Any] = {}
    steps = 0
    while waiting or loop.active:
        while waiting and loop.free_slots():
            row = waiting.pop(0)
            if on_step is not None and loop.active:
                on_step(steps)
            loop.admit(case.prompt(row), cap=caps[row], sampling=Sampling(do_sample=False), tag=row)
        for finished in loop.step():
            done[finished.tag] = finished
        steps += 1
    return done


def assert_same(done: dict[int, Any], expected: list[Any], caps: list[int]) -> None:
    assert sorted(done) == list(range(len(expected)))
    for row, codes in enumerate(expected):
        ours = done[row].codes
        assert ours.shape == codes.shape, (row, ours.shape, codes.shape)
        assert torch.equal(ours, codes), f"row {row}: first difference at {(ours != codes).nonzero()[:1].tolist()}"
        assert done[row].truncated == (codes.shape[0] >= caps[row])


@pytest.mark.parametrize(
    ("kind", "size"),
    [
        ("voice_design", 1),
        ("voice_design", 2),
        ("voice_design", 5),
        ("voice_design", 16),
        ("custom_voice", 1),
        ("custom_voice", 16),
        ("base", 1),
        ("base", 16),
    ],
)
def test_greedy_codes_equal_stock_for_a_batch_of_mixed_lengths(models: dict[str, Any], kind: str, size: int) -> None:
    case = Case(kind, models[kind], size)
    caps = caps_for(size)
    expected = case.stock(caps)
    loop = greedy_loop(models[kind], slots=size)
    assert_same(decode_all(loop, case, caps), expected, caps)


@pytest.mark.parametrize(("kind", "static"), [("voice_design", False), ("base", False), ("custom_voice", True)])
def test_greedy_codes_equal_stock_for_rows_joining_mid_flight(models: dict[str, Any], kind: str, static: bool) -> None:
    """``static`` runs the shapes a CUDA graph records (rows and cache length rounded up to their
    buckets, free slots stepping along), uncaptured."""
    size = 11
    case = Case(kind, models[kind], size)
    caps = caps_for(size)
    expected = case.stock(caps)
    joined: list[int] = []
    loop = greedy_loop(models[kind], slots=6 if static else 4, static=static)  # rows join others decoding
    assert_same(decode_all(loop, case, caps, on_step=joined.append), expected, caps)
    assert len(joined) >= 7 and any(step > 0 for step in joined)


def test_greedy_codes_equal_stock_when_rows_stop_at_their_end_token(qwen_checkpoints: dict[str, Path]) -> None:
    # Random weights almost never choose the end token. Give it the weights of the code greedy
    # decoding picks most, a little larger: rows then end wherever that code would have won.
    tts = load(qwen_checkpoints["voice_design"])
    size = 8
    case = Case("voice_design", tts, size)
    caps = [40] * size
    picked = torch.cat([codes[:, 0] for codes in case.stock(caps)]).bincount().argmax()
    head = tts.model.talker.codec_head.weight
    eos = tts.model.config.talker_config.codec_eos_token_id
    with torch.no_grad():
        head[eos] = head[picked] * 1.02
    caps = [40, 10, 40, 25, 40, 40, 12, 40]
    expected = case.stock(caps)
    ended = [row for row, codes in enumerate(expected) if codes.shape[0] < caps[row]]
    assert ended, "no row stopped at its end token: the test would prove nothing"
    done = decode_all(greedy_loop(tts, slots=3), case, caps)
    assert_same(done, expected, caps)
    assert all(not done[row].truncated for row in ended)


@pytest.mark.parametrize("sub_top_p", [0.9, 1.0])  # the sub-talker's nucleus path, and its per-frame race
def test_seeded_sampling_does_not_depend_on_the_batch(models: dict[str, Any], sub_top_p: float) -> None:
    tts = models["voice_design"]
    case = Case("voice_design", tts, 6)
    sub = SubSampling(do_sample=True, temperature=0.9, top_k=50, top_p=sub_top_p)

    def run(rows: list[int], seeds: list[int], slots: int) -> dict[int, Any]:
        loop = DecodeLoop(tts.model, slots=slots, positions=512, max_frames=64, sub=sub)
        done: dict[int, Any] = {}
        waiting = list(zip(rows, seeds, strict=True))
        while waiting or loop.active:
            while waiting and loop.free_slots():
                row, seed = waiting.pop(0)
                loop.admit(
                    case.prompt(row),
                    cap=20,
                    tag=(row, seed),
                    sampling=Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=seed),
                )
            for finished in loop.step():
                done[finished.tag] = finished.codes
        return done

    alone = run([3], [7], slots=1)[(3, 7)]
    crowded = run([0, 1, 3, 4, 5], [1, 2, 7, 4, 5], slots=2)  # row 3 joins mid-flight, in another slot
    assert torch.equal(crowded[(3, 7)], alone)
    assert not torch.equal(run([3], [8], slots=1)[(3, 8)], alone)


# -- quantized weights (TTSQ_QWEN_QUANT) ----------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(qwen_checkpoints: dict[str, Path]) -> Callable[[str, str], Any]:
    """Fresh checkpoints with quantized decoder layers, one per (kind, quantization), loaded once."""
    from ttsq.engines.qwen.quant import quantize

    loaded: dict[tuple[str, str], Any] = {}

    def get(kind: str, quant: str) -> Any:
        if (kind, quant) not in loaded:
            tts = load(qwen_checkpoints[kind])
            quantize(tts.model, quant)
            loaded[(kind, quant)] = tts
        return loaded[(kind, quant)]

    return get


@pytest.mark.parametrize(
    ("kind", "size", "quant"),
    [("voice_design", 8, "int8"), ("custom_voice", 5, "int8"), ("base", 8, "int8"), ("voice_design", 5, "fp8")],
)
def test_quantized_greedy_codes_equal_stock_at_the_same_quantization(
    models: dict[str, Any], quantized: Callable[[str, str], Any], kind: str, size: int, quant: str
) -> None:
    """Per-row activation scales keep every row independent of its neighbours (stock left-pads them
    into one batch), so the two engines stay token for token equal when both are quantized."""
    tts = quantized(kind, quant)
    case = Case(kind, tts, size)
    caps = caps_for(size)
    expected = case.stock(caps)
    full = Case(kind, models[kind], size).stock(caps)
    assert any(not torch.equal(a, b) for a, b in zip(expected, full, strict=True)), "quantization changed nothing"
    assert_same(decode_all(greedy_loop(tts, slots=size), case, caps), expected, caps)


def test_int8_rows_joining_mid_flight_in_static_shapes_equal_stock(quantized: Callable[[str, str], Any]) -> None:
    tts = quantized("voice_design", "int8")
    case = Case("voice_design", tts, 9)
    caps = caps_for(9)
    expected = case.stock(caps)
    joined: list[int] = []
    loop = greedy_loop(tts, slots=4, static=True)
    assert_same(decode_all(loop, case, caps, on_step=joined.append), expected, caps)
    assert any(step > 0 for step in joined)


def test_grouped_top_k_keeps_exactly_the_top_k_values() -> None:
    """``top`` ranks only the groups whose maxima can hold a top-k score: same values as ``topk``,
    indices that point at them, also with ties and with the whole top-k inside one group."""
    from ttsq.engines.qwen.sampling import top

    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 2048, generator=generator)
    scores[1] = torch.randint(0, 5, (2048,), generator=generator).float()  # massive ties
    scores[2, 64:72] += 100.0  # one group holds the 8 best
    scores[3] = torch.linspace(0, 1, 2048)  # the best all in the last groups
    for k in (1, 8, 50, 256):
        values, indices = top(scores, k)
        assert torch.equal(values, scores.topk(k, dim=-1, sorted=True).values)
        assert torch.equal(scores.gather(1, indices), values)
        assert all(len(set(row.tolist())) == k for row in indices)


# -- the engine -----------------------------------------------------------------------------------


@pytest.fixture
def fast(qwen_checkpoints: dict[str, Path]) -> Any:
    """A qwen-fast engine with two slots, not loaded yet (the batcher loads it on its thread)."""
    from ttsq.config import Settings
    from ttsq.engines.qwen.fast import QwenFastEngine

    return QwenFastEngine(
        Settings(engine="qwen-fast", qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=256, max_batch=2)
    )


def test_identity_is_the_qwen_engines_under_its_own_name(fast: Any, qwen_checkpoints: dict[str, Path]) -> None:
    from ttsq.config import Settings
    from ttsq.engines.qwen.engine import QwenEngine

    stock = QwenEngine(
        Settings(engine="qwen", qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=256)
    ).identity
    assert fast.identity.engine == "qwen-fast" and stock.engine == "qwen"
    assert (fast.identity.model, fast.identity.revision, fast.identity.modes, fast.identity.languages) == (
        stock.model,
        stock.revision,
        stock.modes,
        stock.languages,
    )


def test_a_long_text_is_refused_at_the_edge_by_the_identity(qwen_checkpoints: dict[str, Path]) -> None:
    """The identity the workers announce carries the prompt limit: a producer refuses, naming the field,
    a text that would not fit a slot (the stock engine takes it)."""
    from ttsq.config import Settings
    from ttsq.engines.base import EngineIdentity
    from ttsq.engines.qwen.engine import QwenEngine
    from ttsq.engines.qwen.fast import QwenFastEngine
    from ttsq.errors import InvalidRequest
    from ttsq.job import SynthesisRequest

    model = str(qwen_checkpoints["voice_design"])
    fast = QwenFastEngine(Settings(engine="qwen-fast", qwen_model=model)).identity
    published = EngineIdentity.from_dict(fast.to_dict())  # as producers read it from Redis
    text = "Word " * 400  # 2000 bytes: within the text limit, beyond a slot's prompt area
    with pytest.raises(InvalidRequest) as refused:
        published.check(SynthesisRequest.from_dict({"text": text}))
    assert refused.value.field == "text"
    published.check(SynthesisRequest.from_dict({"text": "Word " * 150}))
    QwenEngine(Settings(engine="qwen", qwen_model=model)).identity.check(SynthesisRequest.from_dict({"text": text}))


def test_short_jobs_leave_while_a_long_one_decodes(fast: Any) -> None:
    """Through the batcher: two slots, one long job and five short ones submitted behind it. Each short
    job joins as a slot frees and is done long before the long one (no job waits for its batch)."""
    from ttsq.batching.batcher import Batcher
    from ttsq.errors import InvalidRequest
    from ttsq.job import SynthesisRequest

    # The window only delays the first frame (an idle engine waits out a pause in the arrivals).
    batcher = Batcher(fast, max_batch=2, max_wait_s=5.0)
    batcher.start()
    order: list[str] = []
    try:
        long = batcher.submit(SynthesisRequest.from_dict({"text": "A long one.", "max_new_tokens": 250, "seed": 1}))
        long.add_done_callback(lambda _: order.append("long"))
        shorts = [
            batcher.submit(SynthesisRequest.from_dict({"text": f"Short {i}.", "max_new_tokens": 4 + i, "seed": i}))
            for i in range(5)
        ]
        for i, future in enumerate(shorts):
            future.add_done_callback(lambda _, i=i: order.append(f"short{i}"))
        bad = batcher.submit(
            SynthesisRequest.from_dict({"text": "Wrong mode.", "mode": "custom_voice", "speaker": "vivian"})
        )
        items = [future.result(120) for future in shorts]
        with pytest.raises(InvalidRequest):
            bad.result(120)
        assert long.result(120).output.truncated
    finally:
        batcher.stop()
    assert order.index("long") == len(order) - 1
    assert [item.output.samples.size for item in items] == [(4 + i) * 1920 for i in range(5)]
    assert all(item.output.truncated for item in items)


def test_an_idle_engine_waits_for_a_burst_on_its_way_and_a_lone_job_starts_at_once(fast: Any) -> None:
    """Rows that start together end together and refill their slots together: an idle engine does not
    start a burst one row a frame while more of it is on its way (a task thread checking a job), and
    holds a lone job nothing is coming after only for a pause in the arrivals (a quarter of the window),
    never for the whole window."""
    from ttsq.batching.batcher import Batcher
    from ttsq.job import SynthesisRequest

    batcher = Batcher(fast, max_batch=2, max_wait_s=12.0)  # the engine's two slots
    batcher.start()
    entered: list[int] = []

    def job(i: int) -> Any:
        request = SynthesisRequest.from_dict({"text": f"Burst {i}.", "max_new_tokens": 6, "seed": 1})
        return batcher.submit(request, on_enter=lambda: entered.append(i))

    try:
        on_its_way = batcher.expect()
        burst = [job(0)]
        time.sleep(1.0)
        assert entered == []  # one row, one more coming: it did not start alone
        burst.append(job(1))
        on_its_way.done()
        assert all(future.result(120).output.samples.size == 6 * 1920 for future in burst)
        assert sorted(entered) == [0, 1]
        started = time.monotonic()
        job(2).result(120)  # nothing on its way: a 3 s pause, not the 12 s window
        assert time.monotonic() - started < 10
    finally:
        batcher.stop()


def test_the_codec_takes_every_core_only_once_the_loop_has_stopped(fast: Any) -> None:
    """On a CPU the codec thread decodes a generation with its share of the cores while the loop goes on
    (queued jobs join the slots it freed) and with all of them after the last generation. It used to
    read the loop's size itself, just before the next jobs' admission, and run a team of every core
    beside the loop: three busy threads on two cores."""
    from ttsq.batching.batcher import Batcher
    from ttsq.engines.qwen.engine import usable_cores
    from ttsq.job import SynthesisRequest

    batcher = Batcher(fast, max_batch=2, max_wait_s=5.0)  # the engine's two slots: two generations of two
    batcher.start()
    threads: dict[int, int] = {}
    try:
        jobs = [
            batcher.submit(SynthesisRequest.from_dict({"text": f"Job {i}.", "max_new_tokens": 6, "seed": 1}))
            for i in range(4)
        ]
        for i, future in enumerate(jobs):
            # Called on the codec thread, right after the decode: the threads it decoded with (torch
            # reports the last count set, and only the codec thread sets one after the load).
            future.add_done_callback(lambda _, i=i: threads.setdefault(i, torch.get_num_threads()))
        items = [future.result(120) for future in jobs]
    finally:
        batcher.stop()
    assert [item.batch_size for item in items] == [1, 2, 1, 2]  # rows in the engine as each joined
    if fast.torch_threads == usable_cores():
        pytest.skip("one usable core: the codec's share and all of them are the same")
    assert threads == {0: fast.torch_threads, 1: fast.torch_threads, 2: usable_cores(), 3: usable_cores()}


def test_an_isolated_job_decodes_alone(fast: Any) -> None:
    """A redelivered job that may have crashed a worker runs with no neighbour, in continuous mode too:
    it waits for the slots to empty, and nothing joins it until it is done."""
    from ttsq.batching.batcher import Batcher
    from ttsq.job import SynthesisRequest

    batcher = Batcher(fast, max_batch=2, max_wait_s=0.01)
    batcher.start()
    order: list[str] = []

    def job(name: str, frames: int, *, isolated: bool = False) -> Any:
        future = batcher.submit(
            SynthesisRequest.from_dict({"text": name, "max_new_tokens": frames, "seed": 1}), isolated=isolated
        )
        future.add_done_callback(lambda _: order.append(name))
        return future

    try:
        jobs = [job("first", 30), job("second", 20), job("suspect", 5, isolated=True), job("third", 5)]
        items = {
            name: future.result(120) for name, future in zip(["first", "second", "suspect", "third"], jobs, strict=True)
        }
    finally:
        batcher.stop()
    assert order.index("suspect") > max(order.index("first"), order.index("second"))
    assert order.index("third") > order.index("suspect")
    assert items["suspect"].batch_size == 1 and items["third"].batch_size == 1


def test_static_sampling_draws_what_the_exact_shapes_draw(models: dict[str, Any]) -> None:
    """The bucketed shapes a CUDA graph records (1000 sorted candidates, the nucleus always on, rows and
    cache rounded up) sample the same codes as the exact shapes, row for row, rows joining mid-flight."""
    tts = models["custom_voice"]
    case = Case("custom_voice", tts, 5)
    sub = SubSampling(do_sample=True, temperature=0.9, top_k=50, top_p=1.0)
    settings = [
        Sampling(temperature=0.8, top_k=40, top_p=0.95, seed=3),
        Sampling(top_k=0, top_p=0.9, seed=4),
        Sampling(temperature=1.2, top_k=7, top_p=1.0, seed=5),
        Sampling(do_sample=False),
        Sampling(temperature=0.7, top_k=1000, top_p=0.8, seed=6),
    ]

    def run(static: bool) -> dict[int, Any]:
        loop = DecodeLoop(tts.model, slots=3, positions=512, max_frames=64, sub=sub, static=static)
        done: dict[int, Any] = {}
        waiting = list(range(5))
        while waiting or loop.active:
            while waiting and loop.free_slots():
                row = waiting.pop(0)
                loop.admit(case.prompt(row), cap=8 + 3 * row, tag=row, sampling=settings[row])
            for finished in loop.step():
                done[finished.tag] = finished.codes
        return done

    exact, static = run(False), run(True)
    assert sorted(exact) == list(range(5))
    for row in range(5):
        assert torch.equal(exact[row], static[row]), row


def test_top_k_zero_means_no_top_k(models: dict[str, Any]) -> None:
    """``top_k: 0`` (as a checkpoint's generation_config.json may say) keeps every code, as in Hugging
    Face's generate; it is not a top-1 (greedy) cut."""
    from ttsq.engines.qwen.sampling import top_k_of

    tts = models["voice_design"]
    loop = DecodeLoop(tts.model, slots=1, positions=512, max_frames=64, sub=SubSampling(top_k=0))
    slot = loop.admit(Case("voice_design", tts, 1).prompt(0), cap=4, sampling=Sampling(top_k=0))
    assert loop._rows[slot].top_k == loop.vocab
    assert int(loop._sub_top_k[0]) == loop.vocab
    race = loop._sub_race(loop._slot_index[:1], loop._step[:1])  # the sub-talker's top-k race, every code
    assert race is not None and race.shape[-1] == tts.model.talker.code_predictor.config.vocab_size
    assert top_k_of(0, 2048) == 2048 and top_k_of(5000, 2048) == 2048 and top_k_of(50, 2048) == 50


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.9, 50, 0.9), (0.5, 5, 0.3), (2.0, 64, 0.99)],
)
def test_sampling_keeps_and_weighs_what_hugging_faces_warpers_keep(
    temperature: float, top_k: int, top_p: float
) -> None:
    """``sample``'s draws on random logits, over many seeds: only codes Hugging Face's Temperature, TopK
    and TopP warpers keep are drawn, every kept code of any weight is drawn, and at the frequencies of
    their probabilities. Deterministic (fixed logits and seeds)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from ttsq.engines.qwen.sampling import sample, top_k_of

    vocab, draws = 64, 20_000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(7)) * 3
    warped = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        warped = TopKLogitsWarper(top_k)(None, warped)
    warped = TopPLogitsWarper(top_p)(None, warped)
    expected = warped.softmax(-1)[0]
    kept = set(torch.isfinite(warped[0]).nonzero().flatten().tolist())

    width = top_k_of(top_k, vocab)
    chosen = sample(
        logits.expand(draws, vocab),
        torch.full((draws,), temperature),
        torch.full((draws,), width),
        torch.full((draws,), top_p),
        torch.arange(draws),
        torch.zeros(draws, dtype=torch.long),
        width,
        nucleus=top_p < 1.0,
    )
    frequency = chosen.bincount(minlength=vocab).float() / draws
    assert set(chosen.unique().tolist()) <= kept
    assert {code for code in kept if expected[code] > 0.002} <= set(chosen.unique().tolist())
    assert (frequency - expected).abs().max() < 0.015, (frequency - expected).abs().max()
