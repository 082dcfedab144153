"""What the tests share, beside the fixtures in conftest.py: real processes, waiting, and looking.

Every helper here starts, stops or reads only what the calling test created: its own worker
processes, its own queue, its own S3 prefix, its own Redis databases (the suite's redis-server is
started per test process; see conftest.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import redis

from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX, WORKER_PREFIX

#: The S3 bucket the suite's moto server holds; each test writes under its own prefix.
BUCKET = "ttsq-test"
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
