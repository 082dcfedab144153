"""Per-row sampling on the device for ttsq's Qwen3-TTS decode loop (``decode``).

Temperature, top-k and top-p as Hugging Face's warpers apply them, each row with its own settings,
then one draw per row as an exponential race over counter-based noise (``uniform``): a pure function
of (seed, counter, column), so a seeded row samples the same codes whatever rows share its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: Seeds and counters are hashed as 32-bit integers.
MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """How one row samples its talker code; the code predictor's settings are the loop's."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    seed: int = 0


@dataclass(frozen=True)
class SubSampling:
    """The code predictor's (sub-talker's) sampling settings, shared by every row."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0


def top_k_of(top_k: int, vocab: int) -> int:
    """How many candidates a top-k keeps: 0 (or less) means no top-k, as in Hugging Face's
    ``generate`` (``generation_config.json`` may say ``top_k: 0``); never more than the vocabulary."""
    return vocab if top_k <= 0 else min(top_k, vocab)


def sample(
    scores: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    counter: torch.Tensor,
    widest: int,
    nucleus: bool = True,
    ragged: bool = True,
) -> torch.Tensor:
    """Temperature, top-k and top-p as Hugging Face's warpers apply them, each row with its own values,
    then one draw per row. Only the ``widest`` best candidates are sorted (every row's top-k is at most
    that): sorting the whole vocabulary was most of a CPU frame."""
    scores = scores / temperature.unsqueeze(1)
    # Sorted (descending) only when a per-row cut or the nucleus needs the order.
    if ragged or nucleus:
        values, candidates = top(scores, widest)
    else:
        values, candidates = scores.topk(widest, dim=-1, sorted=False)
    if ragged:  # some row keeps fewer than ``widest``
        kth = values.gather(1, (top_k - 1).clamp(min=0, max=widest - 1).unsqueeze(1))
        values = values.masked_fill(values < kth, -math.inf)
    if nucleus:  # skipped when every row's top_p is 1 (it would remove nothing)
        ascending = values.flip(-1)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p).unsqueeze(1)
        remove[:, -1] = False  # keep at least one
        values = values.masked_fill(remove.flip(-1), -math.inf)
    # An exponential race: argmax of p / E with E ~ Exp(1) is a draw from p. The noise is keyed by the
    # vocabulary id, so the draw does not depend on how many candidates were kept.
    noise = -torch.log(uniform(seed, counter, candidates))
    chosen = (values.softmax(dim=-1) / noise).argmax(dim=-1, keepdim=True)
    return candidates.gather(1, chosen).squeeze(1)


def top(scores: torch.Tensor, k: int, group: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores.topk(k, sorted=True)`` (the same values; equal values may come in another order) in a
    fraction of its time on a CPU: a top-k element lies in one of the ``k`` groups of ``group``
    neighbours with the largest maxima (otherwise ``k`` larger maxima would beat it), so only those
    ``k * group`` scores are ranked. A CPU's top-k over the whole vocabulary was a third of a frame."""
    rows, vocab = scores.shape
    if vocab % group or vocab // group < k:
        values, indices = scores.topk(k, dim=-1, sorted=True)
        return values, indices
    maxima = scores.reshape(rows, vocab // group, group).amax(dim=-1)
    groups = maxima.topk(k, dim=-1, sorted=False).indices
    columns = (groups.unsqueeze(-1) * group + torch.arange(group, device=scores.device)).view(rows, k * group)
    values, where = scores.gather(1, columns).topk(k, dim=-1, sorted=True)
    return values, columns.gather(1, where)


def uniform(seed: torch.Tensor, counter: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """Uniform (0, 1) noise, a pure function of (seed, counter, column): a row draws the same numbers
    whatever else is in its batch. 32-bit integer hashing in int64, kept below 2**63 at every step."""
    x = (((seed.unsqueeze(1) * 0x61C88647) & MASK32) + ((counter.unsqueeze(1) * 0x2545F491) & MASK32) + column) & MASK32
    for multiplier in (0x7FEB352D, 0x5BD1E995):
        x = x ^ (x >> 16)
        x = (x * multiplier) & MASK32
    x = x ^ (x >> 15)
    return ((x >> 8).float() + 0.5) / float(1 << 24)
