"""The tasks a worker registers: the task contract and the events Flower reads."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from support import WorkerProcess, settings_env, stop_process, wait_until

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import TASK_NAME
from ttsq.errors import InvalidRequest
from ttsq.records.deadletters import DeadLetters
from ttsq.worker.runtime import WorkerRuntime
from ttsq.worker.tasks import worker_app

StartWorker = Callable[..., WorkerProcess]


def test_the_task_takes_keyword_arguments_only_and_producer_apps_do_not_run_it(tmp_path: Path) -> None:
    assert TASK_NAME not in make_app(Settings()).tasks  # producers send by name; only workers register it
    settings = Settings(storage_url=str(tmp_path))
    task = worker_app(settings, WorkerRuntime(settings)).tasks[TASK_NAME]
    with pytest.raises(InvalidRequest) as info:
        task.run("positional text")
    assert info.value.field == "args"


def test_every_job_sends_flower_events(settings: Settings, start_worker: StartWorker) -> None:

    from celery.events import EventReceiver

    app = make_app(settings)
    seen: list[str] = []
    ready = threading.Event()
    receivers: list[EventReceiver] = []

    def listen() -> None:
        with app.connection() as connection:
            receiver = EventReceiver(connection, handlers={"*": lambda event: seen.append(event["type"])}, app=app)
            receivers.append(receiver)
            ready.set()
            receiver.capture(limit=None, timeout=None, wakeup=False)  # until should_stop

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    ready.wait(10)
    start_worker(settings)
    Client(settings, app=app).submit("Watched by Flower.").wait(timeout=30)
    deadline = time.monotonic() + 10
    while "task-succeeded" not in seen and time.monotonic() < deadline:
        time.sleep(0.1)
    receivers[0].should_stop = True
    thread.join(10)
    assert not thread.is_alive()
    assert {"task-sent", "task-received", "task-started", "task-succeeded"} <= set(seen)


def test_each_app_runs_its_own_task(tmp_path: Path) -> None:
    """Celery shares decorated tasks across apps by default: a worker app made after another (tests, the
    embedded mode) must not inherit the first one's callable, nor its runtime."""
    settings = Settings(storage_url=str(tmp_path))
    first, second = worker_app(settings, WorkerRuntime(settings)), worker_app(settings, WorkerRuntime(settings))
    assert first.tasks[TASK_NAME] is not second.tasks[TASK_NAME]
    assert type(first.tasks[TASK_NAME]).run is not type(second.tasks[TASK_NAME]).run
    assert TASK_NAME not in make_app(settings).tasks


#: A user's own Celery module built on ttsq's worker app, run with ``celery -A`` (no consumer named).
PLAIN_APP = """
from ttsq.config import Settings
from ttsq.worker.runtime import WorkerRuntime
from ttsq.worker.tasks import worker_app

settings = Settings.from_env()
runtime = WorkerRuntime(settings)
runtime.start()
app = worker_app(settings, runtime)
"""


def test_any_worker_made_from_the_worker_app_consumes_through_the_gate(settings: Settings, tmp_path: Path) -> None:
    """ttsq's tasks check no message themselves: the gate does, so a worker made from the worker app
    without naming a consumer must get the gated one. A body that is a JSON object once ended every
    Celery worker it reached ("Unrecoverable error"); here it is dead-lettered and the worker serves on."""
    (tmp_path / "plainapp.py").write_text(PLAIN_APP)
    log = tmp_path / "plain.log"
    command = [sys.executable, "-m", "celery", "-A", "plainapp", "worker", "-P", "threads", "-c", "2"]
    command += ["-n", "plain@test", "-Q", settings.queue, "--without-mingle", "--without-gossip", "-l", "INFO"]
    env = settings_env(settings)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    with open(log, "wb") as out:
        process = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    broker = redis.Redis.from_url(settings.broker_url)
    producer = make_app(settings)
    try:
        wait_until(lambda: "ready." in log.read_text(errors="replace"), 60, "the plain worker")
        # A real message, as Celery's producer writes it, with its body made a JSON object.
        producer.send_task(TASK_NAME, kwargs={"text": "x"}, queue="ttsq-hold", task_id="object-body")
        message = json.loads(broker.rpop("ttsq-hold") or b"")
        message["body"] = base64.b64encode(json.dumps({"text": "x"}).encode()).decode()
        broker.lpush(settings.queue, json.dumps(message))
        letters = DeadLetters(broker)
        wait_until(lambda: len(letters.letters()) == 1, 30, "the message in the dead-letter list")
        (letter,) = letters.letters()
        assert (letter.task_id, letter.reason) == ("object-body", "body")
        with Client(settings, app=producer) as client:
            assert client.submit("Served after a body that is an object.").wait(timeout=60)["duration_s"] > 0
        assert process.poll() is None, log.read_text(errors="replace")[-2000:]
    finally:
        producer.close()
        broker.close()
        assert stop_process(process) == 0, log.read_text(errors="replace")[-2000:]
