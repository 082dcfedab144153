"""The HTTP gateway's application, assembled: ``create_gateway(settings)`` is what ``ttsq serve`` runs
(on uvicorn), or what any ASGI server can serve."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI

import ttsq.tracing as tracing
from ttsq.constants import VERSION
from ttsq.gateway.playground import playground_router
from ttsq.gateway.routes import router
from ttsq.gateway.state import Gateway, install

if TYPE_CHECKING:
    from ttsq.config import Settings

#: Threads a gateway process submits on at once (anyio's default is 40).
SUBMIT_THREADS = 128
#: How long an idle client connection is kept open (seconds). uvicorn's default, 5 s, is also httpx's
#: (and so the OpenAI SDK's) pool expiry: a client reusing its connection as the server closes it gets
#: "Server disconnected without sending a response" on a request never sent. Longer than a load
#: balancer's idle timeout too (AWS's ALB: 60 s), as those ask of the servers behind them.
KEEP_ALIVE_S = 75


def create_gateway(settings: Settings) -> FastAPI:
    """The gateway application for these settings."""
    tracing.setup("ttsq-gateway")  # before the gateway's Client: OTEL_* decides (docs/observability.md)
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Submits run on threads (the Client is synchronous: a few Redis round trips each); waits do not.
        anyio.to_thread.current_default_thread_limiter().total_tokens = SUBMIT_THREADS
        yield
        await gateway.close()
        tracing.flush()  # the last requests' spans, before the process ends

    app = FastAPI(
        title="ttsq",
        version=VERSION,
        lifespan=lifespan,
        description="Text to speech on a Celery fleet: OpenAI's speech API, a jobs API, voices.",
        **_without_native_telemetry(),
    )
    install(app, gateway)
    app.include_router(router)
    app.include_router(playground_router(settings))
    return app


def _without_native_telemetry() -> dict[str, Any]:
    """FastAPI's own OpenTelemetry support (newer releases turn it on whenever a tracer provider is set)
    would open a second server span around the one ``ttsq.gateway.middleware.Observe`` opens, and may
    log validation errors with their input values: the gateway's request span is ttsq's, on every
    FastAPI release, and no request text leaves through telemetry."""
    if "telemetry" not in inspect.signature(FastAPI).parameters:
        return {}
    return {"telemetry": {"tracing": False, "logs": False}}
