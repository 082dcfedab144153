"""Qwen3-TTS engine: its slot in the registry. The engine itself lands with the Qwen engine issue."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ttsq.errors import EngineUnavailable

if TYPE_CHECKING:
    from ttsq.config import Settings


class QwenEngine:
    """Placeholder that refuses to start, with a clear reason."""

    def __init__(self, settings: Settings) -> None:
        raise EngineUnavailable("the qwen engine is not part of this release yet; use TTSQ_ENGINE=espeak")
