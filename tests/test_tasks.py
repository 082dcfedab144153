"""The tasks a worker registers: the task contract and the events Flower reads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from support import WorkerProcess

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import TASK_NAME
from ttsq.errors import InvalidRequest
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
