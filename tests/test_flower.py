"""Flower, started with ``ttsq flower`` and basic auth, shows every job of a burst, never its text."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support import Flower, WorkerProcess, listening_on, run_cli

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.redis_server import free_port
from ttsq.redaction import describe_kwargs, redact_result

StartWorker = Callable[..., WorkerProcess]


@pytest.fixture
def flower(settings: Settings, tmp_path: Path) -> Iterator[Flower]:
    server = Flower(settings, tmp_path / "flower.log")
    yield server
    server.stop()


@pytest.mark.slow
def test_flower_lists_a_burst_with_workers_and_no_text(
    settings: Settings, start_worker: StartWorker, flower: Flower
) -> None:
    start_worker(settings, name="w1")
    start_worker(settings, name="w2")
    secret = "The board approves the confidential Nightjar merger on Tuesday"
    client = Client(settings)
    jobs = [client.submit(f"{secret}, item {i}.", format="mp3") for i in range(20)]
    # A web backend's raw send_task: Celery's default kwargsrepr holds the whole text.
    raw = make_app(settings).send_task("ttsq.synthesize", kwargs={"text": f"{secret}, sent raw."}, queue=settings.queue)
    ids = {job.id for job in jobs} | {raw.id}
    results = [job.wait(timeout=120) for job in jobs] + [raw.get(timeout=120)]

    with pytest.raises(urllib.error.HTTPError) as denied:
        flower.get("/api/tasks", auth=False)
    assert denied.value.code == 401
    assert listening_on(flower.port) == {"127.0.0.1"}  # `ttsq flower` binds loopback unless told

    deadline = time.monotonic() + 60
    while True:
        tasks: dict[str, Any] = json.loads(flower.get("/api/tasks?limit=1000"))
        ours = {task_id: task for task_id, task in tasks.items() if task_id in ids}
        if len(ours) == len(ids) and all(t["state"] == "SUCCESS" and t["worker"] for t in ours.values()):
            break
        assert time.monotonic() < deadline, f"Flower saw {len(ours)} of {len(ids)} jobs: {ours}"
        time.sleep(0.5)
    assert {task["worker"] for task in ours.values()} == {"w1@test", "w2@test"}
    assert all(task["name"] == "ttsq.synthesize" and task["runtime"] > 0 for task in ours.values())
    assert {task["worker"] for task in ours.values()} >= {r["worker"] for r in results}

    # Everything Flower says about these jobs, its API and its pages: no text, no signed URL.
    pages = [json.dumps(tasks), flower.get("/api/workers?refresh=1"), flower.get("/tasks"), flower.get("/workers")]
    pages += [flower.get(f"/api/task/info/{task_id}") for task_id in ids]
    pages += [flower.get(f"/task/{task_id}") for task_id in ids]
    for page in pages:
        assert "Nightjar" not in page and "confidential" not in page
        assert "Signature" not in page and results[0]["url"].split("?")[0] not in page
    info = json.loads(flower.get(f"/api/task/info/{raw.id}"))
    assert info["kwargs"] == "text=<73 chars>" and "<url>" in info["result"]


def test_flower_refuses_to_start_without_auth_unless_told(settings: Settings) -> None:
    out = run_cli("flower", "--port", str(free_port()), settings=settings)
    assert out.returncode == 2
    assert b"FLOWER_BASIC_AUTH" in out.stderr and b"--no-auth" in out.stderr


def test_redaction_of_kwargs_and_results() -> None:
    summary = describe_kwargs(
        {
            "text": "Hello there, secret person",
            "language": "korean",
            "instruct": "calm",
            "seed": 7,
            "format": "mp3",
            "top_p": 0.9,
        }
    )
    assert summary == "format=mp3 instruct=<4 chars> language=korean seed=7 text=<26 chars> top_p=0.9"
    assert describe_kwargs(["not", "a", "dict"]) == "<redacted>"
    result = "{'key': 'ab12', 'url': 'http://s3/x.wav?X-Amz-Signature=abc', 'duration_s': 1.5}"
    assert redact_result(result) == "{'key': 'ab12', 'url': '<url>', 'duration_s': 1.5}"
    assert "Signature" not in redact_result("{'key': 'ab', 'url': 'http://s3/x.wav?X-Amz-Signature=a")
