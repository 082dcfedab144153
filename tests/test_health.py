"""The worker's probes on its metrics port (``/livez``, ``/readyz``), against real workers.

Liveness follows the batcher: it goes false when the batcher thread dies or an engine call hangs past
its limit, and true again once the supervisor has started a new process. Readiness follows Redis and the
object store too: false while either is down or the bucket is gone (liveness stays true: a restart would
only drop the jobs the worker holds), true again when they are back. The gateway's readiness follows the
workers: false as soon as the last one stops, and within ``FLEET_LIVE_S`` of the last one dying. The
queue's ``ttsq_outstanding_jobs`` counts what workers hold, not only what waits in Redis.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import GatewayProcess, Launcher, WorkerProcess, scrape, value, wait_until

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import FLEET_LIVE_S, STORAGE_CHECK_INTERVAL_S
from ttsq.ops.redis_server import RedisServer, free_port
from ttsq.worker.runtime import WorkerRuntime

SLACK_S = 60


def probe(port: int, path: str) -> tuple[int, dict[str, object]]:
    """(status, body) of one probe; (0, {}) when nothing answers on the port, and an empty body when the
    answer was cut short (a process the watchdog ends mid-answer sends its status line and no body)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, _body(response)
    except urllib.error.HTTPError as exc:
        return exc.code, _body(exc)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def _body(answer: Any) -> dict[str, object]:
    try:
        return dict(json.loads(answer.read()))
    except (ValueError, http.client.IncompleteRead, ConnectionError):
        return {}


def test_a_worker_in_process_is_live_and_ready_then_not_live_once_its_batcher_thread_ends(
    settings: Settings,
) -> None:
    runtime = WorkerRuntime(settings, node="health-inproc@test")
    port = runtime.metrics.serve(0, health=runtime.health)
    try:
        assert probe(port, "/readyz") == (503, {"ready": False, "checks": {"engine": False}})
        assert probe(port, "/livez") == (200, {"live": True})  # loading is alive
        runtime.start()
        assert probe(port, "/livez") == (200, {"live": True})
        assert probe(port, "/healthz") == (200, {"live": True})
        assert probe(port, "/readyz") == (
            200,
            {
                "ready": True,
                "checks": {"engine": True, "redis": True, "storage": True, "fleet": True, "accepting": True},
            },
        )
        # The probes sit beside the metrics; /metrics is unchanged.
        assert value(scrape(port), "ttsq_jobs_in_progress") == 0
        # The batcher thread ends as it would on a bug. The watchdog, which would end this process
        # (the test's own) a second later, is stopped first: the probe is what is under test.
        runtime.watchdog.stop()
        assert runtime.batcher.stop()
        status, body = probe(port, "/livez")
        assert (status, body) == (503, {"live": False, "reason": "the batcher thread has died"})
        status, body = probe(port, "/readyz")
        assert status == 503 and body["ready"] is False
    finally:
        runtime.close()


