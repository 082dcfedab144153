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
    "qwen": "ttsq.engines.qwen.engine:QwenEngine",
    "qwen-fast": "ttsq.engines.qwen.fast:QwenFastEngine",
    # A GPU's batch cost with nothing computed, for benchmarks of the machinery (ttsq.testing).
    "standin": "ttsq.testing.standin:StandInEngine",
}


def create_engine(settings: Settings) -> Engine:
    """Build (but do not load) the engine named by ``TTSQ_ENGINE``.

    The name is a registry entry, or ``package.module:Factory`` for an engine that lives outside
    ttsq (a site's own model, or a test engine): the factory is called with the settings.
    """
    target = REGISTRY.get(settings.engine)
    if target is None and _is_import_path(settings.engine):
        target = settings.engine
    if target is None:
        raise ConfigError(
            "TTSQ_ENGINE",
            f"unknown engine {settings.engine!r}; expected one of "
            f"{', '.join(sorted(REGISTRY))}, or package.module:Factory",
        )
    module_name, factory_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = (
            f"install it with: pip install 'ttsq[{settings.engine.split('-')[0]}]'"
            if settings.engine in REGISTRY
            else f"is {module_name} on PYTHONPATH?"
        )
        raise EngineUnavailable(f"engine {settings.engine!r} cannot be imported ({exc}); {hint}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError("TTSQ_ENGINE", f"{module_name} has no factory named {factory_name!r}")
    engine: Engine = factory(settings)
    return engine


def _is_import_path(name: str) -> bool:
    module, _, factory = name.partition(":")
    return bool(module) and bool(factory) and all(part.isidentifier() for part in (*module.split("."), factory))
