"""The Celery app: the settings ttsq's guarantees rest on, the task contract, the events Flower reads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from conftest import WorkerProcess

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import TASK_NAME
from ttsq.errors import InvalidRequest
from ttsq.tasks import celery_config, make_app

StartWorker = Callable[..., WorkerProcess]


def test_json_only_late_acks_and_one_message_per_thread() -> None:
    config = celery_config(Settings(), worker=True)
    for name in ("task_serializer", "result_serializer", "event_serializer"):
        assert config[name] == "json"
    assert config["accept_content"] == config["result_accept_content"] == ["json"]
    assert config["task_acks_late"] is True and config["worker_prefetch_multiplier"] == 1
    assert config["worker_send_task_events"] and config["task_send_sent_event"]
    assert config["result_extended"] is False  # would copy the input text into Redis


def test_visibility_timeout_is_set_in_all_three_places_with_fast_restore() -> None:
    config = celery_config(Settings(visibility_timeout_s=900, job_timeout_s=300), worker=True)
    assert config["visibility_timeout"] == 900
    assert config["broker_transport_options"]["visibility_timeout"] == 900
    assert config["result_backend_transport_options"]["visibility_timeout"] == 900
    # kombu sweeps every interval x throttle seconds: 1 x 1, not the default 10 x 10
    assert config["broker_transport_options"]["unacked_restore_interval"] == 1
    assert config["broker_transport_options"]["unacked_restore_throttle"] == 1


def test_results_expire_and_producers_give_up_on_a_dead_backend_sooner_than_workers() -> None:
    settings = Settings(result_ttl_s=7200)
    worker, producer = celery_config(settings, worker=True), celery_config(settings, worker=False)
    assert worker["result_expires"] == producer["result_expires"] == 7200
    retries = [c["result_backend_transport_options"]["retry_policy"]["max_retries"] for c in (producer, worker)]
    assert retries[0] < retries[1]


def test_the_task_takes_keyword_arguments_only_and_producer_apps_do_not_run_it() -> None:
    task = make_app(Settings()).tasks[TASK_NAME]
    with pytest.raises(InvalidRequest) as info:
        task.run("positional text")
    assert info.value.field == "args"
    with pytest.raises(RuntimeError, match="producer"):
        task.run(text="hello")


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


def test_each_app_runs_its_own_task() -> None:
    """Celery shares decorated tasks across apps by default: a producer app made after a worker app
    must not inherit the worker's callable, nor the other way round."""
    first, second = make_app(Settings()), make_app(Settings())
    assert first.tasks[TASK_NAME] is not second.tasks[TASK_NAME]
    assert type(first.tasks[TASK_NAME]).run is not type(second.tasks[TASK_NAME]).run
