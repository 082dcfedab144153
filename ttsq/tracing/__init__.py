"""Traces: one OpenTelemetry trace per request, across the gateway, the broker and the workers; and the
JSON log lines that join them.

Off unless configured through OpenTelemetry's own variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_TRACES_EXPORTER``, ``OTEL_SERVICE_NAME``, ...; the extra ``ttsq[otel]``), or unless the
application already installed an SDK tracer provider of its own (then ttsq's spans go there). Each
process decides once, when its first worker runtime, gateway or ``Client`` is built (``setup``). Off,
nothing of OpenTelemetry is imported and every call here returns at its first line.

Why a process-wide switch, against the house rule of no module-level state: OpenTelemetry's tracer
provider is one per process by its own design (``trace.set_tracer_provider`` may be called once), and
a trace must cross the layers (producer, batcher, storage) that share nothing else; this module keeps
only which tracer that is.

What carries a trace between processes: the W3C ``traceparent`` (and ``tracestate``) header, in the
gateway's HTTP request and in every Celery message ttsq sends (``inject``); a worker continues it per
task, on the task's own thread (``task``): attached when the task begins and detached by the same
thread when it ends, because Celery's ``worker_process_init`` (where OpenTelemetry's Celery
instrumentation sets up) never fires under the threads pool. The batcher thread never attaches a
job's context: it opens the batch span with a link to every job in it, and writes each job's wait and
share of the engine call into that job's trace with explicit parents and times (``batch``,
``record``). Attributes name keys, engines, modes, languages, queues and sizes; never input text, a
signed URL or an API key.

What it costs, and the two halves ttsq does itself: a span whose parent is sampled is made by
``ttsq.tracing.spans`` (a third of the SDK tracer's cost a span, the same span), and the OTLP/HTTP exporter
encodes with ``ttsq.tracing.otlp`` (under half of the SDK encoder's cost, the same bytes); both are held to
the SDK by ``tests/test_tracing_encoding.py`` and measured by ``benchmarks/tracing.py``.

Why one file over 400 lines: the switch, the spans, the propagation, the worker's observer and the
JSON log lines all read the one process-wide tracer kept here; split, each part would reach into
another module for that state.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeAlias

from ttsq.constants import VERSION
from ttsq.observer import Observer

if TYPE_CHECKING:
    from ttsq.observer import BatchReport, JobReport

logger = logging.getLogger(__name__)

#: A span attribute's value.
Value: TypeAlias = str | int | float | bool
#: The W3C Trace Context headers, the only ones read from a message or request.
PROPAGATED = ("traceparent", "tracestate")
#: Longest header value taken from a message or request (an envelope is untrusted input).
_MAX_HEADER_CHARS = 512
_KINDS = ("internal", "server", "client", "producer", "consumer")


class Handle:
    """The span a ``with`` block opened: attributes may be added while it runs. Off: does nothing."""

    __slots__ = ()

    def set(self, attributes: Mapping[str, Value | None]) -> None:
        """Add attributes (a None value is left out)."""

    def rename(self, name: str) -> None:
        """Rename the span (a server span learns its route only once routed)."""

    def error(self, description: str) -> None:
        """Mark the span failed without an exception (a server's 5xx answer)."""


class _Off:
    """The one context manager every call returns while tracing is off: nothing to allocate."""

    __slots__ = ()
    handle = Handle()

    def __enter__(self) -> Handle:
        return self.handle

    def __exit__(self, *_: object) -> None:
        return None


_OFF = _Off()


class _Live(Handle):
    __slots__ = ("span",)

    def __init__(self, span: Any) -> None:
        self.span = span

    def set(self, attributes: Mapping[str, Value | None]) -> None:
        self.span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def rename(self, name: str) -> None:
        self.span.update_name(name)

    def error(self, description: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_status(Status(StatusCode.ERROR, description))


class _Tracing:
    """The process's tracer, with the OpenTelemetry names it uses (imported once, at ``setup``)."""

    def __init__(self, provider: Any, *, own: bool) -> None:
        from opentelemetry import context, trace
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from ttsq.tracing.spans import Maker

        self.provider = provider
        self.tracer = provider.get_tracer("ttsq", VERSION)
        #: Makes the spans whose parent is sampled, at a third of the SDK's cost (``ttsq.tracing.spans``),
        #: when the provider is ttsq's own; None: the SDK makes every span.
        self.maker = (
            Maker(self.tracer, InstrumentationScope("ttsq", VERSION)) if own and Maker.serves(self.tracer) else None
        )
        self.trace = trace
        self.context = context
        self.propagator = TraceContextTextMapPropagator()
        self.kinds = {name: getattr(trace.SpanKind, name.upper()) for name in _KINDS}

    def links(self, contexts: Sequence[Any]) -> list[Any]:
        return [self.trace.Link(c) for c in contexts if c is not None and c.is_valid]

    def fail(self, span: Any, description: str) -> None:
        span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, description))

    def parent(self, span_context: Any) -> Any:
        """A context whose parent is ``span_context`` (a job's, kept by the batcher)."""
        return self.trace.set_span_in_context(self.trace.NonRecordingSpan(span_context))


