"""The HTTP gateway's application, assembled: ``create_gateway(settings)`` is what ``ttsq serve`` runs
(on uvicorn), or what any ASGI server can serve."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import anyio
from fastapi import FastAPI

from ttsq.constants import VERSION
from ttsq.gateway.routes import router
from ttsq.gateway.state import Gateway, install

if TYPE_CHECKING:
    from ttsq.config import Settings

#: Threads a gateway process submits on at once (anyio's default is 40).
SUBMIT_THREADS = 128


def create_gateway(settings: Settings) -> FastAPI:
    """The gateway application for these settings."""
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Submits run on threads (the Client is synchronous: a few Redis round trips each); waits do not.
        anyio.to_thread.current_default_thread_limiter().total_tokens = SUBMIT_THREADS
        yield
        await gateway.close()

    app = FastAPI(
        title="ttsq",
        version=VERSION,
        lifespan=lifespan,
        description="Text to speech on a Celery fleet: OpenAI's speech API, a jobs API, voices.",
    )
    install(app, gateway)
    app.include_router(router)
    return app
