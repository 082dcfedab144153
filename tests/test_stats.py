"""``ttsq stats``: queue depths, workers, throughput and cache hits, from Redis and the workers."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
from support import WorkerProcess, run_cli

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.fleet import format_table, snapshot
from ttsq.records.owner import RedisOwner

StartWorker = Callable[..., WorkerProcess]
BURST = 32


def stats_json(settings: Settings) -> dict[str, Any]:
    out = run_cli("stats", "--json", settings=settings)
    assert out.returncode == 0, out.stderr
    snap: dict[str, Any] = json.loads(out.stdout)
    return snap


@pytest.mark.slow
def test_stats_are_consistent_during_and_after_a_burst(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings, name="w1")
    start_worker(settings, name="w2")
    client = Client(settings)
    texts = [f"Statistics sentence {i}, long enough to keep a worker busy for a moment or two." for i in range(BURST)]
    jobs = [client.submit(text, format="mp3") for text in texts]

    during = stats_json(settings)
    window = during["window"]
    depth = sum(q["depth"] for q in during["queues"])
    # one queue per mode and lane, interactive first; voice_design's interactive lane keeps the plain name
    assert [(q["queue"], q["lane"]) for q in during["queues"]] == [
        (settings.queue, "interactive"),
        (f"{settings.queue}.custom_voice", "interactive"),
        (f"{settings.queue}.voice_clone", "interactive"),
        (f"{settings.queue}.bulk", "bulk"),
        (f"{settings.queue}.custom_voice.bulk", "bulk"),
        (f"{settings.queue}.voice_clone.bulk", "bulk"),
    ]
    assert {w["node"] for w in during["workers"]} == {"w1@test", "w2@test"}
    # A job is waiting, held by a worker, or done: never two of these at once, never more than sent.
    assert 0 <= window["jobs_done"] <= BURST and 0 <= depth <= BURST
    assert window["jobs_done"] + depth <= BURST
    assert window["synthesized"] == window["jobs_done"]  # no duplicates yet
    assert window["failed"] == 0

    results = [job.wait(timeout=120) for job in jobs]
    # Cache hits: three at the producer (short-circuit) and two at a worker (raw send_task).
    for text in texts[:3]:
        assert client.submit(text, format="mp3").cached
    app = make_app(settings)
    for text in texts[3:5]:
        assert app.send_task("ttsq.synthesize", kwargs={"text": text, "format": "mp3"}, queue=settings.queue).get(
            timeout=60
        )["cached"]

    # A worker writes its counts once a second: wait for the last of them.
    deadline = time.monotonic() + 15
    while (after := stats_json(settings))["window"]["jobs_done"] < BURST + 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    window = after["window"]
    assert all(q["depth"] == 0 for q in after["queues"]) and after["unacked"] == 0
    assert window["synthesized"] == BURST
    assert window["jobs_done"] == BURST + 2  # worker-side hits are jobs too; producer hits never queued
    assert window["cache_hits"] == 5 and window["cache_hits_producer"] == 3
    assert window["cache_hit_ratio"] == round(5 / (BURST + 5), 4)
    assert window["audio_s"] == pytest.approx(sum(r["duration_s"] for r in results), abs=0.002)
    assert window["jobs_per_minute"] > 0
    workers = {w["node"]: w for w in after["workers"]}
    assert set(workers) == {"w1@test", "w2@test"}
    assert all(w["responding"] is True and w["engine"] == "espeak" for w in workers.values())
    assert {r["worker"] for r in results} <= set(workers)

    table = run_cli("stats", settings=settings)
    assert table.returncode == 0, table.stderr
    text = table.stdout.decode()
    assert "WORKERS ONLINE: 2" in text and "w1@test" in text and "w2@test" in text
    assert f"synthesized      {BURST:>8}" in text
    assert f"{settings.queue:<29} {'interactive':<11}     0        0         0" in text
    client.close()


def test_counters_outside_the_window_are_left_out(settings: Settings) -> None:
    redis = RedisOwner(settings, role="test")
    stats = redis.stats
    now = time.time()
    stats.record(now=now - 10 * 60, synthesized=7, audio_s=1.5)
    stats.record(now=now, synthesized=2, cached_producer=1, audio_s=0.25)
    snap = snapshot(settings, minutes=5, ping_timeout=0, now=now)
    assert snap["window"]["synthesized"] == 2 and snap["window"]["audio_s"] == 0.25
    assert snap["window"]["cache_hit_ratio"] == round(1 / 3, 4)
    assert snapshot(settings, minutes=15, ping_timeout=0, now=now)["window"]["synthesized"] == 9
    assert "WORKERS ONLINE: 0" in format_table(snap)
    redis.close()
