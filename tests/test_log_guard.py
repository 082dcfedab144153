"""The log guard (``ttsq.logs``) against real processes: hostile values sent the ways an outsider can
(a Celery message's ``tracestate``, ``traceparent``, task id, task name and other headers; an HTTP
request's path, headers and fields), then the log files of a worker, a gateway and a launcher read back.

What must hold in each file: no line begins with injected text, and no byte below 0x20 but the newline
(nor a C1 control or a line separator) is in it. Each test also finds the injected text in the log,
escaped: the process did log it, so the test fails where the guard is missing (OpenTelemetry logs an
invalid ``tracestate`` member verbatim; before the guard its newline started a forged line).
"""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support import GatewayProcess, Launcher, WorkerProcess, api_key, wait_until

from ttsq.app import make_app
from ttsq.config import Settings
from ttsq.logs import escape
from ttsq.records.deadletters import DeadLetters

#: What a forged line would begin with: a record of the worker's own format, dated in the past.
FORGED = "2026-01-01 00:00:00,000 CRITICAL MainProcess forged"
#: A valid W3C traceparent: OpenTelemetry reads the tracestate beside it only when this one is valid.
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
#: Invalid tracestate members, which OpenTelemetry's parser logs as they are.
TRACESTATES = [
    f"a=b\n{FORGED}",
    f"a=b\r{FORGED}",
    "a=\x1b[31mred",
    "a=\x9b31m\x85next\u2028line",
    "a=\ud800lone",  # a lone surrogate once JSON decodes it: a UTF-8 stream cannot write it
]


def assert_guarded(log: bytes, *, logged: list[str]) -> None:
    """No line begins with injected text, no control character but the newline is in the file, and
    each of ``logged`` (as the guard escapes it) is: the process logged what it was sent."""
    controls = sorted({f"0x{byte:02x}" for byte in log if byte < 0x20 and byte != 0x0A})
    assert not controls, f"control bytes in the log: {controls}"
    text = log.decode("utf-8")
    others = sorted({f"U+{ord(c):04X}" for c in text if 0x7F <= ord(c) <= 0x9F or c in "\u2028\u2029"})
    assert not others, f"C1 controls or line separators in the log: {others}"
    forged = [line for line in text.split("\n") if line.startswith(FORGED[:10])]
    assert not forged, f"forged lines: {forged}"
    for value in logged:
        assert value in text, f"{value!r} is not in the log"


