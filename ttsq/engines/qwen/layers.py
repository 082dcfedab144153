"""The Qwen3-TTS layers as ttsq's decode loop runs them (``decode``): the same operations in the
same order as qwen-tts's modules, called as functions over a preallocated per-slot cache.

On a CPU the module calls of the tiny model cost more than its arithmetic; these functions take the
modules' weights and skip the calls, without changing a number (``tests/test_qwen_fast.py`` checks
the codes against stock qwen-tts token for token).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import SiLUActivation as _SILU

#: How many codebooks a frame has (the talker's one and the code predictor's 15).
CODE_GROUPS = 16


class SlotCache:
    """Static key and value buffers per layer: ``update`` writes the step's keys and values and hands
    back the prefix to attend over."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        self.keys = keys
        self.values = values
        self.rows = 0
        self.length = 0
        self.write_rows: torch.Tensor | None = None  # (rows,) slot index of each row
        self.write_positions: torch.Tensor | None = None  # (rows,) position each row writes
        self.write_at: int | None = None  # one position for every row (the code predictor)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer], self.values[layer]
        if self.write_at is not None:
            end = self.write_at + key.shape[2]
            keys[: self.rows, :, self.write_at : end] = key
            values[: self.rows, :, self.write_at : end] = value
        else:
            assert self.write_rows is not None and self.write_positions is not None
            keys[self.write_rows, :, self.write_positions] = key[:, :, 0]
            values[self.write_rows, :, self.write_positions] = value[:, :, 0]
        return keys[: self.rows, :, : self.length], values[: self.rows, :, : self.length]


def rms(hidden: torch.Tensor, norm: Any) -> torch.Tensor:
    """qwen-tts's RMSNorm, operation for operation (so the numbers are the same), without the module call
    (and without the two casts when the model is float32 already: they would return their input)."""
    dtype = hidden.dtype
    wide = dtype != torch.float32
    if wide:
        hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    result: torch.Tensor = norm.weight * (hidden.to(dtype) if wide else hidden)
    return result


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` with the sign of rotate_half folded into the sine table:
    (-a) * b and a * (-b) are the same float, and a roll is one operation where rotate_half is four."""
    return (x * cos) + (x.roll(x.shape[-1] // 2, dims=-1) * signed_sin)


def signed(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def decoder_layer(
    layer: Any,
    index: int,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: SlotCache,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One qwen-tts decoder layer (talker or code predictor), the same operations in the same order as
    its modules and Hugging Face's sdpa path, without a module call per linear: on a CPU the calls cost
    more than the arithmetic of the tiny model. ``sin`` has rotate_half's sign folded in (``signed``)."""
    attention = layer.self_attn
    x = rms(hidden, layer.input_layernorm)
    shape = (*hidden.shape[:-1], -1, attention.head_dim)
    query = rms(linear(x, attention.q_proj).view(shape), attention.q_norm).transpose(1, 2)
    key = rms(linear(x, attention.k_proj).view(shape), attention.k_norm).transpose(1, 2)
    value = linear(x, attention.v_proj).view(shape).transpose(1, 2)
    query = rotate(query, cos, sin)
    key = rotate(key, cos, sin)
    keys, values = cache.update(key, value, index)
    if mask is None:  # as Hugging Face calls sdpa without a mask: grouped heads, causal over a prefill
        out = F.scaled_dot_product_attention(
            query, keys, values, dropout_p=0.0, scale=attention.scaling, is_causal=query.shape[2] > 1, enable_gqa=True
        )
    else:  # with a mask it repeats the key and value heads first
        groups = attention.num_key_value_groups
        out = F.scaled_dot_product_attention(
            query,
            repeat_heads(keys, groups),
            repeat_heads(values, groups),
            attn_mask=mask,
            dropout_p=0.0,
            scale=attention.scaling,
            is_causal=False,
        )
    out = out.transpose(1, 2).contiguous().reshape(*hidden.shape[:-1], -1).contiguous()
    hidden = hidden + linear(out, attention.o_proj)
    mlp = layer.mlp
    x = rms(hidden, layer.post_attention_layernorm)
    gate = linear(x, mlp.gate_proj)
    gated = (F.silu(gate) if isinstance(mlp.act_fn, _SILU) else mlp.act_fn(gate)) * linear(x, mlp.up_proj)
    result: torch.Tensor = hidden + linear(gated, mlp.down_proj)
    return result


def linear(x: torch.Tensor, module: Any) -> torch.Tensor:
    """``module(x)`` without the module call for a plain ``Linear``; a quantized one
    (``quant.QuantizedLinear``) runs its own ``forward``."""
    if module.__class__ is torch.nn.Linear:
        return F.linear(x, module.weight, module.bias)
    result: torch.Tensor = module.forward(x)
    return result


def repeat_heads(states: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return states
    batch, heads, length, dim = states.shape
    return states[:, :, None].expand(batch, heads, groups, length, dim).reshape(batch, heads * groups, length, dim)


def talker_rope(
    rotary: Any, scaling: dict[str, Any], positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The talker's rotary cos and sin for every cache position, computed once by its own rotary module
    (all three multimodal position ids equal, as for text), then interleaved as qwen-tts does per step."""
    probe = torch.zeros(1, dtype=dtype, device=device)
    position_ids = torch.arange(positions, device=device).view(1, 1, -1).expand(3, 1, -1)
    tables = []
    for table in rotary(probe, position_ids):  # (3, 1, positions, dim)
        tables.append(mrope(table, scaling["mrope_section"], bool(scaling.get("interleaved")))[0])
    return tables[0], signed(tables[1])


def mrope(table: torch.Tensor, section: list[int], interleaved: bool) -> torch.Tensor:
    """``apply_multimodal_rotary_pos_emb``'s selection of channels from the three position grids."""
    if interleaved:
        dim = table.shape[-1]
        half = table[..., : dim // 2]
        picked = half[0].clone()
        count = len(section)
        for i, n in enumerate(section[1:], 1):
            picked[..., i : n * count : count] = half[i, ..., i : n * count : count]
        return torch.cat([picked] * 2, dim=-1)
    doubled = section * 2
    return torch.cat([m[i % 3] for i, m in enumerate(table.split(doubled, dim=-1))], dim=-1)


def predictor_rope(rotary: Any, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The code predictor's cos and sin for its 16 positions, shaped to broadcast over rows and heads."""
    probe = torch.zeros(1, dtype=dtype, device=device)
    cos, sin = rotary(probe, torch.arange(CODE_GROUPS, device=device).unsqueeze(0))  # (1, 16, dim)
    return cos.unsqueeze(1), signed(sin).unsqueeze(1)