_active: _Tracing | None = None
_decided = False
_lock = threading.Lock()


def setup(service: str) -> bool:
    """Decide, once per process, whether it traces; ``service`` names it unless ``OTEL_SERVICE_NAME``
    does. Reads ``OTEL_*`` now (an entrypoint's call, never at import). True when tracing is on."""
    global _active, _decided
    with _lock:
        if not _decided:
            _decided = True
            try:
                _active = _configure(service, os.environ)
            except Exception as exc:  # tracing must never stop a worker or a gateway from starting
                logger.warning("traces are off: OpenTelemetry could not be set up: %s", exc)
        return _active is not None


def enabled() -> bool:
    """Whether this process traces."""
    return _active is not None


def _configure(service: str, env: Mapping[str, str]) -> _Tracing | None:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    adopted = _application_provider()
    if adopted is not None:
        return _Tracing(adopted, own=False)
    names = [n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not names and endpoint:
        names = ["otlp"]  # an endpoint alone asks for OTLP, as in every OpenTelemetry SDK
    names = [name for name in names if name != "none"]
    if not names:
        return None
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        logger.warning("OTEL_* asks for traces, but OpenTelemetry is not installed: pip install 'ttsq[otel]' (%s)", exc)
        return None
    exporters = [exporter for name in names if (exporter := _exporter(name, env)) is not None]
    if not exporters:
        return None
    named = env.get("OTEL_SERVICE_NAME") or "service.name=" in env.get("OTEL_RESOURCE_ATTRIBUTES", "")
    # Sampling (OTEL_TRACES_SAMPLER), the batch processor's delays (OTEL_BSP_*) and the exporter's
    # endpoint, headers and timeout are read by OpenTelemetry itself. The provider flushes at exit.
    provider = TracerProvider(resource=_hashed_once(Resource.create({} if named else {SERVICE_NAME: service})))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    logger.info("traces on: exporting through %s", ", ".join(names))
    return _Tracing(provider, own=True)


def _hashed_once(resource: Any) -> Any:
    """``resource``, hashed once. The OTLP exporter groups every span it sends by its resource, and an SDK
    resource hashes by writing its attributes out as JSON: a tenth of a span's exporting, once a span."""
    from opentelemetry.sdk.resources import Resource

    class HashedOnce(Resource):
        def __init__(self, attributes: Any, schema_url: str | None = None) -> None:
            super().__init__(attributes, schema_url)
            self._hash = super().__hash__()

        def __hash__(self) -> int:
            return self._hash

    return HashedOnce(resource.attributes, resource.schema_url)


def _application_provider() -> Any:
    """The SDK tracer provider the application installed before ttsq started, if any (not imported
    here when nobody imported the SDK)."""
    import sys

    if "opentelemetry.sdk.trace" not in sys.modules:
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = trace.get_tracer_provider()
    return provider if isinstance(provider, TracerProvider) else None


def _exporter(name: str, env: Mapping[str, str]) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if name != "otlp":
        logger.warning("OTEL_TRACES_EXPORTER=%s: ttsq knows otlp, console and none; ignored", name)
        return None
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "http/protobuf"
    )
    modules = {
        "http/protobuf": ("opentelemetry.exporter.otlp.proto.http.trace_exporter", "'ttsq[otel]'"),
        "grpc": ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry-exporter-otlp-proto-grpc"),
    }
    if protocol not in modules:
        logger.warning("OTLP protocol %s is not supported here (http/protobuf or grpc); no traces", protocol)
        return None
    module, package = modules[protocol]
    try:
        exporter_class = importlib.import_module(module).OTLPSpanExporter
    except ImportError as exc:
        logger.warning("OTLP over %s needs pip install %s (%s); no traces", protocol, package, exc)
        return None
    return _encoding_itself(exporter_class)() if protocol == "http/protobuf" else exporter_class()


