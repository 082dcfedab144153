"""A worker's health, as an orchestrator asks for it: alive, and ready for work.

The worker serves both on its metrics port, beside ``/metrics``, so a probe needs no second port:

- ``GET /livez`` (also ``/healthz``): 200 while the process is worth keeping: its engine is loading,
  or its batcher thread runs and no engine call has passed the per-batch limit. 503 when one has, or
  the batcher thread has died: only a new process cures either (the watchdog ends this one moments
  later; the probe says so to a supervisor that asks first). Redis has no say here: a worker rides
  out a Redis outage, and restarting it would only drop the jobs it holds.
- ``GET /readyz``: 200 once the engine is loaded and warm, Redis answers a PING, and the worker is
  not draining for a shutdown; 503 otherwise. The body names each check.

Bodies are small JSON objects; nothing in them comes from a request.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

LIVE_PATHS = ("/livez", "/healthz")
READY_PATH = "/readyz"


@dataclass(frozen=True)
class Health:
    """What the worker says of itself at one moment."""

    #: Why the process must be replaced, or None while it is alive.
    dead: str | None = None
    #: Each readiness check by name (``engine``, ``redis``, ``accepting``): True when it passes.
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.dead is None

    @property
    def ready(self) -> bool:
        return self.live and bool(self.checks) and all(self.checks.values())


def with_health(app: WSGIApplication, probe: Callable[[], Health]) -> WSGIApplication:
    """``app`` (the metrics exposition) with the two probe paths in front of it."""

    def serve(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path not in LIVE_PATHS and path != READY_PATH:
            return app(environ, start_response)
        try:
            health = probe()
        except Exception as exc:  # a probe that cannot look is a probe that fails
            health = Health(dead=f"health check failed: {type(exc).__name__}")
        body: dict[str, Any]
        if path == READY_PATH:
            ok, body = health.ready, {"ready": health.ready, "checks": health.checks}
        else:
            ok, body = health.live, {"live": health.live}
        if health.dead is not None:
            body["reason"] = health.dead
        payload = json.dumps(body).encode()
        status = "200 OK" if ok else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json"), ("Content-Length", str(len(payload)))])
        return [payload]

    return serve
