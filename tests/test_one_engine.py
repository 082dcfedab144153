"""One queue, one model: a worker whose model differs from the one its queue's live workers serve is
refused at start, with one line naming both; a worker of the same model always joins; a model whose
workers are all gone blocks nothing (drain and switch). And a worker whose bucket does not exist stops
at start, naming ``TTSQ_STORAGE_URL``, instead of failing every job.

Everything runs against real Redis, real ``ttsq worker`` processes and the suite's S3 server. Where a
test needs a worker of another model that it does not run (one alive, or one gone a while ago), it
writes what such a worker leaves in Redis, under its own queue.
"""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from support import WORKER_START_S, WorkerProcess, qwen_settings, run_cli

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import FLEET_LIVE_S, FLEET_NODES_PREFIX, FLEET_PREFIX
from ttsq.records.identities import Rival
from ttsq.records.owner import RedisOwner

ESPEAK = {"engine": "espeak", "model": "espeak-ng", "revision": "1.52", "sample_rate": 22050}
QWEN = {"engine": "qwen", "model": "Qwen3-TTS-VoiceDesign", "revision": "r1", "sample_rate": 24000}


@pytest.fixture
def owner(settings: Settings) -> Iterator[RedisOwner]:
    owner = RedisOwner(settings, role="test")
    yield owner
    owner.close()


def left_behind(settings: Settings, node: str, identity: dict[str, object], *, age_s: float) -> None:
    """What a voice_design worker of ``identity`` leaves in Redis ``age_s`` seconds after its last
    heartbeat (0: it is running), under this test's own queue."""
    payload = json.dumps({**identity, "modes": ["voice_design"], "announced_at": time.time() - age_s})
    cache = redis.Redis.from_url(settings.cache_url)
    cache.hset(FLEET_PREFIX + settings.queue, "voice_design", payload)
    cache.hset(FLEET_NODES_PREFIX + settings.queue, node, payload)
    cache.close()


def refused(settings: Settings, node: str, timeout: float = 120) -> str:
    """Run ``ttsq worker`` expecting it to stop by itself, before consuming, with one line; that line."""
    done = run_cli("worker", "-n", node, settings=settings, timeout=timeout)
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    return output.strip().splitlines()[-1]


def test_claims_are_atomic_one_model_wins_a_queue_and_the_same_model_always_joins(
    settings: Settings, owner: RedisOwner
) -> None:
    identities, queue = owner.identities, settings.queue
    models = {"espeak": {**ESPEAK, "modes": ["voice_design"]}, "qwen": {**QWEN, "modes": ["voice_design"]}}
    # Sixteen workers of two models claim the queue at one moment: one model wins, every worker of it
    # joins, every worker of the other is told who holds the queue.
    start = threading.Barrier(16)
    answers: dict[str, tuple[str, Rival | None]] = {}

    def claim(kind: str, node: str) -> None:
        start.wait()
        answers[node] = (kind, identities.claim(queue, node, models[kind]))

    threads = [threading.Thread(target=claim, args=(kind, f"{kind}{i}@race")) for i in range(8) for kind in models]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(answers) == 16
    winners = {kind for kind, rival in answers.values() if rival is None}
    assert len(winners) == 1, answers
    (winner,) = winners
    for kind, rival in answers.values():
        assert (rival is None) == (kind == winner)
        assert rival is None or (rival.identity["engine"] == winner and rival.node.startswith(winner))
    assert identities.read(queue)["voice_design"]["engine"] == winner
    assert identities.workers(queue) == sorted(f"{winner}{i}@race" for i in range(8))
    # A worker of the winning model joins whenever it starts; one that left no longer counts.
    assert identities.claim(queue, "late@race", models[winner]) is None
    identities.leave(queue, "late@race")
    assert "late@race" not in identities.workers(queue)
    # Another mode is another queue: a model serving another mode is no rival.
    loser = "qwen" if winner == "espeak" else "espeak"
    assert identities.claim(queue, "clone@race", {**models[loser], "modes": ["voice_clone"]}) is None


