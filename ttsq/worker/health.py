"""A worker's health, as an orchestrator asks for it: alive, and ready for work.

The worker serves both on its metrics port, beside ``/metrics``, so a probe needs no second port:

- ``GET /livez`` (also ``/healthz``): 200 while the process is worth keeping: its engine is loading,
  or its batcher thread runs and no engine call has passed the per-batch limit. 503 when one has, or
  the batcher thread has died: only a new process cures either (the watchdog ends this one moments
  later; the probe says so to a supervisor that asks first). Redis has no say here: a worker rides
  out a Redis outage, and restarting it would only drop the jobs it holds.
- ``GET /readyz``: 200 once the engine is loaded and warm, Redis answers a PING, the object store
  answers (looked at again every few seconds, ``Recheck``), the worker's model is the one its queue
  serves, and the worker is not draining for a shutdown; 503 otherwise. The body names each check.

Bodies are small JSON objects; nothing in them comes from a request.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

logger = logging.getLogger(__name__)

LIVE_PATHS = ("/livez", "/healthz")
READY_PATH = "/readyz"


@dataclass(frozen=True)
class Health:
    """What the worker says of itself at one moment."""

    #: Why the process must be replaced, or None while it is alive.
    dead: str | None = None
    #: Each readiness check by name (``engine``, ``redis``, ``storage``, ``fleet``, ``accepting``): True when it passes.
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def live(self) -> bool:
        return self.dead is None

    @property
    def ready(self) -> bool:
        return self.live and bool(self.checks) and all(self.checks.values())


class Recheck:
    """A readiness check that costs a round trip (the object store's): run at most every ``every_s``
    seconds and by one probe at a time; the probes in between, and those that find it under way, get
    the last answer at once. It passes when ``check`` returns, and fails when it raises."""

    def __init__(self, name: str, check: Callable[[], object], *, every_s: float) -> None:
        self.name = name
        self.every_s = every_s
        self._check = check
        self._lock = threading.Lock()
        self._ok = False
        self._checked_at = -math.inf

    def __call__(self) -> bool:
        if time.monotonic() - self._checked_at >= self.every_s and self._lock.acquire(blocking=False):
            try:
                if time.monotonic() - self._checked_at >= self.every_s:  # not just done by another probe
                    self._run()
            finally:
                self._lock.release()
        return self._ok

    def _run(self) -> None:
        try:
            self._check()
            ok, why = True, ""
        except Exception as exc:
            ok, why = False, str(exc)
        first = self._checked_at == -math.inf
        # Said once per change, not at every probe.
        if not ok and (first or self._ok):
            logger.warning("%s unreachable, not ready: %s", self.name, why)
        elif ok and not first and not self._ok:
            logger.info("%s reachable again", self.name)
        self._ok, self._checked_at = ok, time.monotonic()


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
