"""A worker's Prometheus endpoint, scraped after a real burst and parsed with the client's own parser."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from support import WorkerProcess, listening_on, scrape, value

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.errors import InvalidRequest
from ttsq.ops.redis_server import free_port
from ttsq.records.owner import RedisOwner
from ttsq.worker.metrics import Metrics

StartWorker = Callable[..., WorkerProcess]


def test_metrics_after_a_burst_add_up(settings: Settings, start_worker: StartWorker) -> None:
    port = free_port()
    settings = settings.replace(metrics_port=port)
    start_worker(settings)
    client = Client(settings)
    secret = "Metrics must never carry this sentence about the Zanzibar account"
    texts = [f"{secret}, number {i}." for i in range(12)]
    results = [job.wait(timeout=60) for job in [client.submit(text) for text in texts]]
    results.append(client.submit(f"{secret}, cut at the frame cap.", max_new_tokens=5).wait(timeout=60))
    # Raw send_task, as a web backend would: duplicates hit the worker's cache, one is invalid.
    app = make_app(settings)
    cached = [
        app.send_task("ttsq.synthesize", kwargs={"text": text}, queue=settings.queue).get(timeout=60)
        for text in texts[:3]
    ]
    with pytest.raises(InvalidRequest):
        app.send_task("ttsq.synthesize", kwargs={"text": secret, "format": "aiff"}, queue=settings.queue).get(
            timeout=60
        )
    assert all(r["cached"] for r in cached)

    # Late acks: a job's result is stored before its message is acknowledged, so the caller may see
    # the last result a moment before the worker acks it. Settled means nothing held, nothing running.
    deadline = time.monotonic() + 10
    samples = scrape(port)
    while (value(samples, "ttsq_unacked_messages"), value(samples, "ttsq_jobs_in_progress")) != (0, 0):
        assert time.monotonic() < deadline, "a message stayed unacknowledged after its result"
        time.sleep(0.1)
        samples = scrape(port)
    assert listening_on(port) == {"127.0.0.1"}  # loopback unless TTSQ_METRICS_HOST says otherwise
    synthesized = [r for r in results if not r["cached"]]
    assert len(synthesized) == 13
    assert value(samples, "ttsq_jobs_total", outcome="synthesized") == 13
    assert value(samples, "ttsq_jobs_total", outcome="cached") == 3
    assert value(samples, "ttsq_jobs_total", outcome="invalid") == 1
    assert value(samples, "ttsq_jobs_total", outcome="failed") == 0
    assert value(samples, "ttsq_cache_lookups_total", result="hit") == 3
    assert value(samples, "ttsq_cache_lookups_total", result="miss") == 13
    # The batch size histogram: its sum is the items synthesized, its count the batches. Every
    # result says which batch size it rode in, so the batches can be counted from the results too.
    batches = round(sum(1 / r["batch_size"] for r in synthesized))
    assert value(samples, "ttsq_batch_size_sum") == 13
    assert value(samples, "ttsq_batch_size_count") == batches
    assert value(samples, "ttsq_batch_size_bucket", le="+Inf") == batches
    assert value(samples, "ttsq_synthesis_seconds_count") == batches
    assert value(samples, "ttsq_real_time_factor_count") == batches
    assert value(samples, "ttsq_truncated_items_total") == 1
    assert value(samples, "ttsq_oom_splits_total") == 0
    assert value(samples, "ttsq_audio_seconds_total") == pytest.approx(
        sum(r["duration_s"] for r in synthesized), rel=1e-3
    )
    # Each job's device share adds up to the device time of all batches.
    assert value(samples, "ttsq_device_seconds_total") == pytest.approx(
        sum(r["timings"]["device_s"] for r in synthesized), abs=0.01
    )
    # The raw sends carry no send time; the rest waited in the interactive lane, as the default tenant.
    assert value(samples, "ttsq_queue_wait_seconds_count", lane="interactive", tenant="default") == 13
    assert value(samples, "ttsq_jobs_in_progress") == 0
    assert value(samples, "ttsq_queue_depth", queue=settings.queue) == 0
    assert value(samples, "ttsq_unacked_messages") == 0
    assert value(samples, "ttsq_worker_restarts_total", node="w1@test") == 0
    assert value(samples, "ttsq_worker_info", node="w1@test", engine="espeak", model=results[0]["model"]) == 1
    # No request content in any label.
    labels = {v for (_, pairs) in samples for (_, v) in pairs}
    assert not any("Zanzibar" in label or "number" in label for label in labels)
    client.close()


def test_queue_depth_is_exported_while_jobs_wait(settings: Settings) -> None:
    # No worker: what is submitted stays on the queue, and a scrape reports it.
    redis = RedisOwner(settings, role="test")
    metrics = Metrics(node="probe@test", queues=[settings.queue], broker=redis.broker)
    port = metrics.serve(0, "127.0.0.1")
    try:
        client = Client(settings)
        for i in range(3):
            client.submit(f"Waiting in line, {i}.")
        assert value(scrape(port), "ttsq_queue_depth", queue=settings.queue) == 3
        client.close()
    finally:
        metrics.close()


def test_nvml_gauges_only_where_nvml_works() -> None:
    metrics = Metrics(node="probe@test")
    names = {family.name for family in metrics.registry.collect()}
    try:
        import pynvml

        pynvml.nvmlInit()
        has_gpu = pynvml.nvmlDeviceGetCount() > 0
    except Exception:
        has_gpu = False
    assert ("ttsq_gpu_memory_used_bytes" in names) == has_gpu


def test_a_metrics_port_in_use_stops_the_worker_with_one_line(settings: Settings) -> None:
    import socket

    from support import run_cli

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("worker", "--metrics-port", str(port), settings=settings)
    assert out.returncode == 2
    assert f"TTSQ_METRICS_PORT: cannot serve metrics on port {port}" in out.stderr.decode()
    assert b"Traceback" not in out.stderr