def _encoding_itself(exporter_class: type) -> type:
    """OpenTelemetry's OTLP/HTTP exporter, but encoding with ``ttsq.tracing.otlp`` (half the exporting's CPU, on
    the worker's interpreter lock). Sending stays the SDK's: its HTTP client (endpoint, headers, TLS,
    compression, retries) takes the bytes. An SDK whose exporter has no such client (older or newer
    than ``_OTLPHTTPClient``) exports as it always did."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    from ttsq.tracing.otlp import Encoder

    class Exporter(exporter_class):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self._ttsq_encoder = Encoder()

        def export(self, spans: Sequence[Any]) -> Any:
            send = getattr(getattr(self, "_client", None), "export", None)
            if getattr(self, "_shutdown", True) or not callable(send):
                return super().export(spans)
            try:
                data = self._ttsq_encoder.request(spans)
            except Exception as exc:  # a value the encoder does not know: the SDK's own encoder decides
                logger.debug("spans encoded by the SDK: %s", exc)
                return super().export(spans)
            sent = send(data)
            return SpanExportResult.SUCCESS if getattr(sent, "success", False) else SpanExportResult.FAILURE

    return Exporter


def flush(timeout_s: float = 5.0) -> None:
    """Export every span ended so far (a process about to end; the provider also flushes at exit)."""
    active = _active
    if active is not None and hasattr(active.provider, "force_flush"):
        try:
            active.provider.force_flush(int(timeout_s * 1000))
        except Exception as exc:
            logger.warning("could not flush traces: %s", type(exc).__name__)


# --- spans -------------------------------------------------------------------------------------


def span(
    name: str,
    attributes: Mapping[str, Value | None] | None = None,
    *,
    kind: str = "internal",
    parent: Any = None,
    links: Sequence[Any] = (),
) -> Any:
    """A context manager: a span around the block, current on this thread while it runs (children
    nest under it), ended and detached by the same thread. ``parent``: a context from ``extract``
    (default: the current one); ``links``: span contexts from ``current``. Yields a ``Handle``."""
    active = _active
    if active is None:
        return _OFF
    return _open(active, name, attributes, kind, parent, links)


class _Open:
    """An open span, current on the thread that entered it until that thread leaves it (a class rather
    than a generator: a span is opened a dozen times a job)."""

    __slots__ = ("active", "span", "token")

    def __init__(self, active: _Tracing, span: Any) -> None:
        self.active, self.span, self.token = active, span, None

    def __enter__(self) -> Handle:
        self.token = self.active.context.attach(self.active.trace.set_span_in_context(self.span))
        return _Live(self.span)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, _: object) -> None:
        try:
            if kind is not None:
                # The exception's type only: a message may quote what the job was asked to say.
                name = kind.__name__
                if name in _CONTROL_FLOW:
                    self.span.set_attribute("ttsq.ended_by", name)
                else:
                    self.span.add_event("exception", {"exception.type": f"{kind.__module__}.{kind.__qualname__}"})
                    self.active.fail(self.span, name)
        finally:
            self.active.context.detach(self.token)
            self.span.end()


#: Celery's control-flow exceptions: a task replaced by its chord, or a retry scheduled, has not failed.
_CONTROL_FLOW = frozenset({"Ignore", "Retry"})


def _open(
    active: _Tracing,
    name: str,
    attributes: Mapping[str, Value | None] | None,
    kind: str,
    parent: Any,
    links: Sequence[Any],
) -> _Open:
    maker = active.maker
    if maker is not None:
        above = active.trace.get_current_span(parent).get_span_context()
        if above.is_valid and above.trace_flags.sampled:  # the maker drops None values itself
            return _Open(active, maker.start(name, above, active.kinds[kind], attributes, active.links(links)))
    kept = {k: v for k, v in (attributes or {}).items() if v is not None}
    return _Open(
        active,
        active.tracer.start_span(
            name, context=parent, kind=active.kinds[kind], attributes=kept, links=active.links(links)
        ),
    )


def annotate(attributes: Mapping[str, Value | None]) -> None:
    """Add attributes to this thread's current span (none: nothing)."""
    active = _active
    if active is not None:
        current = active.trace.get_current_span()
        if current.is_recording():
            current.set_attributes({k: v for k, v in attributes.items() if v is not None})


