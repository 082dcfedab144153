"""The 12 Hz codec's decoder as ``qwen-fast`` runs it: qwen-tts's network, with two kinds of its modules
swapped for equivalent ones that cost less. The ``qwen`` engine keeps the stock modules: it is the
reference the fast engine is measured and tested against.

- **Pointwise convolutions** (kernel 1, stride 1: the second convolution of every residual unit) become
  one matrix product over the channels. oneDNN, which runs ``conv1d`` on a CPU, lays activations out in
  blocks of 8 or 16 channels; the last upsampling stages have few channels at 24 kHz (2 and 4 on the
  tiny checkpoint, 96 and 192 on the full size), so it spends its time reordering padding. Measured on 2
  cores, 16 rows x 48 frames: one such convolution 83 ms as ``conv1d``, 1.3 ms as a product (tiny);
  23.6 against 22.1 ms at 96 channels (full size). The wider convolutions stay oneDNN's, which is faster
  for them.
- **SnakeBeta** (``x + sin(x exp(a))^2 / (exp(b) + eps)``) takes ``exp(a)`` and ``1 / (exp(b) + eps)``
  from buffers computed once here instead of on every call, in three passes over its input instead of
  five.

The numbers are the stock decoder's up to float rounding (``tests/test_qwen_codec.py``: within 1e-5 of
full scale, under a third of one 16-bit PCM step, on the tiny and the full-size architecture), so the
swap is not part of the engine's identity. ``benchmarks/qwen_fast.py`` times both decoders side by side.
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
