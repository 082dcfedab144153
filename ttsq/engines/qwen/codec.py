"""The 12 Hz codec's decoder as ``qwen-fast`` runs it: qwen-tts's network, with two kinds of its modules
swapped for equivalent ones that cost less.

The pointwise convolutions become one matrix product and SnakeBeta takes its exponentials from buffers.
The audio is the stock decoder's up to float rounding (``tests/test_qwen_codec.py``), so the swap is not
part of the engine's identity; the ``qwen`` engine keeps the stock modules as the reference. Why, and
the timings: docs/qwen.md, "qwen-fast: ttsq's own decode loop", and docs/benchmarks.md, "qwen-fast against
stock qwen-tts".
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PointwiseConv(nn.Module):  # type: ignore[misc]  # torch is Any to mypy here
    """``Conv1d(c_in, c_out, 1)`` over ``(batch, c_in, time)`` as ``weight @ x + bias``."""

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.register_buffer("weight", conv.weight.detach()[:, :, 0].clone(), persistent=False)
        bias = conv.bias.detach() if conv.bias is not None else conv.weight.new_zeros(conv.out_channels)
        self.register_buffer("bias", bias[:, None].clone(), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self.weight, hidden).add_(self.bias)


class FoldedSnake(nn.Module):  # type: ignore[misc]
    """qwen-tts's ``SnakeBeta`` with its parameters' exponentials folded into buffers."""

    def __init__(self, snake: Any) -> None:
        super().__init__()
        alpha, beta = snake.alpha.detach(), snake.beta.detach()
        self.register_buffer("alpha", torch.exp(alpha)[None, :, None].clone(), persistent=False)
        self.register_buffer(
            "inverse_beta", (1.0 / (torch.exp(beta) + snake.no_div_by_zero))[None, :, None].clone(), persistent=False
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(hidden, torch.mul(hidden, self.alpha).sin_().square_(), self.inverse_beta)


def rewrite(decoder: nn.Module) -> int:
    """Swap the decoder's pointwise convolutions and SnakeBeta activations in place; how many were swapped.

    ``decoder`` is the codec's ``Qwen3TTSTokenizerV2Decoder`` (``speech_tokenizer.model.decoder``)."""
    from qwen_tts.core.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2 as codec

    swapped = 0
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            replacement: nn.Module | None = None
            if isinstance(child, codec.Qwen3TTSTokenizerV2CausalConvNet) and _pointwise(child.conv):
                replacement = PointwiseConv(child.conv)
            elif isinstance(child, codec.SnakeBeta):
                replacement = FoldedSnake(child)
            if replacement is not None:
                setattr(parent, name, replacement)  # a ModuleList takes its index as the name, too
                swapped += 1
    return swapped


def _pointwise(conv: nn.Conv1d) -> bool:
    # With kernel 1 and stride 1 the causal wrapper pads nothing: the convolution is the whole module.
    return bool(conv.kernel_size == (1,) and conv.stride == (1,) and conv.dilation == (1,) and conv.groups == 1)
