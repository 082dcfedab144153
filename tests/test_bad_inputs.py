"""The whole bad-input corpus, sent straight to a real worker in the middle of a burst of good jobs.

Each case gets its clear error (or a sane result), the worker keeps running, no good neighbour is
affected, nothing bad is left on the queue to be redelivered, and the worker's log holds neither
the input text nor a presigned URL.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from bad_inputs import ALL_CASES, send_raw
from support import WorkerProcess, queue_length, s3_keys, wait_until

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.errors import EngineError, InvalidRequest

StartWorker = Callable[..., WorkerProcess]
#: A word that appears in every good text: it must never reach the log.
MARKER = "Zanzibarian"


def outcome(app: Any, task_id: str, timeout: float) -> tuple[str, Any]:
    """('SUCCESS', result) or ('FAILURE', exception); ('PENDING', None) if none arrived in time."""
    async_result = app.AsyncResult(task_id)
    try:
        return "SUCCESS", async_result.get(timeout=timeout)
    except Exception as exc:
        from celery.exceptions import TimeoutError as CeleryTimeout

        if isinstance(exc, CeleryTimeout):
            return "PENDING", None
        return "FAILURE", exc


@pytest.mark.slow
def test_bad_messages_mixed_into_a_burst_do_not_affect_their_neighbours(
    settings: Settings, start_worker: StartWorker
) -> None:
    settings = settings.replace(url_expiry_s=777)  # presigned URLs must carry the expiry from settings
    worker = start_worker(settings)
    app = make_app(settings)
    client = Client(settings, app=app)
    assert len(ALL_CASES) >= 25
    good: list[tuple[str, Any]] = []
    bad: list[tuple[dict[str, Any], str]] = []
    for i, case in enumerate(ALL_CASES):
        text = f"{MARKER} neighbour number {i} says hello."
        good.append((text, client.submit(text)))
        bad.append((case, send_raw(app, settings.queue, case)))

    for text, job in good:  # every neighbour: its own, correct result
        result = job.wait(timeout=60)
        assert not result["cached"] and result["duration_s"] > 0, text
        assert "X-Amz-Expires=777" in result["url"] and result["url_expires_s"] == 777
        assert MARKER not in json.dumps(result)  # no input text in results
    for case, task_id in bad:
        expected = case.get("outcome", f"InvalidRequest:{case.get('field')}")
        state, value = outcome(app, task_id, timeout=2 if expected == "dropped" else 30)
        name = case["name"]
        if expected == "result":
            assert state == "SUCCESS" and value["duration_s"] > 0, name
        elif expected == "EngineError":
            assert state == "FAILURE" and isinstance(value, EngineError) and str(value), (name, value)
        elif expected.startswith("InvalidRequest:"):
            assert state == "FAILURE" and isinstance(value, InvalidRequest), (name, value)
            assert value.field == expected.split(":", 1)[1], name
        elif expected == "failure":
            assert state == "FAILURE" and str(value), (name, value)
        else:
            assert expected == "dropped" and state == "PENDING", (name, state, value)

    # The worker survived all of it and still serves, nothing is left to be redelivered ...
    assert worker.process is not None and worker.process.poll() is None
    assert client.submit(f"{MARKER}: still serving after the corpus.").wait(timeout=30)["duration_s"] > 0
    # One message was once found left here. Its likeliest sender, the sweeper taking a job a worker had
    # just popped for lost, is fixed (tests/test_send.py, test_a_job_a_worker_has_just_popped_is_not_sent_again);
    # should it happen again, the assertion names the message.
    assert queue_length(settings) == 0, left_in_queue(settings)
    # With late acks a job's result is stored before its message is acknowledged: the last job's ack
    # follows its result by a moment.
    broker = redis.Redis.from_url(settings.broker_url)
    wait_until(lambda: broker.hlen("unacked") == 0, 30, "every message acknowledged")
    # ... one object per good or sane job ...
    sane = sum(1 for case in ALL_CASES if case.get("outcome") == "result")
    assert len(s3_keys(settings)) == len(good) + sane + 1
    # ... and the log (INFO and above) never shows the input text, a bad body or a presigned URL.
    assert worker.stop() == 0
    log = worker.log()
    assert "succeeded" in log and "InvalidRequest" in log and "dead-lettered" in log
    assert MARKER not in log and "Sohee" not in log and "<speak>" not in log and "café" not in log
    assert "X-Amz-Signature" not in log and "Signature=" not in log
    client.close()


@pytest.mark.parametrize("case", [c for c in ALL_CASES if "raw" in c and "pickle" in c["raw"]], ids=lambda c: c["name"])
def test_a_pickle_message_from_the_corpus_is_refused(
    settings: Settings, start_worker: StartWorker, case: dict[str, Any]
) -> None:
    worker = start_worker(settings)
    send_raw(make_app(settings), settings.queue, case)
    deadline = time.monotonic() + 30
    while "refused (encoding: content type 'application/x-python-serialize'" not in worker.log():
        assert time.monotonic() < deadline, worker.log()
        time.sleep(0.05)
    assert queue_length(settings) == 0


def left_in_queue(settings: Settings) -> list[dict[str, Any]]:
    """The task id, task and ttsq headers of each message still in this test's queue (never a body)."""
    import redis as redis_py

    client = redis_py.Redis.from_url(settings.broker_url)
    try:
        found = []
        for raw in client.lrange(settings.queue, 0, -1):
            try:
                headers = json.loads(raw).get("headers") or {}
                found.append(
                    {name: value for name, value in headers.items() if name in ("id", "task") or "ttsq" in name}
                )
            except (ValueError, AttributeError):
                found.append({"unparsed": len(raw)})
        return found
    finally:
        client.close()
