"""ttsq's overrides of Celery, kombu and redis-py, fenced: a test fails when the library code under one changes.

ttsq subclasses kombu's Redis transport (the envelope gate, ``HeldQoS``), Celery's consumer and backends,
and redis-py's Sentinel connections, overriding some of their methods, a few of them private and copied from
the library; ``ttsq.delivery.broker`` writes down kombu's key layout. A version range in ``pyproject.toml``
lets pip install a release whose methods differ, and nothing else would notice: an override copied from
the old code then quietly undoes the new.

This test finds every method a ttsq class defines over one of a library's (walking the classes of ttsq's
modules, so a new override is found too) and every method ttsq patches onto a live channel, and compares a
hash of the library's source of each with the one recorded in ``tests/data/overrides.json`` when the
override was last reviewed. After reviewing ttsq's override against the library's new code, record it
again: ``.venv/bin/python tests/test_fence.py --update``.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import sys
from pathlib import Path
from typing import Any

RECORD = Path(__file__).parent / "data" / "overrides.json"
#: The modules whose classes stand on the libraries' (the qwen engines subclass torch's, which is not fenced).
MODULES = (
    "ttsq.app",
    "ttsq.delivery.connection",
    "ttsq.delivery.transport",
    "ttsq.records.connection",
    "ttsq.records.owner",
)
LIBRARIES = ("celery", "kombu", "redis")
#: Methods ttsq sets on a live kombu channel instead of overriding them (``ttsq.delivery.transport``).
PATCHED = ("kombu.transport.virtual.base.Channel.basic_ack", "kombu.transport.virtual.base.Channel.basic_reject")


def _digest(function: Any) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]


def _resolve(dotted: str) -> Any:
    module_name, _, rest = dotted.rpartition(".")
    parts = [module_name, rest]
    while True:  # the longest importable prefix is the module; the rest are attributes
        try:
            found: Any = importlib.import_module(parts[0])
            break
        except ImportError:
            head, _, tail = parts[0].rpartition(".")
            parts = [head, f"{tail}.{parts[1]}"]
    for name in parts[1].split("."):
        found = getattr(found, name)
    return found


def overrides() -> dict[str, str]:
    """``library.module.Class.method`` -> hash of its source, for every library method ttsq overrides or patches."""
    found: dict[str, str] = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for cls in vars(module).values():
            if not inspect.isclass(cls) or cls.__module__ != module_name:
                continue
            for name, member in vars(cls).items():
                if not (inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod, property))):
                    continue
                for base in cls.__mro__[1:]:
                    if base.__module__.split(".")[0] not in LIBRARIES or name not in vars(base):
                        continue
                    original = vars(base)[name]
                    original = getattr(original, "__func__", None) or getattr(original, "fget", None) or original
                    if inspect.isfunction(original):
                        found[f"{base.__module__}.{base.__qualname__}.{name}"] = _digest(original)
                    break
    for dotted in PATCHED:
        found[dotted] = _digest(_resolve(dotted))
    return dict(sorted(found.items()))


def test_every_library_method_ttsq_overrides_is_the_code_it_was_reviewed_against() -> None:
    recorded: dict[str, str] = json.loads(RECORD.read_text())
    current = overrides()
    new = sorted(set(current) - set(recorded))
    gone = sorted(set(recorded) - set(current))
    changed = sorted(name for name in set(current) & set(recorded) if current[name] != recorded[name])
    how = "review ttsq's override against the library's code, then: .venv/bin/python tests/test_fence.py --update"
    assert not new, f"ttsq overrides library methods not yet reviewed: {new}; {how}"
    assert not gone, f"overrides recorded but no longer made (or the library renamed them): {gone}; {how}"
    assert not changed, f"the installed library's code under these overrides changed: {changed}; {how}"


def test_the_key_layout_ttsq_reads_is_kombus() -> None:
    """``ttsq.delivery.broker`` reads kombu's lists, priority lists and unacked hashes by name (the hashes'
    names are in ``ttsq.constants``: ``ttsq.records.holders`` writes them too)."""
    from kombu.transport import redis as kombu_redis

    from ttsq import constants
    from ttsq.delivery import broker

    channel = kombu_redis.Channel
    assert channel.unacked_key == constants.UNACKED_KEY
    assert channel.unacked_index_key == constants.UNACKED_INDEX_KEY
    assert channel.sep == broker._PRIORITY_SEP
    assert tuple(step for step in kombu_redis.PRIORITY_STEPS if step) == broker._PRIORITY_STEPS


if __name__ == "__main__" and sys.argv[1:] == ["--update"]:
    RECORD.write_text(json.dumps(overrides(), indent=2) + "\n")
    print(f"recorded {len(overrides())} overrides in {RECORD}")
