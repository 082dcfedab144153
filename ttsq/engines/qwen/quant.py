"""Quantized weights for the Qwen3-TTS decoder layers (``TTSQ_QWEN_QUANT``), for both qwen engines.

``quantize`` swaps the decoder layers' linear modules in place for int8 or fp8 ones, with activations
scaled per row so that a row's result never depends on the rows beside it, and reports the weight memory
before and after. The decode loop (``layers.linear``) calls a swapped module's ``forward``; stock qwen-tts
calls it as a module. What is quantized, and why so: docs/qwen.md, "Quantized weights".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

KINDS = ("int8", "fp8")
#: The decoder layers' linear modules that are quantized, by attribute name.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_INT8_MAX = 127.0
_FP8_MAX = 448.0  # the largest finite float8 e4m3fn
# CUDA's int8 matrix multiply takes more than 16 rows; a decode step has as few as one.
_CUDA_INT_MM_ROWS = 32
# _scaled_mm wants the rows in multiples of 16.
_SCALED_MM_ROW_MULTIPLE = 16


@dataclass(frozen=True)
class QuantReport:
    """What ``quantize`` did: how many linear layers, and their weight bytes before and after."""

    kind: str
    layers: int
    bytes_before: int
    bytes_after: int
    kernel: str

    @property
    def saved(self) -> int:
        return self.bytes_before - self.bytes_after


class QuantizedLinear(torch.nn.Module):  # type: ignore[misc]  # torch is Any to mypy here
    """A linear layer with int8 or fp8 weights, per-output-channel scales, per-row activation scales."""

    def __init__(self, linear: torch.nn.Linear, kind: str) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown quantization {kind!r}; expected one of {', '.join(KINDS)}")
        weight = linear.weight.detach().float()
        self.kind = kind
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.out_dtype = linear.weight.dtype
        limit = _INT8_MAX if kind == "int8" else _FP8_MAX
        scale = weight.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / limit  # (out, 1)
        scaled = weight / scale
        if kind == "int8":
            qweight = scaled.round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
        else:
            qweight = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.view(1, -1).contiguous())  # (1, out), float32
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        #: ``native`` (int matmul or _scaled_mm) or ``widened`` (weights dequantized per product).
        self.kernel = "native"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float()
        count = rows.shape[0]
        limit = _INT8_MAX if self.kind == "int8" else _FP8_MAX
        row_scale = rows.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / limit  # (rows, 1)
        scaled = rows / row_scale
        if self.kind == "int8":
            if self.kernel == "native":
                quantized = scaled.round().clamp(-_INT8_MAX, _INT8_MAX).to(torch.int8)
                if quantized.is_cuda and count <= 16:
                    quantized = F.pad(quantized, (0, 0, 0, _CUDA_INT_MM_ROWS - count))
                accumulated = torch._int_mm(quantized, self.qweight.t())[:count]
                out = accumulated.float() * row_scale * self.scale
            else:
                widened = scaled.round().clamp(-_INT8_MAX, _INT8_MAX) * row_scale
                out = F.linear(widened, self.qweight.float() * self.scale.t())
        else:
            quantized8 = scaled.clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
            if self.kernel == "native":
                padded = -count % _SCALED_MM_ROW_MULTIPLE
                if padded:
                    quantized8 = F.pad(quantized8.view(torch.uint8), (0, 0, 0, padded)).view(torch.float8_e4m3fn)
                    row_scale = F.pad(row_scale, (0, 0, 0, padded), value=1.0)
                out = torch._scaled_mm(
                    quantized8,
                    self.qweight.t(),
                    scale_a=row_scale,
                    scale_b=self.scale,
                    out_dtype=torch.float32,
                )[:count]
            else:
                out = F.linear(quantized8.float() * row_scale, self.qweight.float() * self.scale.t())
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(self.out_dtype).view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.kind}, kernel={self.kernel}"


def quantize(model: Any, kind: str) -> QuantReport:
    """Swap the talker's and the code predictor's decoder-layer linears for ``QuantizedLinear``, in place."""
    before = after = layers = 0
    swapped: list[QuantizedLinear] = []
    talker = model.talker
    for decoder in (talker.model.layers, talker.code_predictor.model.layers):
        for layer in decoder:
            for owner in (layer.self_attn, layer.mlp):
                for name in TARGETS:
                    linear = getattr(owner, name, None)
                    if not isinstance(linear, torch.nn.Linear):
                        continue
                    quantized = QuantizedLinear(linear, kind)
                    before += linear.weight.numel() * linear.weight.element_size()
                    after += quantized.qweight.numel() * quantized.qweight.element_size()
                    after += quantized.scale.numel() * quantized.scale.element_size()
                    setattr(owner, name, quantized)
                    swapped.append(quantized)
                    layers += 1
    kernel = _choose_kernel(swapped)
    report = QuantReport(kind=kind, layers=layers, bytes_before=before, bytes_after=after, kernel=kernel)
    logger.info(
        "%s weights for %d decoder linears (%s kernel): %.1f MB -> %.1f MB, %.1f MB saved",
        kind,
        layers,
        kernel,
        before / 1e6,
        after / 1e6,
        report.saved / 1e6,
    )
    return report


def _choose_kernel(swapped: list[QuantizedLinear]) -> str:
    """Try the native kernel on one layer; where the device refuses it, every layer widens instead."""
    if not swapped:
        return "native"
    probe = swapped[0]
    if probe.kind == "fp8" and probe.qweight.device.type != "cuda":
        kernel = "widened"  # no fp8 matrix multiply on a CPU
    else:
        x = torch.zeros(1, probe.in_features, device=probe.qweight.device, dtype=probe.out_dtype)
        try:
            with torch.inference_mode():
                probe(x)
            kernel = "native"
        except RuntimeError as exc:
            logger.warning("%s: the native kernel refused (%s); weights are widened per product", probe.kind, exc)
            kernel = "widened"
    for module in swapped:
        module.kernel = kernel
    return kernel
