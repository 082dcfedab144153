"""``ttsq serve``: the HTTP front door, a producer like ``ttsq submit`` that holds no model and no GPU.

It scales by running more of it behind any load balancer: everything it keeps (API keys, limits, jobs,
results) is in Redis. Requests go through the same ``Client`` path as the command line (validation,
cache short-circuit, single flight, documents); waiting for audio is async on Redis
(``ttsq.gateway.waiter``), so one process holds thousands of open requests without a thread each.

This module is the gateway's state and plumbing: API-key checks and limits, admission control, errors
in OpenAI's shape (``ttsq.gateway.errors``), request body limits, metrics and the operations endpoints
(``/healthz``, ``/readyz``, ``/metrics``). The API's own routes are ``ttsq.gateway.routes``; ``ttsq.gateway.app``
assembles the application.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.constants import APIKEY_PREFIX
from ttsq.errors import BrokerError, CorruptRecord, InvalidRequest, JobTimeout, StorageError, UnknownJob
from ttsq.gateway.apikeys import (
    QUOTA_TTL_S,
    audio_ms,
    authorize_args,
    charged_key,
    quota_key,
    token_hash,
)
from ttsq.gateway.errors import ApiError, invalid
from ttsq.gateway.waiter import ResultWaiter
from ttsq.records.owner import RedisOwner
from ttsq.records.queues import queue_depth
from ttsq.records.scripts import register_async
from ttsq.voices import MAX_REFERENCE_BYTES

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ttsq.config import Settings

logger = logging.getLogger(__name__)

#: Causes of a refusal (the ``cause`` label of ``ttsq_gateway_refusals_total``).
CAUSES = ("auth", "revoked", "rate", "quota", "queue", "invalid", "too_large", "not_found")
#: Seconds a refused client is told to wait before it tries again when the queue is full.
QUEUE_RETRY_AFTER_S = 5
#: Paths that need no key: operations, and the API's own description.
OPEN_PATHS = ("/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/redoc")


class Gateway:
    """What one gateway process holds: a producer ``Client``, the async result waiter, its metrics."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        #: This process's Redis: one sync client per database (the producer ``Client``'s, admission
        #: control's) and one async one per database (keys and quotas, results).
        self.redis = RedisOwner(settings, role="gateway")
        self.client = Client(settings, app=make_app(settings), admit=self._admit, redis=self.redis)
        #: The cache database, async: API keys, rates and quotas, readiness.
        self.cache = self.redis.async_client(settings.cache_url)
        self.waiter = ResultWaiter(self.redis.async_client(settings.result_backend))
        self._authorize = register_async(self.cache, "authorize")
        self._charge = register_async(self.cache, "charge")
        self._charge_once = register_async(self.cache, "charge_once")
        registry = self.registry = CollectorRegistry()
        self.requests = Counter(
            "ttsq_gateway_requests", "HTTP requests by route and status.", ["route", "status"], registry=registry
        )
        self.latency = Histogram(
            "ttsq_gateway_request_seconds",
            "HTTP request time, by route.",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=registry,
        )
        self.in_flight = Gauge("ttsq_gateway_requests_in_flight", "HTTP requests being served.", registry=registry)
        self.waiting = Gauge("ttsq_gateway_waiting_jobs", "Requests waiting for a job's result.", registry=registry)
        self.waiting.set_function(lambda: self.waiter.waiting)
        self.refusals = Counter("ttsq_gateway_refusals", "Requests refused, by cause.", ["cause"], registry=registry)
        for cause in CAUSES:
            self.refusals.labels(cause=cause)

    # -- admission, keys and quotas -------------------------------------------------------------

    def _admit(self, queue: str) -> None:
        """Admission control, from the submit thread: a queue at its limit takes nothing more."""
        limit = self.settings.gateway_max_queue
        if limit and queue_depth(self.redis.broker, queue) >= limit:
            raise ApiError(
                503,
                f"the queue {queue} holds {limit} or more waiting jobs; try again shortly",
                type="server_error",
                code="queue_full",
                headers={"Retry-After": str(QUEUE_RETRY_AFTER_S)},
                cause="queue",
            )

    async def authorize(self, request: Request) -> str:
        """The key id of a request's bearer token ("" with ``TTSQ_GATEWAY_AUTH=none``); refuse it
        otherwise: 401 without a known key, 403 revoked, 429 over its rate or quota."""
        if self.settings.gateway_auth == "none":
            return ""
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(
                401,
                "an API key is required: Authorization: Bearer <key> (`ttsq keys add NAME`)",
                code="missing_api_key",
                cause="auth",
            )
        now = time.time()
        try:
            verdict, retry_after, key_id = await self._authorize(
                keys=[APIKEY_PREFIX + token_hash(token.strip())], args=authorize_args(now)
            )
        except Exception as exc:
            raise BrokerError(f"cannot reach Redis to check the API key: {type(exc).__name__}") from exc
        if verdict == "unknown":
            raise ApiError(401, "the API key is not valid", code="invalid_api_key", cause="auth")
        if verdict == "revoked":
            raise ApiError(
                403, "the API key was revoked", type="permission_error", code="revoked_api_key", cause="revoked"
            )
        if verdict == "rate":
            raise ApiError(
                429,
                "too many requests for this API key; try again in a moment",
                type="requests",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(retry_after)},
                cause="rate",
            )
        if verdict == "quota":
            raise ApiError(
                429,
                "this API key's audio quota for today is used up",
                type="insufficient_quota",
                code="insufficient_quota",
                headers={"Retry-After": str(retry_after)},
                cause="quota",
            )
        return str(key_id)

    async def charge(self, key_id: str, audio_s: float) -> None:
        """Count audio served against the key's quota for today."""
        if key_id and audio_s > 0:
            await self._charge(keys=[quota_key(key_id, time.time())], args=[audio_ms(audio_s), QUOTA_TTL_S])

    async def charge_once(self, key_id: str, job_id: str, audio_s: float) -> None:
        """Count a job's audio against the key's quota the first time the key reads its result."""
        if key_id and audio_s > 0:
            await self._charge_once(
                keys=[quota_key(key_id, time.time()), charged_key(key_id, job_id)],
                args=[audio_ms(audio_s), QUOTA_TTL_S],
            )

    async def submit(self, call: Callable[[], Any]) -> Any:
        """Run a ``Client`` call (validation, cache, claim, send: a few milliseconds of Redis) on a thread."""
        try:
            return await anyio.to_thread.run_sync(call)
        except InvalidRequest as exc:
            raise invalid(exc) from None

    async def close(self) -> None:
        await self.waiter.close()
        await self.redis.aclose()
        self.client.close()
        self.redis.close()


