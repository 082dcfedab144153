"""End to end through real processes: client → Redis/Celery → ``ttsq worker`` → espeak → S3 → URL."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis
import soundfile as sf
from bad_inputs import BAD_REQUESTS
from support import WorkerProcess, queue_length, s3_keys, wait_until

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.errors import BrokerError, EngineError, InvalidRequest, JobTimeout
from ttsq.records.owner import RedisOwner
from ttsq.records.stats import FLUSH_INTERVAL_S

StartWorker = Callable[..., WorkerProcess]
KOREAN = "안녕하세요. 티티에스큐 음성 합성 테스트입니다."


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()  # type: ignore[no-any-return]


def test_submit_to_url_to_valid_wav(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings)
    client = Client(settings)
    text = "The quick brown fox jumps over the lazy dog, twice, to make a longer sentence."
    result = client.submit(text, language="english").wait(timeout=30)

    assert result["url"].startswith(settings.s3_endpoint_url)  # a presigned URL on the S3 server
    data = fetch(result["url"])
    audio, rate = sf.read(io.BytesIO(data))
    info = sf.info(io.BytesIO(data))
    assert (info.format, info.subtype, rate) == ("WAV", "PCM_16", result["sample_rate"])
    seconds = len(audio) / rate
    # espeak speaks about 175 words a minute: 15 words take about 5 s
    assert 3.0 < seconds < 8.0
    assert seconds == pytest.approx(result["duration_s"], abs=0.01)
    assert result["cached"] is False and result["batch_size"] >= 1
    assert result["timings"]["queue_wait_s"] > 0  # measured from the producer's send header
    assert result["content_type"] == "audio/wav" and result["object_key"].endswith(".wav")
    assert text not in json.dumps(result)
    assert s3_keys(settings) == [f"{settings.storage_url.split('/', 3)[3]}/{result['object_key']}"]


def test_second_submit_is_answered_from_the_cache_with_no_worker(settings: Settings, start_worker: StartWorker) -> None:
    worker = start_worker(settings)
    client = Client(settings)
    first = client.submit(KOREAN, language="korean", format="mp3").wait(timeout=30)
    worker.stop()

    job = client.submit(KOREAN, language="korean", format="mp3")
    assert job.id is None and job.cached  # no task was created at all
    assert job.result is not None
    assert (job.result["key"], job.result["object_key"]) == (first["key"], first["object_key"])
    assert fetch(job.result["url"]) == fetch(first["url"])
    assert queue_length(settings) == 0


def test_ten_concurrent_identical_submits_make_one_synthesis(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings)
    client = Client(settings)
    client.submit("warm up the model announcement").wait(timeout=30)
    stats = RedisOwner(settings, role="test").stats
    # What `ttsq stats` counts; a worker writes its counts once a second (FLUSH_INTERVAL_S).
    wait_until(lambda: stats.window(5)["synthesized"] >= 1, 10, "the warm-up counted")
    before = stats.window(5)["synthesized"]

    def submit_and_wait(_: int) -> dict[str, object]:
        return dict(Client(settings).submit("Ten producers, one job.").wait(timeout=30))

    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(submit_and_wait, range(10)))
    assert len({r["key"] for r in results}) == 1
    wait_until(lambda: stats.window(5)["synthesized"] - before >= 1, 10, "the job counted")
    time.sleep(FLUSH_INTERVAL_S * 2)  # a second synthesis would be counted by now
    assert stats.window(5)["synthesized"] - before == 1
    assert len([k for k in s3_keys(settings) if k.endswith(f"{results[0]['key']}.wav")]) == 1
    assert len(s3_keys(settings)) == 2  # the warm-up's object and this one


def test_plain_celery_client_without_ttsq_gets_a_result(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings)
    script = textwrap.dedent(f"""
        import json, sys
        from celery import Celery
        app = Celery(broker={settings.broker_url!r}, backend={settings.result_backend!r})
        result = app.send_task("ttsq.synthesize", kwargs={{"text": "안녕하세요", "language": "korean"}},
                               queue={settings.queue!r})
        value = result.get(timeout=30)
        assert not any(name == "ttsq" or name.startswith("ttsq.") for name in sys.modules), "imported ttsq"
        print(json.dumps(value))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    value = json.loads(out.stdout.strip().splitlines()[-1])
    assert value["format"] == "wav" and value["duration_s"] > 0.3
    assert fetch(value["url"])[:4] == b"RIFF"


