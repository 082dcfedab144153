"""Engines by name. Each entry is imported only when chosen, so heavy dependencies (torch,
transformers, qwen_tts) load in the worker that uses them and nowhere else."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ttsq.errors import ConfigError, EngineUnavailable

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.engines.base import Engine

#: name -> "module:factory". A new engine is one line here and one module beside this file.
REGISTRY: dict[str, str] = {
    "espeak": "ttsq.engines.espeak:EspeakEngine",
    "qwen": "ttsq.engines.qwen:QwenEngine",
}


def create_engine(settings: Settings) -> Engine:
    """Build (but do not load) the engine named by ``TTSQ_ENGINE``."""
    try:
        target = REGISTRY[settings.engine]
    except KeyError:
        raise ConfigError("TTSQ_ENGINE", f"unknown engine {settings.engine!r}; "
                          f"expected one of {', '.join(sorted(REGISTRY))}") from None
    module_name, factory_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineUnavailable(f"engine {settings.engine!r} cannot be imported ({exc}); "
                                f"install it with: pip install 'ttsq[{settings.engine}]'") from exc
    engine: Engine = getattr(module, factory_name)(settings)
    return engine
