"""Records read back from Redis are data, not paths; failures are typed and quiet.

A result record (the result backend) and a cache index entry are written by ttsq, but anyone who can
write to Redis can forge one. Nothing ttsq reads back may make it read or write a file it would not
write itself: the object key must be one of ttsq's own, and the URL is signed again, never taken from
the record.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from support import WorkerProcess, run_cli

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import CACHE_PREFIX
from ttsq.errors import CorruptRecord, InvalidRequest

StartWorker = Callable[..., WorkerProcess]


def forge(settings: Settings, task_id: str, result: Any, status: str = "SUCCESS") -> None:
    """Write a result record by hand, as one with write access to the result backend could."""
    meta = {
        "status": status,
        "result": result,
        "traceback": None,
        "children": [],
        "date_done": "2026-12-01T00:00:00",
        "task_id": task_id,
    }
    client = redis.Redis.from_url(settings.result_backend)
    try:
        client.set(f"celery-task-meta-{task_id}", json.dumps(meta))
    finally:
        client.close()


@pytest.fixture
def local(settings: Settings, tmp_path: Path) -> Settings:
    return settings.replace(storage_url=str(tmp_path / "audio"))


def test_a_forged_result_cannot_point_the_cli_or_the_client_at_a_file(
    local: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(local)
    with Client(local) as client:
        real = client.submit("A real result to copy.").wait(timeout=60)
    secret = tmp_path / "secret.txt"
    secret.write_text("not audio")
    forged_id = str(uuid.uuid4())
    forge(local, forged_id, {**real, "object_key": f"../../../../../../..{secret}", "url": secret.as_uri()})
    out = tmp_path / "out.wav"
    result = run_cli("result", forged_id, "-o", str(out), settings=local)
    assert result.returncode == 1 and b"refused object_key" in result.stderr, result.stderr
    assert not out.exists()
    with Client(local) as client, pytest.raises(CorruptRecord) as info:
        client.wait(forged_id, timeout=10)
    assert info.value.field == "object_key"


def test_a_forged_url_is_never_used_the_url_is_signed_again(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    with Client(settings) as client:
        real = client.submit("A real result with a forged URL.").wait(timeout=60)
    forged_id = str(uuid.uuid4())
    forge(settings, forged_id, {**real, "url": "file:///etc/hostname"})
    out = tmp_path / "out.wav"
    shown = run_cli("result", forged_id, "-o", str(out), "--json", settings=settings)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["url"].startswith(settings.s3_endpoint_url)
    with Client(settings) as client:
        assert out.read_bytes() == client.download(real)  # read through ttsq's storage


def test_the_stitch_refuses_a_forged_index_entry(local: Settings, start_worker: StartWorker) -> None:
    start_worker(local)
    chunk = "a" * 64
    entry = {
        "object_key": "../../outside.wav",
        "format": "wav",
        "content_type": "audio/wav",
        "sample_rate": 22050,
        "duration_s": 1.0,
        "bytes": 10,
        "engine": "espeak",
        "model": "espeak-ng",
        "model_revision": "x",
        "truncated": False,
        "ignored": [],
    }
    redis.Redis.from_url(local.cache_url).set(CACHE_PREFIX + chunk, json.dumps(entry))
    plan = {
        "key": "b" * 64,
        "format": "wav",
        "seed": 1,
        "characters": 5,
        "options": {
            "target_chars": 200,
            "max_chars": 400,
            "sentence_pause_ms": 250,
            "paragraph_pause_ms": 700,
            "crossfade_ms": 40,
        },
        "chunks": [{"key": chunk, "start": 0, "end": 5, "boundary": "end", "sentences": [[0, 5, 1.0]]}],
    }
    app = make_app(local)
    with pytest.raises(CorruptRecord) as info:
        app.send_task("ttsq.stitch", args=[[]], kwargs={"plan": plan}, queue=local.queue).get(timeout=60)
    assert info.value.field == "object_key"
    bad_plan = {**plan, "key": "../../x"}
    with pytest.raises(InvalidRequest) as refused:
        app.send_task("ttsq.stitch", args=[[]], kwargs={"plan": bad_plan}, queue=local.queue).get(timeout=60)
    assert refused.value.field == "plan.key"  # the field inside the plan, named
    app.close()


def test_status_of_a_result_it_cannot_read_says_so(settings: Settings) -> None:
    task_id = str(uuid.uuid4())
    redis.Redis.from_url(settings.result_backend).set(f"celery-task-meta-{task_id}", b"\xff not json")
    out = run_cli("status", task_id, settings=settings)
    assert out.returncode == 1
    assert b"cannot be read" in out.stderr and b"cannot reach" not in out.stderr, out.stderr


def test_a_refused_request_is_one_warning_line_and_its_result_holds_no_traceback(
    settings: Settings, start_worker: StartWorker
) -> None:
    worker = start_worker(settings)
    app = make_app(settings)
    sent = app.send_task("ttsq.synthesize", kwargs={"text": "fine", "language": "klingon"}, queue=settings.queue)
    with pytest.raises(InvalidRequest) as info:
        sent.get(timeout=60)
    assert info.value.field == "language"
    meta = json.loads(redis.Redis.from_url(settings.result_backend).get(f"celery-task-meta-{sent.id}") or b"{}")
    assert meta["status"] == "FAILURE" and meta["traceback"] is None
    assert meta["result"]["exc_type"] == "InvalidRequest"
    worker.stop()
    lines = [line for line in worker.log().splitlines() if sent.id in line and "InvalidRequest" in line]
    assert lines and all(" WARNING " in line for line in lines), lines
    assert "Traceback" not in worker.log()
    app.close()


def test_a_charge_writes_the_refunds_handed_over_before_it(settings: Settings) -> None:
    """The batcher hands refunds to a thread (``refund_soon``) and goes on to the next engine call. A
    call that kills the worker must not find a job whose call returned before it still charged: that
    job, redelivered, would count an attempt it never had (an innocent neighbour of a poison job was
    parked so). Right after the next charge returns, every earlier refund is in Redis."""
    from ttsq.records.owner import RedisOwner

    owner = RedisOwner(settings, role="test")
    ledger = owner.attempts
    try:
        for _ in range(200):
            returned, crashing = str(uuid.uuid4()), str(uuid.uuid4())
            assert ledger.charge(returned) == 1
            ledger.refund_soon(returned)
            assert ledger.charge(crashing) == 1
            assert ledger.attempts(returned) == 0
    finally:
        ledger.flush_refunds()
        owner.close()
