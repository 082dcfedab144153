"""Traces: one request through a real ``ttsq serve`` and a real worker (threads pool) is one
OpenTelemetry trace, received here over OTLP/HTTP the way a collector receives it.

The receiver is a plain ``http.server`` on loopback that decodes each ``ExportTraceServiceRequest``
with OpenTelemetry's own protobuf classes; the processes are configured only through the standard
``OTEL_*`` variables, as an operator would.
"""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import SECRET, GatewayProcess, WorkerProcess, api_key, wait_until

from ttsq.config import Settings

pytest.importorskip("opentelemetry.sdk.trace", reason="the extra ttsq[otel] is not installed")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span


@dataclass
class Received:
    """One span as the receiver decoded it, with the service that sent it."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    links: list[tuple[str, str]]


@dataclass
class Receiver:
    """An OTLP/HTTP trace receiver on loopback: every span any process exports to it."""

    url: str
    spans: list[Received] = field(default_factory=list)
    requests: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def named(self, name: str) -> list[Received]:
        with self.lock:
            return [s for s in self.spans if s.name == name]


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def _decode(body: bytes) -> list[Received]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    found = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    Received(
                        service=str(resource.get("service.name")),
                        name=span.name,
                        kind=span.kind,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_id=span.parent_span_id.hex(),
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in span.links],
                    )
                )
    return found


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    got = Receiver(url=f"http://127.0.0.1:{server.server_address[1]}")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            spans = _decode(body) if self.path == "/v1/traces" else []
            with got.lock:
                got.spans.extend(spans)
                got.requests += 1
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if self.path == "/v1/traces" else 404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *_: Any) -> None:
            pass

    server.RequestHandlerClass = Handler
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    yield got
    server.shutdown()
    server.server_close()
    thread.join(10)


#: What a trace of one speech request holds, producer to storage.
EXPECTED = {
    "ttsq.submit",
    "ttsq.cache_check",
    "ttsq.claim",
    "ttsq.accept",
    "ttsq.send",
    "ttsq.queued",
    "ttsq.synthesize",
    "ttsq.batch_wait",
    "ttsq.synthesis",
    "ttsq.encode",
    "ttsq.upload",
    "ttsq.index",
}


def test_one_speech_request_is_one_trace_from_the_gateway_to_the_storage_upload(
    settings: Settings,
    start_worker: Callable[..., WorkerProcess],
    start_gateway: Callable[..., GatewayProcess],
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Only the standard variables, in the environment the test's processes inherit (this test's own).
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    settings = settings.replace(log_format="json")
    worker = start_worker(settings)
    gateway = start_gateway(settings)
    token = api_key(settings)
    # A caller that traces sends its own traceparent: the gateway's request span continues it.
    caller_trace, caller_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    answer = httpx.post(
        f"{gateway.url}/v1/audio/speech",
        headers={"Authorization": f"Bearer {token}", "traceparent": f"00-{caller_trace}-{caller_span}-01"},
        json={"model": "tts-1", "voice": "alloy", "input": SECRET, "response_format": "wav"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    wait_until(
        lambda: bool(receiver.named("ttsq.upload")) and bool(receiver.named("POST /v1/audio/speech")),
        20,
        "the gateway's and the worker's spans",
    )
    wait_until(lambda: bool(receiver.named("ttsq.batch")), 10, "the batch span")

    (request,) = receiver.named("POST /v1/audio/speech")
    assert request.service == "ttsq-gateway" and request.kind == Span.SPAN_KIND_SERVER
    assert (request.trace_id, request.parent_id) == (caller_trace, caller_span)
    assert request.attributes["http.route"] == "/v1/audio/speech"
    assert request.attributes["http.response.status_code"] == 200
    trace = caller_trace
    wait_until(lambda: {s.name for s in receiver.spans if s.trace_id == trace} >= EXPECTED, 10, "every span of the job")
    spans = {s.span_id: s for s in receiver.spans if s.trace_id == trace}
    by_name = {s.name: s for s in spans.values()}
    assert {s.service for s in spans.values()} == {"ttsq-gateway", "ttsq-worker"}

    # The upload's ancestors run, span by span and across both processes, up to the request.
    chain, at = [], by_name["ttsq.upload"]
    while at.parent_id in spans:
        chain.append(at.name)
        at = spans[at.parent_id]
    assert at is request, chain
    assert chain == ["ttsq.upload", "ttsq.synthesize", "ttsq.send", "ttsq.submit"]
    assert by_name["ttsq.queued"].parent_id == by_name["ttsq.send"].span_id  # the message in the broker
    task = by_name["ttsq.synthesize"]
    assert task.service == "ttsq-worker" and task.kind == Span.SPAN_KIND_CONSUMER
    assert re.fullmatch(r"[0-9a-f]{64}", task.attributes["ttsq.content_key"])
    assert task.attributes["ttsq.engine"] == "espeak" and task.attributes["ttsq.cached"] is False
    assert task.attributes["ttsq.batch.size"] == 1
    assert {by_name[n].parent_id for n in ("ttsq.batch_wait", "ttsq.synthesis", "ttsq.encode", "ttsq.index")} == {
        task.span_id
    }

    # The engine call is its own span, linked to the job that rode in it (and the job's share links back).
    linked = [s for s in receiver.named("ttsq.batch") if (trace, task.span_id) in s.links]
    assert len(linked) == 1 and linked[0].attributes["ttsq.batch.size"] == 1
    assert by_name["ttsq.synthesis"].links == [(linked[0].trace_id, linked[0].span_id)]

    # Never the input text, a signed URL or the API key, in any span any process sent.
    with receiver.lock:
        values = [str(v) for s in receiver.spans for v in s.attributes.values()]
    for secret in (SECRET, SECRET.split()[1], token, "X-Amz-Signature"):
        assert not [v for v in values if secret in v], secret

    # Every span was ended on the thread that opened it (OpenTelemetry logs this when one is not).
    for log in (worker.log(), gateway.log()):
        assert "Failed to detach context" not in log
    # Health probes are not traced: a probe every few seconds would bury the requests.
    assert not receiver.named("GET /healthz")

    # The worker's JSON log lines written inside the job carry its trace and span.
    lines = [json.loads(line) for line in worker.log().splitlines() if line.startswith("{")]
    joined = [line for line in lines if line.get("trace_id") == trace]
    assert joined and {line["span_id"] for line in joined} <= set(spans), joined
    assert all(line["node"] == worker.hostname for line in lines)


def test_a_job_deferred_under_its_tenants_cap_and_released_later_continues_its_trace(
    settings: Settings,
    start_worker: Callable[..., WorkerProcess],
    start_gateway: Callable[..., GatewayProcess],
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    # One tenant, one job in flight at a time: of three requests at once, two wait in the tenant's place
    # and a worker's releaser sends them later. The released message carries the trace the gateway's
    # send started, as a message sent at once does, not a trace of its own.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    settings = settings.replace(engine=faulty_engine, tenant_max_in_flight=1, max_batch=1)
    start_worker(settings)
    gateway = start_gateway(settings)
    token = api_key(settings)

    def speak(number: int) -> int:
        body = {
            "model": "tts-1",
            "voice": "alloy",
            "input": f"[slow] Capped sentence {number}.",
            "response_format": "wav",
        }
        headers = {"Authorization": f"Bearer {token}"}
        return httpx.post(f"{gateway.url}/v1/audio/speech", headers=headers, json=body, timeout=90).status_code

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        assert list(pool.map(speak, range(3))) == [200, 200, 200]
    wait_until(lambda: len(receiver.named("ttsq.synthesize")) >= 3, 20, "every job's task span")
    with receiver.lock:
        deferred = [s for s in receiver.spans if s.attributes.get("ttsq.deferred") is True]
        tasks = [s for s in receiver.spans if s.name == "ttsq.synthesize"]
    assert deferred, "no job waited for its tenant's turn"
    for span in deferred:
        (task,) = [t for t in tasks if t.trace_id == span.trace_id]  # the released job's task, in its trace
        assert span.name == "ttsq.send" and task.parent_id == span.span_id


@pytest.mark.slow  # a document through a gateway and a worker: the single-request trace is the inner loop's
def test_a_document_fans_out_and_stitches_in_the_trace_of_its_request(
    settings: Settings,
    start_worker: Callable[..., WorkerProcess],
    start_gateway: Callable[..., GatewayProcess],
    receiver: Receiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.url)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    settings = settings.replace(max_text_chars=60)  # longer than one job: a document
    start_worker(settings)
    gateway = start_gateway(settings)
    text = f"{SECRET}. The second sentence is here. And a third one closes the document."
    answer = httpx.post(
        f"{gateway.url}/v1/audio/speech",
        headers={"Authorization": f"Bearer {api_key(settings)}"},
        json={"model": "tts-1", "voice": "alloy", "input": text, "response_format": "wav"},
        timeout=90,
    )
    assert answer.status_code == 200, answer.text
    wait_until(
        lambda: bool(receiver.named("ttsq.stitch")) and bool(receiver.named("POST /v1/audio/speech")),
        20,
        "the stitch's and the request's spans",
    )
    (request,) = receiver.named("POST /v1/audio/speech")
    trace = request.trace_id
    wait_until(lambda: len([s for s in receiver.named("ttsq.upload") if s.trace_id == trace]) >= 3, 10, "every upload")
    spans = {s.span_id: s for s in receiver.spans if s.trace_id == trace}
    names = [s.name for s in spans.values()]
    (fan_out,) = [s for s in spans.values() if s.name == "ttsq.document"]
    (stitch,) = [s for s in spans.values() if s.name == "ttsq.stitch"]
    chunks = [s for s in spans.values() if s.name == "ttsq.synthesize"]
    assert len(chunks) >= 2 and fan_out.attributes["ttsq.chunks"] == len(chunks), names
    assert {chunk.parent_id for chunk in chunks} == {fan_out.span_id}  # each chunk's message carried the fan-out
    assert stitch.parent_id == fan_out.span_id
    assert [s.name for s in spans.values() if s.parent_id == stitch.span_id and s.name == "ttsq.upload"]
    with receiver.lock:
        values = [str(v) for s in receiver.spans for v in s.attributes.values()]
    assert not [v for v in values if SECRET in v or "second sentence" in v]


@pytest.mark.slow
def test_the_tracing_benchmark_runs(tmp_path: Path) -> None:
    """``benchmarks/tracing.py --tiny``: one pair, the on run's processes export to the receiver and the
    off run's export nothing (so the figure compares tracing on with tracing off)."""
    script = Path(__file__).parent.parent / "benchmarks" / "tracing.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTSQ_", "OTEL_"))}
    out = subprocess.run(
        [sys.executable, str(script), "--tiny", "--json", str(tmp_path / "figures.json")],
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    (pair,) = figures["pairs"]
    assert pair["off"]["jobs_per_s"] > 0 and pair["on"]["jobs_per_s"] > 0
    assert pair["off"]["exports"] == 0 and pair["on"]["exports"] > 0
    assert figures["exported"]["bytes"] > 0 and "tracing on / off" in out.stdout.decode()