@pytest.fixture
def traced(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Traces on in the processes the test starts (the standard ``OTEL_*`` variables), exported to a
    receiver on loopback that takes every span and keeps none."""
    pytest.importorskip("opentelemetry.sdk.trace", reason="the extra ttsq[otel] is not installed")

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, name="otlp-sink", daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER"):
        monkeypatch.delenv(name, raising=False)
    yield
    server.shutdown()
    server.server_close()
    thread.join(10)


def send_hostile_messages(settings: Settings) -> list[str]:
    """Jobs whose trace headers, id, task name and other headers are hostile; wait until each ran or
    was dead-lettered. Returns what the worker must have logged (escaped)."""
    app = make_app(settings)
    try:
        runs = [
            app.send_task(
                "ttsq.synthesize",
                kwargs={"text": f"A guarded line, number {n}."},
                queue=settings.queue,
                headers={"traceparent": TRACEPARENT, "tracestate": state, "origin": f"o\n{FORGED}"},
            )
            for n, state in enumerate(TRACESTATES)
        ]
        runs += [
            app.send_task(
                "ttsq.synthesize",
                kwargs={"text": "A guarded line with a broken traceparent."},
                queue=settings.queue,
                headers={"traceparent": f"{TRACEPARENT}\n{FORGED}", "x_note": f"\x1b[2J{FORGED}"},
            )
        ]
        hostile_id = f"id\n{FORGED}"
        refused = [
            app.send_task("ttsq.synthesize", kwargs={"text": "Refused."}, queue=settings.queue, task_id=hostile_id),
            app.send_task(f"ttsq.synthesize\n{FORGED}", kwargs={"text": "Refused."}, queue=settings.queue),
        ]
        for run in runs:
            run.get(timeout=60)
        letters = DeadLetters(redis.Redis.from_url(settings.broker_url))
        wait_until(lambda: len(letters.letters()) == len(refused), 30, "the refused messages dead-lettered")
    finally:
        app.close()
    # OpenTelemetry logs a member: the header up to its first comma.
    return [escape(state.split(",")[0]) for state in TRACESTATES] + [escape(hostile_id)]


def test_a_workers_log_holds_no_forged_line_and_no_control_character(
    settings: Settings, start_worker: Callable[..., WorkerProcess], traced: None
) -> None:
    worker = start_worker(settings)
    logged = send_hostile_messages(settings)
    assert_guarded(worker.log_path.read_bytes(), logged=logged)


def raw_request(gateway: GatewayProcess, request: bytes) -> bytes:
    """One HTTP/1.1 request written as bytes on a socket (no client library to clean it); its answer."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def test_a_gateways_log_holds_no_forged_line_and_no_control_character(
    settings: Settings, start_gateway: Callable[..., GatewayProcess], traced: None
) -> None:
    gateway = start_gateway(settings)
    token = api_key(settings)
    member = "a=\x9b31m\x85next"
    # Header values may carry any byte from 0x80 up (obs-text): C1 controls once decoded as latin-1.
    for path in ("/v1/models", "/v1/jobs/x"):
        answer = raw_request(
            gateway,
            f"GET {path} HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {token}\r\ntraceparent: {TRACEPARENT}\r\n"
            f"tracestate: {member}\r\nUser-Agent: ua\x9b\x85\r\nConnection: close\r\n\r\n".encode("latin-1"),
        )
        assert answer.startswith((b"HTTP/1.1 200", b"HTTP/1.1 404")), answer[:100]
    # A request target with such bytes (uvicorn refuses it before its access log), and newlines in the
    # path's ids and in the request's fields (percent-encoded, or in JSON).
    raw_request(gateway, b"GET /v1/jobs/\x9b31m\x85x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    auth = {"Authorization": f"Bearer {token}"}
    httpx.get(f"{gateway.url}/v1/jobs/id%0A{FORGED.replace(' ', '%20')}", headers=auth, timeout=30)
    httpx.post(
        f"{gateway.url}/v1/audio/speech",
        json={"model": f"m\n{FORGED}", "voice": f"v\x1b[2J\n{FORGED}", "input": "Hi.", "response_format": "x\n"},
        headers={**auth, "X-Request-Id": "r\x85".encode("latin-1")},
        timeout=30,
    )
    gateway.stop()
    assert_guarded(gateway.log_path.read_bytes(), logged=[escape(member)])


@pytest.mark.slow
def test_a_launchers_log_holds_no_forged_line_and_no_control_character(
    settings: Settings, tmp_path: Path, traced: None
) -> None:
    """The launcher's log holds its own lines and its workers' (JSON lines here)."""
    settings = settings.replace(log_format="json")
    launcher = Launcher(settings, "cpu:1", tmp_path / "launcher.log")
    try:
        launcher.wait_ready(["cpu0@test"])
        logged = send_hostile_messages(settings)
    finally:
        launcher.stop()
    log = launcher.log_path.read_bytes()
    assert_guarded(log, logged=[json.dumps(value)[1:-1] for value in logged])
    lines = [line for line in log.decode().split("\n") if line.startswith("{")]
    assert lines and all(json.loads(line) for line in lines)


def test_a_traceback_stays_readable_and_starts_no_line(tmp_path: Path) -> None:
    """An exception's message cannot start a line: the traceback's lines are indented under its record."""
    log = tmp_path / "process.log"
    code = f"""
import logging
from ttsq.logs import guard_logs
guard_logs()
logging.basicConfig(filename={str(log)!r}, format="%(levelname)s %(name)s: %(message)s")
try:
    raise ValueError("bad\\n{FORGED}\\x1b[2J")
except ValueError:
    logging.getLogger("probe").exception("failed on %s", "arg\\n{FORGED}")
logging.getLogger("probe").warning("stack", stack_info=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    assert_guarded(log.read_bytes(), logged=[escape(f"failed on arg\n{FORGED}")])
    lines = text.split("\n")
    assert lines[0] == "ERROR probe: " + escape(f"failed on arg\n{FORGED}")
    assert lines[1] == "    Traceback (most recent call last):"
    assert f"    ValueError: bad\n    {FORGED}\\x1b[2J" in text
    heads = [line for line in lines if line and not line.startswith(" ")]
    assert heads == [lines[0], "WARNING probe: stack"]


def test_the_guard_escapes_every_control_character() -> None:
    assert escape("plain text, ünïcode and emoji 🎙") == "plain text, ünïcode and emoji 🎙"
    assert escape("a\nb\rc\td\x00e\x1bf\x7fg\x85h\x9bi\u2028j\u202ek\ud800l") == (
        "a\\nb\\rc\\td\\x00e\\x1bf\\x7fg\\x85h\\x9bi\\u2028j\\u202ek\\ud800l"
    )