def test_burst_fills_batches_and_bad_items_fail_alone(
    settings: Settings,
    start_worker: StartWorker,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    # The faulty engine (espeak, plus faults on cue) fails an item marked [flaky] in its slot while
    # the file FAULTY_ENGINE_FLAKY names exists, as a transient device fault would.
    flaky = tmp_path / "flaky"
    flaky.touch()
    monkeypatch.setenv("FAULTY_ENGINE_FLAKY", str(flaky))
    settings = settings.replace(engine=faulty_engine, max_batch=4, max_wait_ms=1000)
    client = Client(settings)
    app = make_app(settings)
    # Queue the whole burst first, so the worker finds 4 x max_batch jobs waiting. One of them is
    # valid, rides in a batch and fails inside the engine. Another never gets that far: a raw
    # send_task with a language ttsq does not know.
    # Each batch takes a second ([slow]): the next batch's jobs reach the batcher while it runs, so
    # every batch leaves full however late a busy machine schedules the task threads.
    texts = [f"Burst sentence number {i} [slow]." for i in range(15)]
    texts.insert(6, "A sentence the device fails on [flaky].")
    jobs = [client.submit(text, language="english") for text in texts]
    invalid = app.send_task("ttsq.synthesize", kwargs={"text": "fine", "language": "klingon"}, queue=settings.queue)
    start_worker(settings)

    with pytest.raises(EngineError, match="flaky device fault"):
        jobs[6].wait(timeout=60)
    results = [job.wait(timeout=60) for i, job in enumerate(jobs) if i != 6]
    with pytest.raises(InvalidRequest) as info:  # rebuilt from the JSON result: a typed error
        invalid.get(timeout=30)
    assert info.value.field == "language"
    assert all(not r["cached"] for r in results)
    # 16 jobs, 4 full batches: the failing item counted in its batch like any other
    assert [r["batch_size"] for r in results] == [4] * 15
    assert len({r["key"] for r in results}) == 15
    client.close()
    app.close()


def test_wait_times_out_clearly_when_no_worker_runs(settings: Settings) -> None:
    job = Client(settings).submit("nobody is listening")
    with pytest.raises(JobTimeout):
        job.wait(timeout=1)


def test_a_waiter_finds_a_result_whose_publish_it_missed(settings: Settings, start_worker: StartWorker) -> None:
    # Redis may take a result's SET and PUBLISH before a waiter's SUBSCRIBE (it arrives on another
    # connection), and Celery reads the stored state only as a wait begins: the waiter must find the result
    # by reading again, not sleep to its timeout. Seen once in CI: one of ten waiters on one job hung 30 s.
    start_worker(settings)
    client = Client(settings)
    done = dict(client.submit("A result to hand to a second job.").wait(timeout=30))
    # A job no worker serves (its own queue): accepted, so known, and PENDING until the test stores it.
    elsewhere = Client(settings.replace(queue=f"{settings.queue}-nobody"))
    job = elsewhere.submit("Nobody serves this queue.")
    waited: list[object] = []
    waiter = threading.Thread(target=lambda: waited.append(elsewhere.wait(job.id or "", timeout=30)), daemon=True)
    started = time.monotonic()
    waiter.start()
    time.sleep(1.0)  # the waiter has read PENDING and subscribed
    meta = {"status": "SUCCESS", "result": done, "traceback": None, "children": [], "task_id": job.id}
    backend = redis.Redis.from_url(settings.result_backend)
    backend.set(f"celery-task-meta-{job.id}", json.dumps(meta))  # stored, never published
    backend.close()
    broker = redis.Redis.from_url(settings.broker_url)
    broker.delete(elsewhere.settings.queue)  # this test's own queue: its message will never be served
    broker.close()
    waiter.join(30)
    assert waited and waited[0]["key"] == done["key"], waited  # type: ignore[index]
    assert time.monotonic() - started < 10  # found on a re-read (every 2 s), not at the 30 s timeout
    client.close()
    elsewhere.close()


def test_broker_down_after_a_claim_releases_it(settings: Settings, redis_client: object) -> None:
    """With the cache up and the model known, a submit claims the key before it enqueues; if the
    broker is down, the claim must not outlive the failure."""
    from ttsq.engines.base import EngineIdentity
    from ttsq.ops.redis_server import free_port

    RedisOwner(settings, role="test").identities.publish(
        settings.queue, EngineIdentity(engine="espeak", model="espeak-ng", revision="test", sample_rate=22050).to_dict()
    )
    down = f"redis://127.0.0.1:{free_port()}"
    client = Client(settings.replace(broker_url=f"{down}/0"))
    with pytest.raises(BrokerError, match="enqueue"):
        client.submit("Claimed, then not sent.")
    import redis

    assert redis.Redis.from_url(settings.cache_url).keys("ttsq:inflight:*") == []
    client.close()


def test_broker_down_is_a_broker_error(settings: Settings) -> None:
    from ttsq.ops.redis_server import free_port

    down = f"redis://127.0.0.1:{free_port()}"
    client = Client(settings.replace(broker_url=f"{down}/0", result_backend=f"{down}/1", cache_url=f"{down}/2"))
    with pytest.raises(BrokerError):
        client.submit("hello")


@pytest.mark.parametrize(("data", "field"), BAD_REQUESTS)
def test_client_raises_a_typed_error_and_queues_nothing(
    settings: Settings, data: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidRequest) as info:
        Client(settings).submit(**data)
    assert info.value.field == field
    assert queue_length(settings) == 0


@pytest.mark.slow  # a Redis or store outage ridden out: tens of seconds
def test_result_backend_down_while_waiting_is_a_broker_error(tmp_path: Path) -> None:
    from support import run_cli

    from ttsq.ops.redis_server import RedisServer

    server = RedisServer().start()
    private = Settings(
        broker_url=f"{server.url}/0",
        result_backend=f"{server.url}/1",
        cache_url=f"{server.url}/2",
        storage_url=str(tmp_path),
    )
    client = Client(private)
    job = client.submit("Redis goes away while we wait.")
    server.stop()
    with pytest.raises(BrokerError):
        job.wait(timeout=10)
    out = run_cli("result", str(job.id), "--timeout", "10", settings=private)
    lines = out.stderr.decode().strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith("ttsq: error: cannot reach"), lines
    client.close()


def test_a_claim_left_by_a_finished_job_is_taken_over(settings: Settings, start_worker: StartWorker) -> None:
    """An operator revokes a queued job: Celery acks it without running it, so the claim is never
    released. The next identical submit must not join the dead job."""
    import redis
    from celery.exceptions import TaskRevokedError

    start_worker(settings)
    text = "Revoked once, wanted again."
    with Client(settings) as client:
        first = client.submit(text)
        first.wait(timeout=30)
        key = first.key
        assert key is not None
        redis.Redis.from_url(settings.cache_url).delete(f"ttsq:cache:{key}")  # as if its TTL had passed
        ghost = "revoked-before-it-ran"
        assert client.cache.claim(key, ghost, 600) is None  # a job claims the key ...
        client.app.backend.store_result(ghost, TaskRevokedError("revoked"), "REVOKED")  # ... and is revoked

        job = client.submit(text)
        assert not job.joined and job.id not in (ghost, first.id)
        assert job.wait(timeout=30)["key"] == key
