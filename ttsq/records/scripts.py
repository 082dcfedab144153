"""ttsq's Lua scripts: one file each under ``lua/``, read from the package, registered on a client by name.

A registered script (redis-py's ``Script``) runs by its SHA1 (``EVALSHA``) and, when Redis answers
``NOSCRIPT`` (a restart, a failover, ``SCRIPT FLUSH``), loads its source and runs again: registering
costs no round trip, and a flushed script cache costs one ``SCRIPT LOAD``.
"""

from __future__ import annotations

import functools
from importlib.resources import files
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import redis
    from redis import asyncio as aioredis
    from redis.commands.core import AsyncScript, Script


@functools.cache
def source(name: str) -> str:
    """The text of the script ``lua/<name>.lua``."""
    return files("ttsq.records").joinpath("lua", f"{name}.lua").read_text(encoding="utf-8")


def names() -> list[str]:
    """Every script ttsq ships, by name."""
    folder = files("ttsq.records").joinpath("lua")
    return sorted(entry.name.removesuffix(".lua") for entry in folder.iterdir() if entry.name.endswith(".lua"))


def register(client: redis.Redis, name: str) -> Script:
    """The script ``name`` on ``client``; call it with ``keys=`` and ``args=``."""
    return client.register_script(source(name))


def register_async(client: aioredis.Redis, name: str) -> AsyncScript:
    """The script ``name`` on an async ``client``; await it with ``keys=`` and ``args=``."""
    return client.register_script(source(name))
