"""qwen-fast's codec decoder (``ttsq.engines.qwen.codec``) against qwen-tts's own, on the same codes.

The rewrite must give the stock decoder's audio within float rounding: 1e-5 of full scale, under a
third of one 16-bit PCM step, on the tiny checkpoint's codec and on the full-size architecture, for rows
of different lengths decoded together (the padding and the causal convolutions' edges included).
"""

from __future__ import annotations

import contextlib
import copy
import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ttsq.engines.qwen.codec import FoldedSnake, PointwiseConv, rewrite

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-5


def stock_kinds(decoder: torch.nn.Module) -> tuple[int, int]:
    """How many pointwise convolutions and SnakeBeta activations of qwen-tts's the decoder holds."""
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as codec

    pointwise = sum(
        1
        for m in decoder.modules()
        if isinstance(m, codec.Qwen3TTSTokenizerV2CausalConvNet) and m.conv.kernel_size == (1,)
    )
    snakes = sum(1 for m in decoder.modules() if isinstance(m, codec.SnakeBeta))
    return pointwise, snakes


def decode_both(decoder: torch.nn.Module, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    fast = copy.deepcopy(decoder)
    pointwise, snakes = stock_kinds(decoder)
    swapped = rewrite(fast)
    assert swapped == pointwise + snakes and pointwise > 0 and snakes > 0
    assert stock_kinds(fast) == (0, 0)
    assert sum(isinstance(m, PointwiseConv) for m in fast.modules()) == pointwise
    assert sum(isinstance(m, FoldedSnake) for m in fast.modules()) == snakes
    with torch.inference_mode():
        return decoder.chunked_decode(codes), fast.chunked_decode(codes), swapped


def load_codec(path: Path) -> Any:
    with contextlib.redirect_stdout(io.StringIO()):  # qwen-tts's flash-attn banner
        from qwen_tts import Qwen3TTSModel
    tts = Qwen3TTSModel.from_pretrained(str(path), device_map="cpu", dtype=torch.float32)
    return tts.model.speech_tokenizer


def test_the_tiny_codec_rewritten_decodes_the_stock_audio(qwen_checkpoints: dict[str, Path]) -> None:
    tokenizer = load_codec(qwen_checkpoints["voice_design"])
    torch.manual_seed(0)
    codes = torch.randint(0, 2048, (3, 16, 40))
    want, got, _ = decode_both(tokenizer.model.decoder, codes)
    assert want.shape == got.shape == (3, 1, 40 * 1920)
    assert float(want.std()) > 0.01  # a signal, not the silence an untrained codec makes
    assert float((want - got).abs().max()) <= TOLERANCE


def test_rows_of_different_lengths_decode_as_the_stock_codec_decodes_them(qwen_checkpoints: dict[str, Path]) -> None:
    """The codec's own ``decode`` (padding rows with -1 to the longest, cut back to each row's length),
    stock against a tokenizer whose decoder is rewritten."""
    stock, fast = load_codec(qwen_checkpoints["voice_design"]), load_codec(qwen_checkpoints["voice_design"])
    rewrite(fast.model.decoder)
    torch.manual_seed(1)
    rows = [{"audio_codes": torch.randint(0, 2048, (frames, 16))} for frames in (48, 7, 1, 30)]
    with torch.inference_mode():
        want, _ = stock.decode(rows)
        got, _ = fast.decode(rows)
    assert [w.shape for w in want] == [g.shape for g in got] == [(f * 1920,) for f in (48, 7, 1, 30)]
    assert max(float(np.abs(w - g).max()) for w, g in zip(want, got, strict=True)) <= TOLERANCE


def test_the_full_size_codec_rewritten_decodes_the_stock_audio() -> None:
    """The released architecture (8 x 512 transformer, 1536 decoder channels: 96 and 192 at the stages
    where the rewrite matters), randomly initialised as ``qwen_checkpoint`` initialises it."""
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2DecoderConfig
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

    from ttsq.testing.qwen_checkpoint import _FULL_DECODER

    torch.manual_seed(2)
    decoder = Qwen3TTSTokenizerV2Decoder(Qwen3TTSTokenizerV2DecoderConfig(**_FULL_DECODER)).eval()
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.reset_parameters()
        for name, weight in decoder.named_parameters():
            if name.endswith(("embedding_sum", "scale")):
                torch.nn.init.normal_(weight)
            elif name.endswith(("alpha", "beta")):  # trained values are not all zero: fold real ones
                torch.nn.init.normal_(weight, std=0.3)
    codes = torch.randint(0, 2048, (2, 16, 6))
    want, got, swapped = decode_both(decoder, codes)
    assert swapped == 4 * 3 + 4 * 3 * 2 + 4 + 1  # per block: 3 pointwise, 6 + 1 snakes; the last snake
    assert float(want.abs().max()) > 0.01
    assert float((want - got).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("engine", ["qwen", "qwen-fast"])
def test_only_qwen_fast_runs_the_rewritten_codec(engine: str, qwen_checkpoints: dict[str, Path]) -> None:
    from ttsq.config import Settings
    from ttsq.engines import create_engine

    loaded = create_engine(Settings(engine=engine, qwen_model=str(qwen_checkpoints["voice_design"]), max_batch=2))
    loaded.load()
    try:
        decoder = loaded._tts.model.speech_tokenizer.model.decoder
        pointwise, snakes = stock_kinds(decoder)
        assert (pointwise == 0 and snakes == 0) == (engine == "qwen-fast")
    finally:
        loaded.close()
