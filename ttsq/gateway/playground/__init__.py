"""``/playground``: a page on the gateway where a person hears the fleet (docs/gateway.md, "The playground").

One static page, its scripts (player.js: Web Audio; app.js: the page) and its style, shipped in the package
beside this module (no build step, no CDN, no outside font) and served as they are. The page speaks to the
gateway it came from and nowhere else: its Content-Security-Policy allows only this origin (``blob:`` beside
it for the audio it downloads), and it calls the API with the key the person types
(``TTSQ_GATEWAY_AUTH=none``: no key). What the page needs to know of this gateway's settings, and nothing
secret, is ``/playground/config.json``.

The page's routes need no key (the page holds none; the API it calls checks the key as always) and are
left out of ``/openapi.json``: they are not the API.
"""

from __future__ import annotations

from importlib.resources import files
from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from ttsq.gateway import openai
from ttsq.gateway.bodies import JobRequest, SpeechRequest
from ttsq.gateway.errors import ApiError
from ttsq.job import LANGUAGES

if TYPE_CHECKING:
    from ttsq.config import Settings

#: The page's files: name -> content type.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "player.js": "text/javascript; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
#: Only this origin: scripts, styles, images and fetches alike; ``blob:`` for the audio the page downloads.
#: No inline script or style, no frames, no forms posting elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; media-src 'self' blob:; object-src 'none'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # The files change with the package: a browser asks again (a cheap 200) rather than keep an old script.
    "Cache-Control": "no-cache",
}


def playground_router(settings: Settings) -> APIRouter:
    """The page's routes: ``/playground`` and its files, read from the package once."""
    folder = files(__name__)
    assets = {name: folder.joinpath(name).read_bytes() for name in ASSETS}
    router = APIRouter(include_in_schema=False)
    config = page_config(settings)

    @router.get("/playground")
    async def page() -> Response:
        return Response(assets["index.html"], media_type=ASSETS["index.html"], headers=HEADERS)

    @router.get("/playground/{name}")
    async def asset(name: str) -> Response:
        if name == "config.json":
            return JSONResponse(config, headers=HEADERS)
        if name not in assets or name == "index.html":
            raise ApiError(404, f"no file {name[:80]!r} in the playground", code="unknown_url", cause="not_found")
        return Response(assets[name], media_type=ASSETS[name], headers=HEADERS)

    return router


def page_config(settings: Settings) -> dict[str, object]:
    """What the page needs to know of this gateway: whether it asks for a key, where a text becomes a
    document (the page follows a document's chunks through the jobs API), the choices its menus offer, and
    whether the API takes word timestamps yet (the page highlights the word being said when a result carries
    ``words``)."""
    return {
        "auth": settings.gateway_auth != "none",
        "max_text_chars": settings.max_text_chars,
        "max_document_chars": settings.max_document_chars,
        "languages": list(LANGUAGES),
        "formats": list(openai.FORMATS),
        "pcm_rate": openai.PCM_RATE,
        "timestamps": "timestamps" in SpeechRequest.model_fields and "timestamps" in JobRequest.model_fields,
    }
