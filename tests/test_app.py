"""The Celery app definition: the settings ttsq's guarantees rest on, and queue routing."""

from __future__ import annotations

from ttsq.app import celery_config, queue_for
from ttsq.config import Settings


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


def test_each_mode_has_its_own_queue_and_voice_design_keeps_the_plain_name() -> None:
    assert queue_for("ttsq", "voice_design") == "ttsq"
    assert queue_for("ttsq", "custom_voice") == "ttsq.custom_voice"
    assert queue_for("ttsq", "voice_clone") == "ttsq.voice_clone"
