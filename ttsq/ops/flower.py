"""``ttsq flower``: Flower on the same settings as the workers, with basic auth unless told otherwise.

Flower builds its task list from the workers' events (``worker_send_task_events``), so every job
appears with its state, runtime and worker. What it shows of the arguments is what the workers put
in their events: ``ttsq.redaction.RedactedRequest`` replaces the kwargs with field names and sizes, and
the result's presigned URL with ``<url>``. ``format_task`` below also trims what Flower's HTML pages
show, for events from producers outside ttsq (a raw ``send_task`` with ``task_send_sent_event`` on).

Flower's ``/metrics`` and ``/healthcheck`` are not behind its auth: keep its port on an internal
network. Its API is off without auth unless ``FLOWER_UNAUTHENTICATED_API=true``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ttsq.errors import ConfigError, EngineUnavailable
from ttsq.redaction import redact_result

if TYPE_CHECKING:
    from ttsq.config import Settings

#: Longest argument repr Flower's pages show; longer ones are cut (a preview at most).
PREVIEW_CHARS = 60


def format_task(task: Any) -> Any:
    """Flower's ``format_task`` hook: short argument previews, no URL in the result."""
    for name in ("args", "kwargs"):
        value = getattr(task, name, None)
        if isinstance(value, str) and len(value) > PREVIEW_CHARS:
            setattr(task, name, value[:PREVIEW_CHARS] + "…")
    result = getattr(task, "result", None)
    if isinstance(result, str):
        task.result = redact_result(result)
    return task


def run_flower(
    settings: Settings, *, address: str, port: int, basic_auth: str | None, no_auth: bool, extra: tuple[str, ...] = ()
) -> int:
    """Run Flower in this process until SIGTERM; return its exit code."""
    try:
        import flower.options
    except ImportError:
        raise EngineUnavailable("Flower is not installed: pip install 'ttsq[flower]'") from None
    from ttsq.app import make_app

    if basic_auth is None and not no_auth:
        raise ConfigError(
            "FLOWER_BASIC_AUTH",
            "set user:password (or pass --no-auth to run Flower without authentication, on a trusted network only)",
        )
    if basic_auth is not None:
        if ":" not in basic_auth or basic_auth.startswith(":") or basic_auth.endswith(":"):
            raise ConfigError("FLOWER_BASIC_AUTH", "expected user:password")
        # Through the environment, not argv: a command line is visible to every user of the host.
        os.environ["FLOWER_BASIC_AUTH"] = basic_auth
    flower.options.options.format_task = format_task
    app = make_app(settings)
    argv = [
        "flower",
        f"--address={address}",
        f"--port={port}",
        # Flower keeps every task in memory: bound it, and forget workers gone for ten minutes.
        "--max_tasks=10000",
        "--purge_offline_workers=600",
        *extra,
    ]
    code = app.start(argv=argv)
    return int(code or 0)