def current() -> Any:
    """This thread's current span context, to link to or parent under later (None when off or none)."""
    active = _active
    if active is None:
        return None
    found = active.trace.get_current_span().get_span_context()
    return found if found.is_valid else None


def record(
    name: str,
    parent: Any,
    started: float,
    ended: float | None = None,
    *,
    attributes: Mapping[str, Value | None] | None = None,
    links: Sequence[Any] = (),
) -> Any:
    """Write a span that has already happened into the trace of ``parent`` (a span context from
    ``current``), from ``started`` to ``ended`` (``time.monotonic()`` readings; None: now), from any
    thread: nothing is attached. Returns its span context (None when off, or without a parent)."""
    active = _active
    if active is None or parent is None:
        return None
    now_ns, now = time.time_ns(), time.monotonic()
    end = now if ended is None else ended
    start_ns = now_ns - int(max(0.0, now - started) * 1e9)
    if active.maker is not None and parent.is_valid and parent.trace_flags.sampled:
        links_to = active.links(links)
        created = active.maker.start(name, parent, attributes=attributes, links=links_to, start_time=start_ns)
    else:
        kept = {k: v for k, v in (attributes or {}).items() if v is not None}
        created = active.tracer.start_span(
            name, context=active.parent(parent), attributes=kept, links=active.links(links), start_time=start_ns
        )
    created.end(end_time=now_ns - int(max(0.0, now - end) * 1e9))
    return created.get_span_context()


@contextmanager
def batch(jobs: Sequence[tuple[Any, float]], attributes: Mapping[str, Value | None]) -> Iterator[Handle]:
    """One engine call: its own span, linked to every job in it (``jobs``: each job's span context from
    ``current`` and when it reached the batcher, ``time.monotonic()``); and in each job's own trace,
    ``ttsq.batch_wait`` (arrival to the call) and ``ttsq.synthesis`` (the call, linked to the batch)."""
    active = _active
    if active is None:
        yield _OFF.handle
        return
    started = time.monotonic()
    for job, arrived in jobs:
        record("ttsq.batch_wait", job, arrived, started)
    contexts = [job for job, _ in jobs]
    with span("ttsq.batch", attributes, links=contexts) as opened:
        batch_context = current()
        try:
            yield opened
        finally:
            for job in contexts:
                record("ttsq.synthesis", job, started, attributes=attributes, links=[batch_context])


# --- propagation -------------------------------------------------------------------------------


