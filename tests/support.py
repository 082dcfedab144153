"""What the tests share, beside the fixtures in conftest.py: real processes, waiting, and looking.

Every helper here starts, stops or reads only what the calling test created: its own worker
processes, its own queue, its own S3 prefix, its own Redis databases (the suite's redis-server is
started per test process; see conftest.py).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest
import redis
import soundfile
from prometheus_client.parser import text_string_to_metric_families

from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX, WORKER_PREFIX
from ttsq.ops.redis_server import free_port
from ttsq.records.connection import connect

#: The S3 bucket the suite's moto server holds; each test writes under its own prefix.
BUCKET = "ttsq-test"
# Input text that tests send through gateways and workers; the fixtures that started them check that
# no log line of theirs holds it (with signed URLs and API keys).
SECRET = "The Heron account closes on the ninth"
TESTS = Path(__file__).parent


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *, interval: float = 0.05) -> None:
    """Poll ``condition`` until it holds; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


def stop_process(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
    """Stop a process this test started: ``sig`` first, SIGKILL if it is still there after ``timeout``."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)


def late_reader(
    worker: subprocess.Popen[bytes],
    gateway: subprocess.Popen[bytes],
    start_reader: Callable[[], None],
    reader_open: Callable[[], bool],
    stream_written: Callable[[], bool],
) -> None:
    """Make a gateway's reader late, with no race: the worker paused (SIGSTOP) before the reader opens,
    so the job waits and the reader stays open on a stream not begun (a clip made faster than a scrape
    would open and close between two); then the gateway paused while the worker writes and trims the
    whole stream, and resumed once ``stream_written`` holds."""
    worker.send_signal(signal.SIGSTOP)
    try:
        start_reader()
        wait_until(reader_open, 30, "the reader open")
        gateway.send_signal(signal.SIGSTOP)
    finally:
        worker.send_signal(signal.SIGCONT)
    try:
        wait_until(stream_written, 60, "the job's whole stream written while the gateway is paused")
    finally:
        gateway.send_signal(signal.SIGCONT)


def settings_env(settings: Settings) -> dict[str, str]:
    """The TTSQ_* environment that reproduces ``settings`` in a subprocess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    for field in fields(settings):
        env[f"TTSQ_{field.name.upper()}"] = str(getattr(settings, field.name))
    return env


class WorkerProcess:
    """``ttsq worker`` as a subprocess, the way an operator runs it."""

    def __init__(self, settings: Settings, log_path: Path, hostname: str) -> None:
        self.settings = settings
        self.log_path = log_path
        self.hostname = hostname
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 60.0) -> WorkerProcess:
        cache = connect(self.settings.cache_url, settings=self.settings)  # a redis:// or sentinel:// URL
        # Ready means announced and beating: the fleet key alone may be a sibling worker's re-announcement.
        # Both keys are this test's own: its queue names the fleet key, its host name the heartbeat.
        ready = (FLEET_PREFIX + self.settings.queue, WORKER_PREFIX + self.hostname)
        cache.delete(*ready)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", self.hostname],
                env=settings_env(self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        try:
            # The worker announces its model after loading and warming the engine, just before consuming.
            while cache.exists(*ready) < len(ready):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"worker did not start:\n{self.log()}")
                time.sleep(0.05)
        finally:
            cache.close()
        return self

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        return stop_process(self.process, sig, timeout)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def run_cli(
    *args: str,
    settings: Settings | None = None,
    input: bytes | None = None,
    timeout: float = 120,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[bytes]:
    """``ttsq ...`` as a real subprocess (argv may hold bytes that are not UTF-8)."""
    base = settings_env(settings) if settings else {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    return subprocess.run(
        [sys.executable, "-m", "ttsq.cli.main", *args],
        env={**base, **(env or {})},
        input=input,
        capture_output=True,
        timeout=timeout,
        cwd=cwd,
    )


def s3_keys(settings: Settings) -> list[str]:
    """The objects under this test's own S3 prefix."""
    import boto3

    bucket, _, prefix = settings.storage_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=settings.s3_endpoint_url)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def queue_length(settings: Settings) -> int:
    """Messages waiting in this test's own queue."""
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return int(client.llen(settings.queue))
    finally:
        client.close()


# -- engines, workers and services that several test modules start ------------------------------

#: The test-only engine that misbehaves on cue (``tests/faulty_engine.py``), loaded through the plug-in path.
FAULTY = "faulty_engine:FaultyEngine"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


AUTH = "ops:flower-test-secret"


def listening_on(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` (Linux: /proc/net/tcp and tcp6)."""
    addresses = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port or len(address) != width:
                continue
            raw = bytes.fromhex(address)
            if width == 8:  # one little-endian 32-bit word
                addresses.add(".".join(str(b) for b in reversed(raw)))
            else:  # four of them
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addresses.add(str(ipaddress.IPv6Address(words)))
    return addresses


class Flower:
    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                # No --address: the default is under test (loopback; ``listening_on`` checks it).
                [sys.executable, "-m", "ttsq.cli.main", "flower", "--port", str(self.port)],
                env={**settings_env(settings), "FLOWER_BASIC_AUTH": AUTH},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 60
        while True:
            try:
                if self.get("/healthcheck", auth=False) == "OK":
                    return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"flower did not start:\n{log_path.read_text()}")
            time.sleep(0.1)

    def get(self, path: str, *, auth: bool = True) -> str:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}")
        if auth:
            request.add_header("Authorization", "Basic " + base64.b64encode(AUTH.encode()).decode())
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.read().decode())

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class Launcher:
    """``ttsq worker --devices ...`` as a subprocess."""

    def __init__(
        self, settings: Settings, devices: str, log_path: Path, *, env: dict[str, str] | None = None, host: str = "test"
    ) -> None:
        self.settings = settings
        self.log_path = log_path
        self.host = host
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ttsq.cli.main", "worker", "--devices", devices, "-n", host],
                env={**settings_env(settings), **(env or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def wait_ready(self, nodes: list[str], timeout: float = 90.0) -> dict[str, int]:
        """Wait for every node's heartbeat (written once its engine is warm); return node -> pid."""
        cache = redis.Redis.from_url(self.settings.cache_url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                beats = {node: cache.get(WORKER_PREFIX + node) for node in nodes}
                if all(beats.values()):
                    return {node: json.loads(raw)["pid"] for node, raw in beats.items() if raw}
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"launcher not ready:\n{self.log()}")
                time.sleep(0.1)
        finally:
            cache.close()

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def wait(self, timeout: float = 90.0) -> int:
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


MAX_FRAMES = 24


SAMPLES_PER_FRAME = 1920


WORKER_START_S = 240.0  # torch import, load and warm-up on a busy two-core machine


def qwen_settings(settings: Settings, model: Path) -> Settings:
    # Generous job limits: a busy two-core machine may take long over a batch, and timing is not under test.
    return settings.replace(
        engine="qwen", qwen_model=str(model), qwen_max_frames=MAX_FRAMES, job_timeout_s=300, visibility_timeout_s=900
    )


def reference_file(path: Path, seconds: float = 1.5) -> Path:
    rate = 16_000
    t = np.arange(int(seconds * rate)) / rate
    soundfile.write(path, (0.3 * np.sin(2 * np.pi * 200 * t)).astype(np.float32), rate)
    return path


def submit_cli(settings: Settings, text: str, *args: str, output: Path) -> dict[str, object]:
    """``ttsq submit`` as a subprocess; also proves the command never imports torch on the way."""
    env = {**settings_env(settings), "PYTHONPROFILEIMPORTTIME": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "ttsq.cli.main", "submit", text, *args, "--json", "-o", str(output), "--timeout", "240"],
        env=env,
        capture_output=True,
        timeout=300,
    )
    imported = [line.rsplit("|", 1)[-1].strip() for line in out.stderr.decode().splitlines() if "|" in line]
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert not [name for name in imported if name.split(".")[0] in {"torch", "transformers", "qwen_tts"}]
    result: dict[str, object] = json.loads(out.stdout)
    return result


class GatewayProcess:
    """``ttsq serve`` as a subprocess on a free loopback port, the way an operator runs it."""

    def __init__(self, settings: Settings, log_path: Path) -> None:
        self.log_path = log_path
        # A free port may be taken by another copy of the suite before this gateway binds it; then a
        # healthy answer on it is that copy's gateway. Only this process's own "running on" line counts,
        # and a gateway that could not bind tries another port.
        for _ in range(3):
            if self._start(settings):
                return
        raise RuntimeError(f"gateway did not start:\n{self.log()}")

    def _start(self, settings: Settings) -> bool:
        import httpx

        self.port = free_port()
        self.settings = settings.replace(gateway_port=self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ttsq.cli.main", "serve"],
                env=settings_env(self.settings),
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        running = f"running on {self.url}".encode()
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(self.log_path, "rb") as log:
                    log.seek(logged)
                    mine = running in log.read()
                if mine and httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                return False  # most likely the port was taken: another one
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway did not start:\n{self.log()}")
            time.sleep(0.1)

    def stop(self) -> int:
        return stop_process(self.process)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def api_key(settings: Settings, name: str = "test", **limits: float) -> str:
    """A new API key's token (``ttsq keys add`` does the same)."""
    from ttsq.gateway.apikeys import ApiKeys

    client = connect(settings.cache_url, settings=settings)
    try:
        token, _ = ApiKeys(client).add(f"{name}-{time.monotonic_ns()}", **limits)  # type: ignore[arg-type]
        return token
    finally:
        client.close()


@contextmanager
def published_states(settings: Settings) -> Iterator[list[dict[str, Any]]]:
    """Every task state the result backend publishes while the block runs (this test's Redis only)."""
    listener = redis.Redis.from_url(settings.result_backend).pubsub()
    listener.psubscribe("celery-task-meta-*")
    messages: list[dict[str, Any]] = []
    stop = threading.Event()

    def listen() -> None:
        while not stop.is_set():
            message = listener.get_message(timeout=0.2)
            if message and message["type"] == "pmessage":
                messages.append(json.loads(message["data"]))

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        yield messages
    finally:
        stop.set()
        thread.join(10)
        listener.close()


def missing_tool(message: str) -> NoReturn:
    """A tool a test needs is not installed: a skip on a developer's machine, a failure in CI, where
    ``.ci/run`` and the test extra install every one of them."""
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
