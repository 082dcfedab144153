"""A test-only ``qwen-fast`` engine that fails on cue, at the boundaries where a real device would.

The decode loop, the engine's bookkeeping and the batcher stay the real ones; only the points a fault
comes from are replaced, each keyed by a request's temperature (a field no other test uses this way):

- ``ADMIT`` (0.11): choosing the row's first code fails, after the row took its slot (a device fault
  in the prefill's sampling);
- ``FRAME`` (0.22): every frame fails while the row is in the loop (a kernel fault);
- ``CODEC`` (0.33): the codec decode of any set of rows holding this one fails;
- ``SLOW_CODEC`` (0.44): the codec decode of a set holding this row takes ``SLOW_S`` longer;
- ``DIE`` (0.55): a frame raises ``Dying`` (not an ``Exception``), as an interrupt would, ending the
  batcher's loop; ``DIE_ADMITTING`` (0.66): the row's admission does.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ttsq.engines.qwen.decode import DecodeLoop, Prompt
from ttsq.engines.qwen.fast import QwenFastEngine
from ttsq.engines.qwen.sampling import Sampling

ADMIT, FRAME, CODEC, SLOW_CODEC, DIE, DIE_ADMITTING = 0.11, 0.22, 0.33, 0.44, 0.55, 0.66
SLOW_S = 1.5


class Dying(BaseException):
    """What ends a thread that ``except Exception`` does not catch."""


class FaultyLoop(DecodeLoop):
    def admit(self, prompt: Prompt, *, cap: int, sampling: Sampling, tag: Any = None) -> int:
        self._admitting = sampling.temperature
        return super().admit(prompt, cap=cap, sampling=sampling, tag=tag)

    def _choose(self, logits: torch.Tensor, slots: torch.Tensor, *, generated: torch.Tensor | int) -> torch.Tensor:
        if isinstance(generated, int) and abs(self._admitting - ADMIT) < 1e-6:
            raise RuntimeError("injected: the first code could not be chosen")
        if isinstance(generated, int) and abs(self._admitting - DIE_ADMITTING) < 1e-6:
            raise Dying()
        return super()._choose(logits, slots, generated=generated)

    def _frame(self, rows: int, length: int) -> None:
        temperatures = [float(t) for t in self._temperature[sorted(self._rows)].tolist()]
        if any(abs(t - FRAME) < 1e-6 for t in temperatures):
            raise RuntimeError("injected: the frame failed")
        if any(abs(t - DIE) < 1e-6 for t in temperatures):
            raise Dying()
        super()._frame(rows, length)


class FaultyFastEngine(QwenFastEngine):
    def load(self) -> None:
        super().load()
        loop = self.loop
        assert loop is not None
        self.loop = FaultyLoop(
            loop.model, slots=loop.slots, positions=loop.positions, max_frames=loop.max_frames, sub=loop.sub
        )

    def _decode_rows(self, rows: list[Any]) -> list[Any]:
        temperatures = [request.temperature for _, request, _, _, _ in rows]
        if CODEC in temperatures:
            raise RuntimeError("injected: the codec failed")
        if SLOW_CODEC in temperatures:
            time.sleep(SLOW_S)
        return super()._decode_rows(rows)
