"""Quantized weights (``TTSQ_QWEN_QUANT``): the layer, what loading reports, and the identity.

Token-for-token equality of the two engines at the same quantization is in ``test_qwen_fast.py``;
jobs through the queue with int8 weights in ``test_qwen_fast_worker.py``; fidelity against full
precision is measured by ``benchmarks/quant.py``, not asserted here.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import pytest
import torch

from ttsq.config import Settings
from ttsq.engines.qwen.engine import QwenEngine
from ttsq.engines.qwen.fast import QwenFastEngine
from ttsq.engines.qwen.quant import QuantizedLinear, quantize
from ttsq.errors import ConfigError
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow


def linear(inputs: int = 96, outputs: int = 40, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(inputs, outputs, bias=bias)


@pytest.mark.parametrize(("kind", "tolerance"), [("int8", 0.02), ("fp8", 0.08)])
def test_a_quantized_linear_is_close_to_the_full_precision_one(kind: str, tolerance: float) -> None:
    full = linear()
    quantized = QuantizedLinear(full, kind)
    quantized.kernel = "native" if kind == "int8" else "widened"  # a CPU has no fp8 matrix multiply
    x = torch.randn(7, 3, 96)
    with torch.inference_mode():
        want, got = full(x), quantized(x)
    assert got.shape == want.shape and got.dtype == want.dtype
    error = ((got - want).norm() / want.norm()).item()
    assert 0 < error < tolerance


@pytest.mark.parametrize(("kind", "kernel"), [("int8", "native"), ("int8", "widened"), ("fp8", "widened")])
def test_a_row_gets_the_same_numbers_whatever_rows_are_beside_it(kind: str, kernel: str) -> None:
    """What keeps a seeded row's audio independent of its batch: per-tensor activation scales would
    let one loud neighbour coarsen every other row's rounding."""
    quantized = QuantizedLinear(linear(), kind)
    quantized.kernel = kernel
    row = torch.randn(1, 96)
    loud = torch.randn(5, 96) * 1000
    with torch.inference_mode():
        alone = quantized(row)
        crowded = quantized(torch.cat([loud[:2], row, loud[2:]]))[2:3]
    if kernel == "native":  # integer products: exact
        assert torch.equal(alone, crowded)
    else:  # a float matrix multiply may block 1 row and 6 differently: within float rounding
        assert torch.allclose(alone, crowded, rtol=1e-5, atol=1e-6)


def test_int8_weights_take_a_quarter_of_float32(qwen_checkpoints: dict[str, Path]) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        from qwen_tts import Qwen3TTSModel
    tts = Qwen3TTSModel.from_pretrained(str(qwen_checkpoints["voice_design"]), device_map="cpu", dtype=torch.float32)
    layers = len(tts.model.talker.model.layers) + len(tts.model.talker.code_predictor.model.layers)
    report = quantize(tts.model, "int8")
    assert report.layers == 7 * layers and report.kernel == "native"
    # int8 weights plus one float32 scale per output channel
    assert report.bytes_before / 4 < report.bytes_after < report.bytes_before / 3.5
    proj = tts.model.talker.model.layers[0].self_attn.q_proj
    assert isinstance(proj, QuantizedLinear) and proj.qweight.dtype == torch.int8
    assert isinstance(tts.model.talker.codec_head, torch.nn.Linear)  # the heads stay in full precision


@pytest.mark.parametrize("engine", [QwenEngine, QwenFastEngine])
def test_quantized_weights_have_their_own_content_keys(
    engine: type[QwenEngine], qwen_checkpoints: dict[str, Path]
) -> None:
    settings = Settings(engine=engine.name, qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=256)
    request = SynthesisRequest(text="Hello there.", mode="voice_design", instruct="A calm voice.", seed=3)
    identities = {quant: engine(settings.replace(qwen_quant=quant)).identity for quant in ("none", "int8", "fp8")}
    keys = {quant: content_key(request, identity) for quant, identity in identities.items()}
    assert len(set(keys.values())) == 3
    assert identities["none"].revision.endswith(f"cap1-{settings.qwen_max_frames}")  # keys made before stay
    assert identities["int8"].revision == identities["none"].revision + ".int8"


def test_an_unknown_quantization_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match="TTSQ_QWEN_QUANT"):
        Settings.from_env({"TTSQ_QWEN_QUANT": "int4"})
    with pytest.raises(ConfigError, match="TTSQ_TORCH_THREADS"):
        Settings.from_env({"TTSQ_TORCH_THREADS": "-1"})


def test_loading_reports_the_memory_saved_and_the_threads(
    qwen_checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    settings = Settings(
        engine="qwen-fast",
        qwen_model=str(qwen_checkpoints["voice_design"]),
        qwen_max_frames=256,
        max_batch=2,
        qwen_quant="int8",
        torch_threads=1,
    )
    engine = QwenFastEngine(settings)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO):
            engine.load()
        assert engine.quant_report is not None and engine.quant_report.saved > 0
        assert engine.torch_threads == 1 and torch.get_num_threads() == 1
        text = caplog.text
        assert "int8 weights for" in text and "MB saved" in text
        assert "weights int8" in text and "1 intra-op threads per torch thread (2 of them" in text
    finally:
        engine.close()
        torch.set_num_threads(threads)