def test_a_worker_of_another_model_is_refused_at_start_with_one_line_naming_both(
    settings: Settings, owner: RedisOwner
) -> None:
    left_behind(settings, "qwen1@test", QWEN, age_s=0)  # a qwen worker serving the queue right now
    line = refused(settings, "espeak1@test")
    assert line.startswith(f"ttsq: error: TTSQ_QUEUE: queue {settings.queue} is served by engine qwen, "), line
    assert "model Qwen3-TTS-VoiceDesign (revision r1, 24000 Hz) on the live worker qwen1@test" in line, line
    assert "this worker runs engine espeak, model espeak-ng (revision " in line and "22050 Hz" in line, line
    # The refused worker announced nothing: the queue is still the qwen worker's alone.
    assert owner.identities.read(settings.queue)["voice_design"]["engine"] == "qwen"
    assert owner.identities.workers(settings.queue) == ["qwen1@test"]


def test_workers_of_the_same_model_join_and_restart_whenever_they_like(
    settings: Settings, start_worker: Callable[..., WorkerProcess], owner: RedisOwner
) -> None:
    first = start_worker(settings, name="same1")
    start_worker(settings, name="same2")
    # Killed: its entry stays live for a while. Its own restart, and a new worker, still join.
    first.stop(signal.SIGKILL)
    assert "same1@test" in owner.identities.workers(settings.queue)
    start_worker(settings, name="same1")
    start_worker(settings, name="same3")
    assert owner.identities.workers(settings.queue) == ["same1@test", "same2@test", "same3@test"]
    with Client(settings) as client:
        assert client.submit("Three workers, one model.").wait(timeout=60)["sample_rate"] == 22050


def test_a_model_whose_workers_are_gone_blocks_nothing(
    settings: Settings, start_worker: Callable[..., WorkerProcess], owner: RedisOwner
) -> None:
    # The last qwen worker beat FLEET_LIVE_S ago (killed, or its host lost): the queue is free again,
    # long before producers stop trusting its announcement.
    left_behind(settings, "qwen1@test", QWEN, age_s=FLEET_LIVE_S + 1)
    assert owner.identities.read(settings.queue)["voice_design"]["engine"] == "qwen"
    start_worker(settings, name="espeak1")
    assert owner.identities.read(settings.queue)["voice_design"]["engine"] == "espeak"
    assert owner.identities.workers(settings.queue) == ["espeak1@test"]


def test_a_missing_bucket_stops_the_worker_at_start_naming_the_setting(settings: Settings) -> None:
    bucket = f"ttsq-missing-{uuid.uuid4().hex[:8]}"
    line = refused(settings.replace(storage_url=f"s3://{bucket}/audio"), "nobucket@test")
    assert (
        line == f"ttsq: error: TTSQ_STORAGE_URL: the bucket s3://{bucket} at {settings.s3_endpoint_url} does not exist"
    )


@pytest.mark.slow
def test_qwen_after_espeak_is_refused_until_the_espeak_workers_are_drained(
    settings: Settings,
    start_worker: Callable[..., WorkerProcess],
    qwen_checkpoints: dict[str, Path],
    owner: RedisOwner,
) -> None:
    """The case of the issue: espeak (22.05 kHz) and qwen (24 kHz) on one queue would serve alternate jobs."""
    espeak = start_worker(settings, name="espeak1")
    qwen = qwen_settings(settings, qwen_checkpoints["voice_design"])
    line = refused(qwen, "qwen1@test", timeout=WORKER_START_S)  # after loading its model: its identity is known
    assert f"TTSQ_QUEUE: queue {settings.queue} is served by engine espeak, model espeak-ng" in line, line
    assert "on the live worker espeak1@test; this worker runs engine qwen, model " in line and "24000 Hz" in line
    with Client(settings) as client:
        assert client.submit("Still espeak.").wait(timeout=60)["sample_rate"] == 22050
    # Drain and switch: the espeak workers stop (each withdraws as it goes), the qwen one starts at once.
    assert espeak.stop() == 0
    start_worker(qwen, name="qwen1", timeout=WORKER_START_S)
    assert owner.identities.workers(settings.queue) == ["qwen1@test"]
    with Client(settings) as client:
        assert client.submit("Now qwen.").wait(timeout=240)["sample_rate"] == 24000
