"""A test-only stock ``qwen`` engine whose device runs out of memory on cue.

The model call is the only thing replaced: for a batch larger than ``OOM_ABOVE`` it raises torch's
real ``OutOfMemoryError`` at the device boundary, the way a full GPU would, so that the batcher's
split-and-retry path runs on a CPU. Workers load it with ``TTSQ_ENGINE=faulty_qwen:OutOfMemoryQwen``
(``tests/`` on ``PYTHONPATH``); ``FAULTY_QWEN_OOM_ABOVE`` overrides the limit.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ttsq.engines.qwen.engine import QwenEngine

if TYPE_CHECKING:
    from ttsq.job import SynthesisRequest

OOM_ABOVE = 2


class OutOfMemoryQwen(QwenEngine):
    def _run_model(self, batch: list[SynthesisRequest], voices: list[Any], kwargs: dict[str, Any]) -> tuple[Any, int]:
        limit = int(os.environ.get("FAULTY_QWEN_OOM_ABOVE", OOM_ABOVE))
        if len(batch) > limit:
            raise self._torch.OutOfMemoryError(f"injected by the test engine for a batch of {len(batch)} > {limit}")
        return super()._run_model(batch, voices, kwargs)