def inject(headers: MutableMapping[str, Any]) -> None:
    """Put this thread's current span in ``headers`` as W3C ``traceparent`` (a message's, on publish)."""
    active = _active
    if active is not None:
        active.propagator.inject(headers)


def extract(carrier: Mapping[str, Any]) -> Any:
    """The context a message or request carries (its ``traceparent``), to parent spans under; None when
    off or when it carries none. Anything but a short string is ignored: headers are untrusted input."""
    active = _active
    if active is None:
        return None
    clean = {
        name: value
        for name in PROPAGATED
        if isinstance(value := carrier.get(name), str) and len(value) <= _MAX_HEADER_CHARS
    }
    return active.propagator.extract(clean) if clean else None


@contextmanager
def task(
    name: str, carrier: Mapping[str, Any], *, task_id: str, queue: str | None, sent_at: float | None
) -> Iterator[Handle]:
    """A worker's task, continuing the trace its message carries: ``ttsq.queued`` (producer's send to
    now, the message in the broker) and the task's own span, current on this task thread until the
    task returns (attached and detached here, on the one thread: the threads pool never runs
    ``worker_process_init``)."""
    active = _active
    if active is None:
        yield _OFF.handle
        return
    parent = extract(carrier)
    messaging: dict[str, Value | None] = {
        "messaging.system": "celery",
        "messaging.destination.name": queue,
        "messaging.message.id": task_id,
    }
    if parent is not None and sent_at is not None:
        sent = active.trace.get_current_span(parent).get_span_context()
        waited = max(0.0, time.time() - sent_at)
        record("ttsq.queued", sent, time.monotonic() - waited, attributes=messaging)
    with span(name, {**messaging, "messaging.operation.type": "process"}, kind="consumer", parent=parent) as opened:
        yield opened


# --- what the worker's observer reports --------------------------------------------------------


class TraceObserver(Observer):
    """Puts what the job path reports (``ttsq.observer``) on the span each report happens in: a cache
    re-check's answer and a job's outcome on its task span, an engine call's audio on its batch span."""

    def cache_checked(self, *, hit: bool) -> None:
        annotate({"ttsq.cached": hit})

    def job_parked(self, task_id: str) -> None:
        annotate({"ttsq.parked": True})

    def batch_finished(self, report: BatchReport) -> None:
        annotate({"ttsq.audio_s": round(report.audio_s, 3), "ttsq.truncated": report.truncated})

    def job_finished(self, report: JobReport) -> None:
        result = report.result
        annotate(
            {
                "ttsq.outcome": report.outcome,
                "ttsq.written": report.written,
                "ttsq.cached": None if result is None else bool(result.get("cached")),
                "ttsq.batch.size": None if result is None else result.get("batch_size"),
            }
        )


# --- logs that join traces ---------------------------------------------------------------------


def ids() -> tuple[str, str] | None:
    """This thread's current trace and span ids, as hex (None when off or outside any span)."""
    found = current()
    return None if found is None else (f"{found.trace_id:032x}", f"{found.span_id:016x}")


class JsonFormatter(logging.Formatter):
    """One JSON object per log line: time, level, logger, message, and ``trace_id`` / ``span_id`` when
    the line was written inside a span (``TTSQ_LOG_FORMAT=json``); ``fields`` are added to every line."""

    def __init__(self, fields: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
        }
        joined = ids()
        if joined is not None:
            line["trace_id"], line["span_id"] = joined
        if record.exc_info:
            if not record.exc_text:  # formatted once per record, as logging.Formatter does (ttsq.logs)
                record.exc_text = self.formatException(record.exc_info)
            line["exception"] = record.exc_text
        return json.dumps(line, ensure_ascii=False)


def log_formatter(log_format: str, text: str, fields: Mapping[str, str] | None = None) -> logging.Formatter:
    """The formatter of ``TTSQ_LOG_FORMAT``: ``json`` (``JsonFormatter``) or ``text`` (the ``text`` format)."""
    return JsonFormatter(fields) if log_format == "json" else logging.Formatter(text)