def install(app: FastAPI, gateway: Gateway) -> None:
    """Put the gateway's plumbing on ``app``: body limits, errors in OpenAI's shape, metrics, operations."""
    app.state.gateway = gateway
    app.add_middleware(
        BodyLimit,
        default=gateway.settings.gateway_max_body_bytes,
        larger={"/v1/voices": MAX_REFERENCE_BYTES + 1_048_576},
        on_refuse=gateway.refusals,
    )
    app.add_middleware(Observe, gateway=gateway)
    _errors(app, gateway)
    _operations(app, gateway)


def _errors(app: FastAPI, gateway: Gateway) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if exc.cause:
            gateway.refusals.labels(cause=exc.cause).inc()
        return exc.response()

    async def invalid_request(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, InvalidRequest)
        return await api_error(request, invalid(exc))

    def not_json() -> ApiError:
        return ApiError(400, "the body is not JSON", param="body", code="invalid_json", cause="invalid")

    async def validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        kind, loc = first.get("type"), tuple(first.get("loc", ()))
        if kind == "json_invalid":  # FastAPI's JSON decoding, or a body model's (``ttsq.gateway.bodies``)
            return await api_error(request, not_json())
        param = ".".join(str(part) for part in loc[1:]) or "body"
        # An empty body, or JSON null, is a missing one to FastAPI: no body model sees it.
        reason = "expected a JSON object" if kind == "missing" and loc == ("body",) else first.get("msg", "invalid")
        return await api_error(
            request, ApiError(400, f"invalid {param}: {reason}", param=param, code="invalid_value", cause="invalid")
        )

    async def unreadable(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if exc.status_code != 400:  # routing's 404 and 405, answered as FastAPI answers them
            return await http_exception_handler(request, exc)
        if isinstance(exc.__cause__, _TooLarge):  # FastAPI wrapped BodyLimit's refusal: BodyLimit answers it
            raise exc.__cause__
        # A body FastAPI or Starlette could not parse before any route ran: JSON that is not UTF-8 or nests
        # deeper than Python recurses, a broken multipart form.
        if isinstance(exc.__cause__, (ValueError, RecursionError)):
            return await api_error(request, not_json())
        unparsed = f"the body cannot be read: {exc.detail}"
        return await api_error(request, ApiError(400, unparsed, param="body", code="invalid_value", cause="invalid"))

    async def unknown(request: Request, exc: Exception) -> Response:
        return await api_error(request, ApiError(404, str(exc), code="not_found", cause="not_found"))

    async def unavailable(_: Request, exc: Exception) -> Response:
        logger.warning("%s: %s", type(exc).__name__, exc)
        return ApiError(
            503,
            "a service ttsq depends on is unreachable; try again shortly",
            type="server_error",
            code="unavailable",
            headers={"Retry-After": "2"},
        ).response()

    async def timeout(_: Request, exc: Exception) -> Response:
        return ApiError(504, str(exc), type="server_error", code="timeout").response()

    async def corrupt(_: Request, exc: Exception) -> Response:
        logger.warning("refused a record read back from Redis: %s", exc)
        return ApiError(502, str(exc), type="server_error", code="corrupt_record").response()

    async def unexpected(_: Request, exc: Exception) -> Response:
        logger.error("unexpected %s", type(exc).__name__, exc_info=exc)  # the exception, never the request
        return ApiError(500, "internal error", type="server_error", code="internal_error").response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(InvalidRequest, invalid_request)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, unreadable)
    app.add_exception_handler(UnknownJob, unknown)
    for error in (BrokerError, StorageError):
        app.add_exception_handler(error, unavailable)
    app.add_exception_handler(JobTimeout, timeout)
    app.add_exception_handler(CorruptRecord, corrupt)
    app.add_exception_handler(Exception, unexpected)


