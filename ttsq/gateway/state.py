"""``ttsq serve``: the HTTP front door, a producer like ``ttsq submit`` that holds no model and no GPU.

It scales by running more of it behind any load balancer: everything it keeps (API keys, limits, jobs,
results) is in Redis. Requests go through the same ``Client`` path as the command line (validation,
cache short-circuit, single flight, documents); waiting for audio is async on Redis
(``ttsq.gateway.waiter``), so one process holds thousands of open requests without a thread each.

This module is the gateway's state and plumbing: API-key checks and limits, admission control, errors
in OpenAI's shape (``ttsq.gateway.errors``), metrics and the operations endpoints (``/healthz``,
``/readyz``, ``/metrics``); the middlewares that limit bodies and count requests are
``ttsq.gateway.middleware``. The API's own routes are ``ttsq.gateway.routes``; ``ttsq.gateway.app``
assembles the application.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.exceptions import HTTPException

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.constants import APIKEY_PREFIX
from ttsq.delivery.broker import queue_depth
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
from ttsq.gateway.middleware import BodyLimit, Observe, TooLarge
from ttsq.gateway.streams import StreamReader
from ttsq.gateway.waiter import ResultWaiter
from ttsq.job import LANES
from ttsq.records.owner import RedisOwner
from ttsq.records.scripts import register_async
from ttsq.voices import MAX_REFERENCE_BYTES

if TYPE_CHECKING:
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
        #: Jobs' audio streams, read on one connection of the cache pool (``ttsq.gateway.streams``).
        self.streams = StreamReader(self.cache, buffer_bytes=settings.gateway_stream_buffer_bytes)
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
        self.first_audio = Histogram(
            "ttsq_time_to_first_audio_seconds",
            "Speech requests: from the request's arrival to its first audio bytes handed to the server, by "
            "where the audio came from (cache: a cache hit; stream: the job's stream; stored: its stored file).",
            ["source"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 300),
            registry=registry,
        )
        self.streams_read = Gauge("ttsq_gateway_streams_read", "Job streams being read.", registry=registry)
        self.streams_read.set_function(lambda: self.streams.reading)
        for cause in CAUSES:
            self.refusals.labels(cause=cause)

    # -- admission, keys and quotas -------------------------------------------------------------

    def _admit(self, queue: str) -> None:
        """Admission control, from the submit thread: a queue at its limit takes nothing more."""
        limit = self.settings.gateway_max_queue
        if not limit:
            return
        # What waits in the list and what waits in tenants' places for release (fair shares) alike; the
        # second read only when the first leaves room.
        waiting = queue_depth(self.redis.broker, queue)
        if waiting < limit:
            waiting += sum(self.redis.accepted.deferred(queue).values())
        if waiting >= limit:
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
            verdict, retry_after, key_id, *lane = await self._authorize(
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
        request.state.key_lane = str(lane[0]) if lane and lane[0] in LANES else ""
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
        await self.streams.close()
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
    app.add_middleware(Observe, in_flight=gateway.in_flight, requests=gateway.requests, latency=gateway.latency)
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
        if exc.status_code == 404:  # routing's: no such route
            # The path is the client's own: echoed back to it, never logged.
            message = f"no route {request.method} {request.url.path[:200]}; the API is described at /openapi.json"
            return await api_error(request, ApiError(404, message, code="unknown_url", cause="not_found"))
        if exc.status_code == 405:
            allowed = (exc.headers or {}).get("Allow", "")
            message = f"{request.method} is not allowed on {request.url.path[:200]}" + (
                f"; allowed: {allowed}" if allowed else ""
            )
            return ApiError(405, message, code="method_not_allowed", headers=dict(exc.headers or {})).response()
        if exc.status_code != 400:
            return ApiError(
                exc.status_code, str(exc.detail), code="http_error", headers=dict(exc.headers or {})
            ).response()
        if isinstance(exc.__cause__, TooLarge):  # FastAPI wrapped BodyLimit's refusal: BodyLimit answers it
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
