"""Take docs/flower-tasks.png: a real fleet on loopback, a burst of jobs, Flower, headless Chromium.

Run from the repository root with the test extra installed and Chromium on PATH
(``apt-get install chromium``)::

    .venv/bin/python docs/flower_screenshot.py

It starts a throwaway redis-server, moto's S3 server, ``ttsq worker --devices cpu:2`` and ``ttsq
flower`` (basic auth), submits a burst, waits for Flower to list it, and screenshots the task page.
Then it prints ``ttsq stats`` for the same fleet. Everything is stopped on the way out.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from moto.server import ThreadedMotoServer

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.redis_server import RedisServer, free_port

ROOT = Path(__file__).parent.parent
AUTH = "ops:screenshot"


def main() -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        sys.exit("chromium not found: apt-get install chromium")
    os.environ.update(
        AWS_ACCESS_KEY_ID="screenshot", AWS_SECRET_ACCESS_KEY="screenshot", AWS_DEFAULT_REGION="us-east-1"
    )
    redis_server = RedisServer().start()
    s3_port = free_port()
    s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port)
    s3.start()
    import boto3

    boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3_port}").create_bucket(Bucket="ttsq-docs")
    settings = Settings(
        broker_url=f"{redis_server.url}/0",
        result_backend=f"{redis_server.url}/1",
        cache_url=f"{redis_server.url}/2",
        storage_url="s3://ttsq-docs/audio",
        s3_endpoint_url=f"http://127.0.0.1:{s3_port}",
        s3_region="us-east-1",
        metrics_port=free_port(),
    )
    env = {**os.environ, **settings.to_env(), "FLOWER_BASIC_AUTH": AUTH}
    flower_port = free_port()
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "worker", "--devices", "cpu:2", "-n", "docs"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
        subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "flower", "--address", "127.0.0.1", "--port", str(flower_port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ),
    ]
    try:
        _wait(lambda: _get(flower_port, "/healthcheck") == "OK")
        time.sleep(8)  # both workers warm
        client = Client(settings)
        sentences = [
            "Hello from ttsq.",
            "안녕하세요. 티티에스큐 음성 합성입니다.",
            "The queue keeps moving.",
            "Batches of up to eight jobs share one pass.",
            "Every result is cached by content.",
        ]
        formats = ["wav", "ogg", "mp3", "flac", "wav"]
        jobs = [
            client.submit(f"{sentence} ({i})", language="auto", format=fmt)
            for i in range(4)
            for sentence, fmt in zip(sentences, formats, strict=True)
        ]
        for job in jobs:
            job.wait(timeout=120)
        client.submit(sentences[0] + " (0)")  # a producer cache hit: never reaches Flower
        _wait(
            lambda: (
                sum(t["state"] == "SUCCESS" for t in json.loads(_get(flower_port, "/api/tasks")).values()) >= len(jobs)
            )
        )
        out = ROOT / "docs" / "flower-tasks.png"
        with tempfile.TemporaryDirectory() as profile:
            subprocess.run(
                [
                    chromium,
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    f"--user-data-dir={profile}",
                    "--window-size=1600,900",
                    "--virtual-time-budget=5000",
                    f"--screenshot={out}",
                    f"http://{AUTH}@127.0.0.1:{flower_port}/tasks",
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
        print(f"wrote {out}")
        print(
            subprocess.run(
                [sys.executable, "-m", "ttsq.cli.main", "stats"], env=env, capture_output=True, text=True, timeout=60
            ).stdout
        )
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
        s3.stop()
        redis_server.stop()


def _get(port: int, path: str) -> str:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    request.add_header("Authorization", "Basic " + base64.b64encode(AUTH.encode()).decode())
    with urllib.request.urlopen(request, timeout=10) as response:
        return str(response.read().decode())


def _wait(ready: object, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if callable(ready) and ready():
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("not ready in time")


if __name__ == "__main__":
    main()