@pytest.mark.slow
def test_liveness_goes_false_when_the_engine_hangs_and_true_again_after_the_restart(
    settings: Settings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    # Its own Redis: the hung job stays unacked in it after the test, where nobody else counts it.
    server = RedisServer(directory=str(tmp_path / "redis"))
    os.makedirs(server.directory)
    server.start()
    url = server.url
    port = free_port()
    faulty = settings.replace(
        engine=faulty_engine,
        metrics_port=port,
        batch_timeout_s=3,
        job_timeout_s=12,
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        cache_url=f"{url}/2",
    )
    launcher = Launcher(faulty, "cpu:1", tmp_path / "launcher.log", host="health")
    try:
        first = launcher.wait_ready(["cpu0@health"], timeout=SLACK_S)["cpu0@health"]
        wait_until(lambda: probe(port, "/readyz")[0] == 200, SLACK_S, "the worker ready")
        client = Client(faulty)
        client.submit("[hang] This request hangs the engine.")
        # From live, through not live (503 while the stuck process still answers, or nothing at all
        # once the watchdog has ended it), to live again in the process the launcher starts.
        seen: list[int] = []

        def back_after_a_failure() -> bool:
            status = probe(port, "/livez")[0]
            if not seen or seen[-1] != status:
                seen.append(status)
            return status == 200 and any(s != 200 for s in seen)

        wait_until(back_after_a_failure, SLACK_S, f"liveness down and back (seen {seen})", interval=0.02)
        assert seen[0] == 200 and set(seen[1:-1]) <= {503, 0} and seen[1:-1], seen
        # The one answering now is a new process (its heartbeat replaces the stuck one's).
        wait_until(
            lambda: launcher.wait_ready(["cpu0@health"], timeout=SLACK_S)["cpu0@health"] != first,
            SLACK_S,
            "the new worker's heartbeat",
        )
        wait_until(lambda: probe(port, "/readyz")[0] == 200, SLACK_S, "the new worker ready")
        assert "past the per-batch limit of 3s" in launcher.log()
        client.close()
    finally:
        launcher.stop()
        server.stop()


@pytest.mark.slow  # a Redis or store outage ridden out: tens of seconds
def test_readiness_follows_redis_and_liveness_rides_out_the_outage(
    settings: Settings, start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    # This test's own Redis, so that stopping it touches nobody else's.
    server = RedisServer(directory=str(tmp_path / "redis"), appendonly=True)
    os.makedirs(server.directory)
    server.start()
    url = server.url
    port = free_port()
    own = settings.replace(broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2", metrics_port=port)
    try:
        worker = start_worker(own, name="health-redis")
        wait_until(lambda: probe(port, "/readyz")[0] == 200, SLACK_S, "the worker ready")
        server.stop(keep_data=True)
        wait_until(lambda: probe(port, "/readyz")[0] == 503, SLACK_S, "readiness false without Redis")
        status, body = probe(port, "/readyz")
        assert status == 503 and body["checks"] == {
            "engine": True,
            "redis": False,
            "storage": True,
            "fleet": True,
            "accepting": True,
        }
        assert probe(port, "/livez") == (200, {"live": True})
        time.sleep(2)  # a few probe periods of outage: still alive, still not ready
        assert probe(port, "/livez") == (200, {"live": True})
        assert probe(port, "/readyz")[0] == 503
        server.start()
        wait_until(lambda: probe(port, "/readyz")[0] == 200, SLACK_S, "readiness back with Redis")
        with Client(own) as client:
            assert client.submit("Ready again after the outage.").wait(timeout=SLACK_S)["duration_s"] > 0
        assert worker.process is not None and worker.process.poll() is None
        worker.stop()  # while its Redis is there: without it, it rides out its patience on the way out
    finally:
        server.stop()


@pytest.mark.slow
def test_outstanding_jobs_count_what_workers_hold_as_well_as_what_waits(
    settings: Settings,
    start_worker: Callable[..., WorkerProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    port = free_port()
    # One job at a time, each a second long: most of a burst waits in Redis, a few in the worker.
    own = settings.replace(engine=faulty_engine, metrics_port=port, max_batch=1)
    start_worker(own, name="health-outstanding")
    with Client(own) as client:
        jobs = [client.submit(f"[slow] Outstanding job number {i}.") for i in range(6)]

        def held_and_waiting() -> bool:
            samples = scrape(port)
            depth = value(samples, "ttsq_queue_depth", queue=own.queue)
            outstanding = value(samples, "ttsq_outstanding_jobs", queue=own.queue)
            assert depth <= outstanding <= len(jobs)
            return depth < outstanding  # the Redis list alone undercounts: the worker holds some

        wait_until(held_and_waiting, SLACK_S, "the worker holding jobs the queue no longer lists")
        for job in jobs:
            job.wait(timeout=SLACK_S)
        wait_until(
            lambda: value(scrape(port), "ttsq_outstanding_jobs", queue=own.queue) == 0, SLACK_S, "nothing outstanding"
        )


@pytest.mark.slow  # a Redis or store outage ridden out: tens of seconds
def test_readiness_follows_the_object_store_and_liveness_rides_out_its_outage(
    settings: Settings, start_worker: Callable[..., WorkerProcess]
) -> None:
    import boto3
    from moto.server import ThreadedMotoServer

    # This test's own S3 server and bucket, so that stopping or deleting them touches nobody else's.
    s3_port, port, bucket = free_port(), free_port(), f"health-{free_port()}"
    endpoint = f"http://127.0.0.1:{s3_port}"
    s3 = boto3.client("s3", endpoint_url=endpoint)

    def s3_up() -> ThreadedMotoServer:
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port)
        server.start()
        return server

    def storage_ready() -> bool | None:
        checks = probe(port, "/readyz")[1].get("checks")
        return checks.get("storage") if isinstance(checks, dict) else None

    server = s3_up()
    s3.create_bucket(Bucket=bucket)
    try:
        own = settings.replace(storage_url=f"s3://{bucket}/audio", s3_endpoint_url=endpoint, metrics_port=port)
        worker = start_worker(own, name="health-s3")
        wait_until(lambda: probe(port, "/readyz")[0] == 200, SLACK_S, "the worker ready")
        server.stop()
        # Looked at again every few seconds, not at every probe.
        wait_until(lambda: storage_ready() is False, STORAGE_CHECK_INTERVAL_S + SLACK_S, "readiness false without S3")
        assert probe(port, "/readyz")[0] == 503
        assert probe(port, "/livez") == (200, {"live": True})
        server = s3_up()
        wait_until(lambda: probe(port, "/readyz")[0] == 200, STORAGE_CHECK_INTERVAL_S + SLACK_S, "ready again")
        # The server answers, but the bucket is gone: not ready either.
        s3.delete_bucket(Bucket=bucket)
        wait_until(lambda: storage_ready() is False, STORAGE_CHECK_INTERVAL_S + SLACK_S, "readiness false, no bucket")
        s3.create_bucket(Bucket=bucket)
        wait_until(lambda: probe(port, "/readyz")[0] == 200, STORAGE_CHECK_INTERVAL_S + SLACK_S, "ready again")
        assert worker.process is not None and worker.process.poll() is None
        assert "storage unreachable, not ready" in worker.log() and "storage reachable again" in worker.log()
        worker.stop()
    finally:
        s3.delete_bucket(Bucket=bucket)
        server.stop()


@pytest.mark.slow  # workers stopped and killed, the gateway watched: tens of seconds
def test_the_gateways_readiness_follows_the_workers_within_seconds(
    settings: Settings, start_worker: Callable[..., WorkerProcess], start_gateway: Callable[..., GatewayProcess]
) -> None:
    gateway = start_gateway(settings)

    def ready() -> tuple[int, dict[str, object]]:
        answer = httpx.get(f"{gateway.url}/readyz", timeout=10)
        return answer.status_code, answer.json()

    worker = start_worker(settings, name="health-gw")
    wait_until(lambda: ready()[0] == 200, SLACK_S, "the gateway ready")
    # A worker that stops withdraws as it goes: the next probe already knows.
    assert worker.stop() == 0
    assert ready() == (503, {"ready": False, "checks": {"redis": True, "storage": True, "workers": False}})
    worker = start_worker(settings, name="health-gw")
    wait_until(lambda: ready()[0] == 200, SLACK_S, "the gateway ready again")
    # One that dies says nothing: it stops counting FLEET_LIVE_S after its last heartbeat, not after
    # the two minutes producers keep trusting its model (IDENTITY_MAX_AGE_S).
    worker.stop(signal.SIGKILL)
    wait_until(lambda: ready()[0] == 503, FLEET_LIVE_S + 10, "the gateway not ready without workers")
