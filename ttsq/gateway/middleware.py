"""The gateway's two ASGI middlewares, plain ASGI so that they cost a request almost nothing: ``Observe``
counts, times and traces every request (and breaks off a speech stream that failed after its audio
began), and ``BodyLimit`` refuses a body over the limit before it is read whole."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING

import ttsq.tracing as tracing
from ttsq.gateway.errors import ApiError, Interrupted

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge, Histogram
    from starlette.requests import Request
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)


class Observe:
    """Count and time every request by its route template (never its ids) and status: plain ASGI, so it
    costs a request no more than the two clock reads. With traces on, each request is a server span
    (``ttsq.tracing``) that continues a ``traceparent`` the caller sent, and everything the request
    submits (on the gateway's threads: anyio carries the context there) nests under it."""

    def __init__(self, app: ASGIApp, *, in_flight: Gauge, requests: Counter, latency: Histogram) -> None:
        self.app, self.in_flight, self.requests, self.latency = app, in_flight, requests, latency

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started, began = time.perf_counter(), False
        status: int | str = 500

        async def sending(message: Message) -> None:
            nonlocal status, began
            if message["type"] == "http.response.start":
                status, began = message["status"], True
            await send(message)

        scope.setdefault("state", {})[ARRIVED] = started
        self.in_flight.inc()
        method = scope.get("method", "")
        with (
            tracing.span(method, {"http.request.method": method}, kind="server", parent=_caller_trace(scope))
            if scope.get("path") not in UNTRACED
            else contextlib.nullcontext(tracing.Handle())
        ) as traced:
            try:
                await self.app(scope, receive, sending)
            except Interrupted as exc:
                if not began:
                    raise
                # The body already began with a 200: return without its last chunk, so that the server
                # closes the connection and the client sees a broken transfer, not a short answer that
                # looks complete.
                logger.warning("speech stream broken off: %s", exc.message)
                status = "broken"
                traced.error("speech stream broken off")
            finally:
                self.in_flight.dec()
                route = getattr(scope.get("route"), "path", "unmatched")
                self.requests.labels(route=route, status=str(status)).inc()
                self.latency.labels(route=route).observe(time.perf_counter() - started)
                traced.rename(f"{method} {route}")
                code = status if isinstance(status, int) else None
                traced.set({"http.route": route, "http.response.status_code": code})
                if code is not None and code >= 500:
                    traced.error(f"HTTP {code}")


def _caller_trace(scope: Scope) -> object:
    """The trace a caller's ``traceparent`` header continues (None: none, or traces off)."""
    if not tracing.enabled():
        return None
    wanted = {name.encode("latin-1") for name in tracing.PROPAGATED}
    headers = scope.get("headers") or []
    return tracing.extract({k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in wanted})


#: Probes and scrapes: counted, never traced (one every few seconds would bury the requests).
UNTRACED = frozenset({"/healthz", "/readyz", "/metrics"})

#: Where ``Observe`` notes a request's arrival (``time.perf_counter``) in its scope's state.
ARRIVED = "ttsq_arrived"


def arrival(request: Request) -> float:
    """When the request arrived (``time.perf_counter``), as ``Observe`` noted it."""
    return float(getattr(request.state, ARRIVED, time.perf_counter()))


class BodyLimit:
    """Refuse a request body over the limit (413) before it is read whole: by its Content-Length when it
    has one, else as soon as the bytes read pass the limit."""

    def __init__(self, app: ASGIApp, *, default: int, larger: dict[str, int], on_refuse: Counter) -> None:
        self.app, self.default, self.larger, self.on_refuse = app, default, larger, on_refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = next((size for path, size in self.larger.items() if scope["path"].startswith(path)), self.default)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            await self._refuse(scope, receive, send, limit)
            return
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise TooLarge
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except TooLarge:
            if not started:
                await self._refuse(scope, receive, send, limit)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        self.on_refuse.labels(cause="too_large").inc()
        response = ApiError(
            413, f"the request body is larger than {limit} bytes", param="body", code="request_too_large"
        )
        await response.response()(scope, receive, send)


class TooLarge(Exception):
    """The body read so far is over the limit."""