class Observe:
    """Count and time every request by its route template (never its ids) and status: plain ASGI, so it
    costs a request no more than the two clock reads."""

    def __init__(self, app: ASGIApp, *, gateway: Gateway) -> None:
        self.app, self.gateway = app, gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gateway, started, status = self.gateway, time.perf_counter(), 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        gateway.in_flight.inc()
        try:
            await self.app(scope, receive, sending)
        finally:
            gateway.in_flight.dec()
            route = getattr(scope.get("route"), "path", "unmatched")
            gateway.requests.labels(route=route, status=str(status)).inc()
            gateway.latency.labels(route=route).observe(time.perf_counter() - started)


def _operations(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        """The process serves requests."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"])
    async def readyz() -> Response:
        """Redis and storage reachable, and a worker running: ready to take jobs. ``workers`` follows the
        workers themselves (one that stops withdraws at once, one that died within ``FLEET_LIVE_S``), not
        the producers' longer trust in the models they announced."""
        checks: dict[str, bool] = {}
        try:
            checks["redis"] = bool(await gateway.cache.ping())
        except Exception:
            checks["redis"] = False
        try:
            await anyio.to_thread.run_sync(gateway.client.storage.check)  # the bucket itself, not one object
            checks["storage"] = True
        except Exception:
            checks["storage"] = False
        try:
            running = await anyio.to_thread.run_sync(gateway.redis.identities.workers, gateway.settings.queue)
            checks["workers"] = bool(running)
        except Exception:
            checks["workers"] = False
        ready = all(checks.values())
        return JSONResponse({"ready": ready, "checks": checks}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["operations"])
    async def metrics() -> Response:
        """Prometheus text: requests by route and status, latency, requests in flight, refusals by cause."""
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)


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
                    raise _TooLarge
            return message

        async def sending(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except _TooLarge:
            if not started:
                await self._refuse(scope, receive, send, limit)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        self.on_refuse.labels(cause="too_large").inc()
        response = ApiError(
            413, f"the request body is larger than {limit} bytes", param="body", code="request_too_large"
        )
        await response.response()(scope, receive, send)


class _TooLarge(Exception):
    """The body read so far is over the limit."""
