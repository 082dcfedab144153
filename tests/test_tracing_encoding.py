"""ttsq's cheaper halves of tracing, held to OpenTelemetry's own SDK as the reference: the spans
``ttsq.tracing.spans`` makes against the spans the SDK's tracer makes, and the bytes
``ttsq.tracing.otlp`` writes against the SDK's ``encode_spans``. In one process, with the real SDK and
its in-memory exporter; nothing global is configured (``ttsq.tracing.setup`` is never called here).
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk.trace", reason="the extra ttsq[otel] is not installed")
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBasedTraceIdRatio, TraceIdRatioBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ttsq import tracing
from ttsq.constants import VERSION
from ttsq.tracing.otlp import Encoder
from ttsq.tracing.spans import Maker

#: Every kind of value an attribute can hold, Korean text included.
VALUES: dict[str, Any] = {
    "text": "안녕하세요, 세계",
    "empty": "",
    "yes": True,
    "no": False,
    "zero": 0,
    "negative": -42,
    "big": 2**62,
    "ratio": 0.25,
    "bytes": b"\x00\x01",
    "names": ("a", "b"),
    "sizes": (1, 2, 3),
    "flags": (True, False),
    "mapping": {"a": 1, "b": "two"},
}


def _provider(
    limits: SpanLimits | None = None, service: str = "ttsq-test"
) -> tuple[TracerProvider, InMemorySpanExporter]:
    provider = TracerProvider(resource=Resource.create({"service.name": service}), span_limits=limits)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _remote_parent(sampled: bool = True) -> Any:
    flags = "01" if sampled else "00"
    carrier = {"traceparent": f"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-{flags}", "tracestate": "k=v,x=y"}
    return TraceContextTextMapPropagator().extract(carrier)


def _parsed(data: bytes) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.ParseFromString(data)
    return request


def _many_spans() -> list[ReadableSpan]:
    """Spans of two resources and two scopes, with every field the encoder writes: a remote parent
    with a trace state, events, links with attributes, statuses, kinds, and counts of what limits dropped."""
    spans: list[ReadableSpan] = []
    limited, exported = _provider(SpanLimits(max_span_attributes=3, max_events=1, max_links=1), "limited")
    plain, exported_too = _provider()
    for provider in (limited, plain):
        tracer = provider.get_tracer("ttsq", VERSION)
        other = provider.get_tracer("someone.else", "1.0", schema_url="https://opentelemetry.io/schemas/1.21.0")
        with tracer.start_as_current_span("root", kind=SpanKind.SERVER, attributes=VALUES) as root:
            root.add_event("started", {"n": 1})
            root.add_event("again")
            root.set_status(Status(StatusCode.ERROR, "went wrong"))
            linked = root.get_span_context()
            with other.start_as_current_span("child", links=[Link(linked, {"why": "batch"}), Link(linked)]):
                pass
        remote = tracer.start_span("consumer", context=_remote_parent(), kind=SpanKind.CONSUMER)
        remote.set_status(Status(StatusCode.OK))
        remote.end()
        for kind in (SpanKind.INTERNAL, SpanKind.CLIENT, SpanKind.PRODUCER):
            tracer.start_span(kind.name.lower(), kind=kind).end()
    spans += exported.get_finished_spans() + exported_too.get_finished_spans()
    return spans


def test_the_encoder_writes_what_the_sdks_encoder_writes() -> None:
    spans = _many_spans()
    assert any(span.dropped_attributes for span in spans) and any(span.dropped_events for span in spans)
    assert any(span.dropped_links for span in spans) and any(span.parent and span.parent.is_remote for span in spans)
    ours = Encoder().request(spans)
    theirs = encode_spans(spans).SerializePartialToString()
    assert _parsed(ours) == _parsed(theirs)
    # Its caches (names, keys, resources) change nothing on a second batch of the same spans.
    encoder = Encoder()
    encoder.request(spans)
    assert _parsed(encoder.request(spans)) == _parsed(theirs)


def _without_ids_and_times(span: ReadableSpan) -> ExportTraceServiceRequest:
    """A span's encoding with what differs between two makings blanked: its own id and its times."""
    request = encode_spans([span])
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for encoded in scope_spans.spans:
                encoded.span_id = b""
                encoded.start_time_unix_nano = encoded.end_time_unix_nano = 0
                for event in encoded.events:
                    event.time_unix_nano = 0
    return request


