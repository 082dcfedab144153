"""A test-only engine that does not time its own words, as Qwen3-TTS does not: espeak with its word
events dropped, so the worker's aligner (``TTSQ_ALIGNER``, Whisper) finds them. Workers run it with
``TTSQ_ENGINE=wordless_engine:WordlessEngine`` (``tests/`` on ``PYTHONPATH``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ttsq.engines.base import EngineOutput, Piece
from ttsq.engines.espeak import EspeakEngine

if TYPE_CHECKING:
    from ttsq.job import SynthesisRequest


class WordlessEngine(EspeakEngine):
    """espeak under another engine name (its own content keys), its outputs without words."""

    def load(self) -> None:
        super().load()
        self.identity = dataclasses.replace(self.identity, engine="wordless")

    def synthesize_batch(
        self, requests: Sequence[SynthesisRequest], pieces: Sequence[Piece | None] | None = None
    ) -> list[EngineOutput | Exception]:
        return [
            dataclasses.replace(output, words=None) if isinstance(output, EngineOutput) else output
            for output in super().synthesize_batch(requests, pieces)
        ]