@pytest.mark.parametrize("remote", [False, True], ids=["local parent", "remote parent"])
def test_a_span_ttsq_makes_is_the_span_the_sdk_makes(remote: bool) -> None:
    provider, exported = _provider()
    tracer = provider.get_tracer("ttsq", VERSION)
    maker = Maker(tracer, InstrumentationScope("ttsq", VERSION))
    assert Maker.serves(tracer)
    with tracer.start_as_current_span("root") as root:
        context = _remote_parent() if remote else trace.set_span_in_context(root)
        parent = trace.get_current_span(context).get_span_context()
        link = Link(root.get_span_context())
        made = [
            tracer.start_span("job", context=context, kind=SpanKind.CONSUMER, attributes=VALUES, links=[link]),
            maker.start("job", parent, SpanKind.CONSUMER, VALUES, [link]),
        ]
        for span in made:
            span.set_attributes({"ttsq.outcome": "ok", "ttsq.batch.size": 8})
            span.set_attribute("ttsq.cached", False)
            span.update_name("job renamed")
            span.add_event("exception", {"exception.type": "ttsq.errors.EngineError"})
            span.set_status(Status(StatusCode.ERROR, "EngineError"))
            span.set_status(Status(StatusCode.UNSET))  # never replaces what was set
            span.end()
            span.set_attribute("after.end", 1)  # an ended span takes nothing more
            span.end()  # and ends once
    sdk_span, our_span = exported.get_finished_spans()[:2]
    assert our_span.context.trace_id == sdk_span.context.trace_id
    assert our_span.context.span_id != sdk_span.context.span_id
    assert our_span.context.trace_flags == sdk_span.context.trace_flags
    assert our_span.context.trace_state == sdk_span.context.trace_state
    assert _without_ids_and_times(our_span) == _without_ids_and_times(sdk_span)


def test_spans_are_the_sdks_unless_every_child_of_a_sampled_parent_is_recorded() -> None:
    assert Maker.serves(TracerProvider().get_tracer("ttsq"))  # OpenTelemetry's default: parentbased_always_on
    assert Maker.serves(TracerProvider(sampler=ParentBasedTraceIdRatio(0.1)).get_tracer("ttsq"))
    assert not Maker.serves(TracerProvider(sampler=ALWAYS_ON).get_tracer("ttsq"))
    assert not Maker.serves(TracerProvider(sampler=TraceIdRatioBased(0.5)).get_tracer("ttsq"))


def test_odd_attribute_values_are_dropped_and_the_span_still_exports() -> None:
    provider, exported = _provider()
    tracer = provider.get_tracer("ttsq", VERSION)
    maker = Maker(tracer, InstrumentationScope("ttsq", VERSION))
    with tracer.start_as_current_span("root") as root:
        span = maker.start("odd", root.get_span_context(), attributes={"object": object(), "kept": 1})
        span.set_attributes({"list": [1, object()], "none": None, "fine": ["a", "b"]})
        span.end()
    odd = exported.get_finished_spans()[0]
    assert dict(odd.attributes) == {"kept": 1, "fine": ("a", "b")}
    assert _parsed(Encoder().request([odd])) == _parsed(encode_spans([odd]).SerializePartialToString())


class _Sink(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.server.bodies.append(body)  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def sink() -> Iterator[Any]:
    server: Any = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_otlp_exporter_sends_ttsqs_encoding_through_the_sdks_client(
    sink: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint = f"http://127.0.0.1:{sink.server_address[1]}"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)  # the SDK's exporter reads it itself
    exporter = tracing._exporter("otlp", {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint})
    # What the fast path needs of the installed SDK: were it gone, every export would take the SDK's
    # own encoder, and traces would cost what they cost before (docs/observability.md).
    assert callable(getattr(getattr(exporter, "_client", None), "export", None))
    spans = _many_spans()
    assert exporter.export(spans) is SpanExportResult.SUCCESS
    exporter.shutdown()
    (body,) = sink.bodies
    assert _parsed(body) == _parsed(encode_spans(spans).SerializePartialToString())
