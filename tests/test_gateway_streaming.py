"""The gateway's speech route streaming the worker's pieces (``ttsq serve`` on loopback, a real espeak worker,
real Redis and S3), read with OpenAI's own package and httpx; and the rest of the OpenAI surface a client
probes (models, voices, errors for unknown routes)."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
import wave
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
import soundfile
from document_corpus import corpus
from support import SECRET, GatewayProcess, WorkerProcess, api_key, late_reader, scrape, value, wait_until

from ttsq.config import Settings
from ttsq.constants import STREAM_PREFIX
from ttsq.gateway.encoders import encoder
from ttsq.records.owner import RedisOwner
from ttsq.records.streams import AudioStreams

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]
TEXT = f"{SECRET}: a streamed sentence, in pieces as the worker makes them, and then a second one."


@pytest.fixture
def served(settings: Settings, start_worker: StartWorker, start_gateway: StartGateway) -> tuple[GatewayProcess, str]:
    start_worker(settings)
    return start_gateway(settings), api_key(settings)


def openai_client(gateway: GatewayProcess, token: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0, timeout=60)


def http(gateway: GatewayProcess, token: str) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def stored_wav(gateway: GatewayProcess, token: str, job_id: str) -> tuple[np.ndarray[Any, Any], int]:
    """The job's stored file (a WAV), as 16-bit samples."""
    with http(gateway, token) as api:
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS", 60, "the job's result")
        data = api.get(f"/v1/jobs/{job_id}/audio").content
    samples, rate = soundfile.read(io.BytesIO(data), dtype="int16")
    return samples, int(rate)


def stream_entries(settings: Settings, job_id: str) -> list[str]:
    # Stream pieces are bytes: the kinds are what these reads need.
    client = redis.Redis.from_url(settings.cache_url, decode_responses=True, encoding_errors="replace")
    try:
        return [fields["kind"] for _, fields in client.xrange(STREAM_PREFIX + job_id)]
    finally:
        client.close()


def metric(gateway: GatewayProcess, name: str, **labels: str) -> float:
    """A sample of the gateway's /metrics; 0 before it was first counted."""
    try:
        return value(scrape(gateway.port), name, **labels)
    except KeyError:
        return 0.0


def first_audio_count(gateway: GatewayProcess, source: str) -> float:
    return metric(gateway, "ttsq_time_to_first_audio_seconds_count", source=source)


@pytest.fixture
def served_whole(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> tuple[GatewayProcess, str]:
    """A worker whose streams keep every piece (a window longer than any clip here): espeak makes a
    clip's 5 s window in a few milliseconds, so on a busy machine the gateway's reader can open after
    the head was trimmed, and then rightly plays the stored file (a late reader), which is not what a
    test of the stream's own bytes is after."""
    start_worker(settings.replace(stream_window_s=600))
    return start_gateway(settings), api_key(settings)


@pytest.mark.parametrize("response_format", ["pcm", "wav", "mp3", "opus"])
def test_each_format_streams_from_the_worker_and_decodes(
    served_whole: tuple[GatewayProcess, str], settings: Settings, response_format: str
) -> None:
    gateway, token = served_whole
    client = openai_client(gateway, token)
    text = f"{TEXT} Said in {response_format}."
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=text, response_format=response_format, stream_format="audio"
    ) as response:
        assert response.headers["x-ttsq-cached"] == "false"
        job_id = response.headers["x-ttsq-job-id"]
        chunks = list(response.iter_bytes())
    data = b"".join(chunks)
    # It came from the worker's stream (its pieces are still there, then the end), not from the stored
    # file.
    kinds = stream_entries(settings, job_id)
    assert kinds[-1] == "end" and kinds.count("audio") >= 1
    assert first_audio_count(gateway, "stream") >= 1
    stored, rate = stored_wav(gateway, token, job_id) if response_format in ("pcm", "wav") else (None, 0)
    if response_format == "wav":
        assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[40:44] == b"\xff\xff\xff\xff"
        assert data[44:] == stored.astype("<i2").tobytes()  # type: ignore[union-attr]  # the stored samples
        samples, read_rate = soundfile.read(io.BytesIO(data), dtype="int16")  # a reader takes it whole
        assert read_rate == rate and np.array_equal(samples, stored)
    elif response_format == "pcm":
        received = np.frombuffer(data, dtype="<i2").astype(np.int32)
        # The stored samples at OpenAI's 24 kHz: the same count, and within one step of rounding.
        assert stored is not None
        expected = np.interp(
            np.arange(round(stored.size * 24_000 / rate)) * (rate / 24_000), np.arange(stored.size), stored / 32768.0
        )
        assert received.size == expected.size
        assert np.abs(received - np.clip(np.floor(expected * 32768.0), -32768, 32767)).max() <= 1
    else:
        # A stored file of the same job, for its length; the streamed one decodes whole.
        samples, read_rate = soundfile.read(io.BytesIO(data), dtype="float32")
        with http(gateway, token) as api:
            wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS", 60, "the job")
            duration = float(api.get(f"/v1/jobs/{job_id}").json()["result"]["duration_s"])
        assert len(samples) / read_rate == pytest.approx(duration, abs=0.15)
        assert np.sqrt(np.mean(samples**2)) > 0.01  # speech, not silence


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: ")]


def test_sse_deltas_then_done_and_a_cache_hit_streams_from_storage(
    served: tuple[GatewayProcess, str], settings: Settings
) -> None:
    gateway, token = served
    body = {"model": "tts-1", "input": TEXT, "response_format": "wav", "stream_format": "sse"}
    with http(gateway, token) as api, api.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        job_id = response.headers["x-ttsq-job-id"]
        events = sse_events(response)
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1) and len(events) >= 2
    done = events[-1]
    assert done["type"] == "speech.audio.done" and set(done["usage"]) == {
        "input_tokens",
        "output_tokens",
        "total_tokens",
    }
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    stored, rate = stored_wav(gateway, token, job_id)
    assert audio[44:] == stored.astype("<i2").tobytes()
    assert done["duration_s"] == pytest.approx(stored.size / rate, abs=0.001)

    # The same request again: a cache hit, sent from storage at once (the stored file, whole).
    before = first_audio_count(gateway, "cache")
    with http(gateway, token) as api, api.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.headers["x-ttsq-cached"] == "true" and "x-ttsq-job-id" not in response.headers
        events = sse_events(response)
    again = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    samples, again_rate = soundfile.read(io.BytesIO(again), dtype="int16")
    assert again_rate == rate and np.array_equal(samples, stored) and events[-1]["type"] == "speech.audio.done"
    assert first_audio_count(gateway, "cache") == before + 1
    # And through OpenAI's package, raw: the stored bytes.
    with openai_client(gateway, token).audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=TEXT, response_format="wav"
    ) as response:
        assert response.headers["x-ttsq-cached"] == "true"
        assert soundfile.read(io.BytesIO(b"".join(response.iter_bytes())), dtype="int16")[0].size == stored.size


# -- streams written by hand: a rerun, a failure, a joiner, a client that leaves ------------------


def queued_task_ids(settings: Settings) -> list[str]:
    """The ids of the messages waiting in this test's queue (no worker is consuming it)."""
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return [json.loads(raw)["headers"]["id"] for raw in client.lrange(settings.queue, 0, -1)]
    finally:
        client.close()


class Reader(threading.Thread):
    """A client reading one speech response in the background, keeping what it got and how it ended."""

    def __init__(self, gateway: GatewayProcess, token: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.gateway, self.token, self.body = gateway, token, body
        self.status = 0
        self.headers: dict[str, str] = {}
        self.received = bytearray()
        self.error: BaseException | None = None
        self.done = False

    def run(self) -> None:
        try:
            with http(self.gateway, self.token) as api, api.stream("POST", "/v1/audio/speech", json=self.body) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                for chunk in r.iter_raw():
                    self.received += chunk
        except BaseException as exc:  # what the client sees is the point of the test
            self.error = exc
        self.done = True


def tone(seconds: float, rate: int = 22_050) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    return (np.sin(2 * np.pi * 220 * t) * 8000).astype("<i2").tobytes()


@pytest.mark.slow
def test_a_document_streams_chunk_by_chunk_through_the_gateway(
    served: tuple[GatewayProcess, str], settings: Settings
) -> None:
    gateway, token = served
    owner = RedisOwner(settings, role="test")
    text = corpus(6000)  # longer than one job (5,000 characters): a document
    assert len(text) > settings.max_text_chars
    client = openai_client(gateway, token)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input=text, response_format="wav", stream_format="audio"
    ) as response:
        job_id = response.headers["x-ttsq-job-id"]
        pieces = response.iter_bytes()
        first = next(pieces)
        # The first chunk plays while later ones are still being made: the last is not stored yet.
        plan = owner.plans.load(job_id)
        assert plan is not None and len(plan["chunks"]) > 3
        last = [chunk["key"] for chunk in plan["chunks"] if chunk["key"]][-1]
        assert owner.cache_index.get(last) is None
        data = first + b"".join(pieces)
    stored, rate = stored_wav(gateway, token, job_id)
    assert data[4:8] == b"\xff\xff\xff\xff" and data[44:] == stored.astype("<i2").tobytes()  # byte for byte
    # SSE: deltas of the same bytes (now a cache hit: the stored file), then done.
    with http(gateway, token) as api:
        body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "wav", "stream_format": "sse"}
        events = [json.loads(line[6:]) for line in api.post("/v1/audio/speech", json=body).text.splitlines() if line]
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    samples, read_rate = soundfile.read(io.BytesIO(audio), dtype="int16")
    assert read_rate == rate and np.array_equal(samples, stored)
    owner.close()


@pytest.fixture
def no_worker(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> Iterator[tuple[GatewayProcess, str, AudioStreams]]:
    """A gateway whose fleet is known (a worker announced itself, then stopped) and nobody consuming the
    queue: the test plays the worker, writing the job's stream itself."""
    start_worker(settings).stop()
    owner = RedisOwner(settings, role="test")
    yield start_gateway(settings), api_key(settings), owner.streams
    owner.close()


def started_job(settings: Settings, count: int = 1) -> list[str]:
    wait_until(lambda: len(queued_task_ids(settings)) >= count, 30, "the job's message")
    return queued_task_ids(settings)


@pytest.mark.parametrize("response_format", ["wav", "mp3"])
def test_a_rerun_after_audio_was_sent_breaks_the_raw_response(
    no_worker: tuple[GatewayProcess, str, AudioStreams], settings: Settings, response_format: str
) -> None:
    gateway, token, streams = no_worker
    reader = Reader(gateway, token, {"model": "tts-1", "input": TEXT, "response_format": response_format})
    reader.start()
    (task_id,) = started_job(settings)
    streams.start(task_id, sample_rate=22_050, run="first")
    for seq in range(4):
        streams.audio(task_id, seq, tone(0.5))
    wait_until(lambda: len(reader.received) > 0, 30, "the first audio")
    assert reader.status == 200 and not reader.done
    streams.start(task_id, sample_rate=22_050, run="second")  # its worker died; the job runs again
    reader.join(30)
    assert reader.done and isinstance(reader.error, httpx.RemoteProtocolError), reader.error  # not a clean end
    assert metric(gateway, "ttsq_gateway_requests_total", route="/v1/audio/speech", status="broken") == 1


def test_an_error_after_audio_ends_sse_with_an_error_event_and_before_audio_is_an_http_error(
    no_worker: tuple[GatewayProcess, str, AudioStreams], settings: Settings
) -> None:
    gateway, token, streams = no_worker
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "stream_format": "sse"}
    with http(gateway, token) as api:
        got: list[dict[str, Any]] = []

        def read() -> None:
            with api.stream("POST", "/v1/audio/speech", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        got.append(json.loads(line.removeprefix("data: ")))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        (task_id,) = started_job(settings)
        streams.start(task_id, sample_rate=24_000, run="first")
        streams.audio(task_id, 0, tone(0.5, 24_000))
        wait_until(lambda: len(got) >= 1, 30, "the first delta")
        streams.error(task_id, RuntimeError("the engine ran out of memory"))
        thread.join(30)
        assert not thread.is_alive()
    assert got[0]["type"] == "speech.audio.delta" and base64.b64decode(got[0]["audio"]) == tone(0.5, 24_000)
    assert got[-1]["type"] == "speech.audio.error" and "speech.audio.done" not in [e["type"] for e in got]
    error = got[-1]["error"]
    assert error["code"] == "job_failed" and "RuntimeError" in error["message"] and "out of memory" in error["message"]

    # A job whose stream fails before any audio: the status says so, in OpenAI's shape.
    reader = Reader(gateway, token, {**body, "input": TEXT + " Another one."})
    reader.start()
    task_id = next(t for t in started_job(settings, 2) if t != task_id)
    streams.error(task_id, RuntimeError("no audio at all"))
    reader.join(30)
    assert reader.status == 500 and json.loads(reader.received)["error"]["code"] == "job_failed"


def test_a_joiner_reads_the_running_jobs_stream_and_a_client_that_leaves_costs_only_its_reader(
    no_worker: tuple[GatewayProcess, str, AudioStreams], settings: Settings
) -> None:
    gateway, token, streams = no_worker
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm"}
    first, second = Reader(gateway, token, body), Reader(gateway, token, body)
    first.start()
    (task_id,) = started_job(settings)
    second.start()
    wait_until(lambda: metric(gateway, "ttsq_gateway_streams_read") == 2, 30, "both readers")
    assert queued_task_ids(settings) == [task_id]  # single flight: one job
    streams.start(task_id, sample_rate=24_000, run="only")
    pieces = [tone(seconds, 24_000) for seconds in (0.1, 0.5, 0.25)]
    for seq, piece in enumerate(pieces):
        streams.audio(task_id, seq, piece)
    streams.end(task_id, {"duration_s": 0.3})
    first.join(30)
    second.join(30)
    assert first.error is None and second.error is None
    assert bytes(first.received) == bytes(second.received) == b"".join(pieces)
    assert first.headers["x-ttsq-job-id"] == second.headers["x-ttsq-job-id"] == task_id

    # A client that leaves after its first audio: its reader goes, nothing else does.
    left, seen = threading.Event(), []

    def leave() -> None:
        try:
            with (
                http(gateway, token) as api,
                api.stream("POST", "/v1/audio/speech", json={**body, "input": "Bye."}) as r,
            ):
                chunks = r.iter_raw()  # held: a dropped iterator closes the response
                seen.append(f"{r.status_code}: {len(next(chunks))} bytes")
                left.wait(30)
        except Exception as exc:  # said in the assertion below
            seen.append(repr(exc))

    leaving = threading.Thread(target=leave, daemon=True)
    leaving.start()
    (other,) = [t for t in started_job(settings, 2) if t != task_id]
    streams.start(other, sample_rate=24_000, run="only")
    streams.audio(other, 0, tone(0.5, 24_000))
    wait_until(lambda: bool(seen), 30, "the first audio of the client that leaves")
    assert seen[0].startswith("200: ") and metric(gateway, "ttsq_gateway_streams_read") == 1, seen
    left.set()
    leaving.join(30)
    wait_until(lambda: metric(gateway, "ttsq_gateway_streams_read") == 0, 30, "the reader gone")
    # Its request ends too (only the scrape itself is left in flight).
    wait_until(lambda: metric(gateway, "ttsq_gateway_requests_in_flight") == 1, 30, "the request ended")


# -- the rest of the OpenAI surface ------------------------------------------------------------


def test_models_voices_and_errors_in_openai_shape(served: tuple[GatewayProcess, str], settings: Settings) -> None:
    gateway, token = served
    client = openai_client(gateway, token)
    models = {model.id: model for model in client.models.list()}
    assert {"tts-1", "gpt-4o-mini-tts", "voice_design"} <= set(models)
    served_models = [m for m in models.values() if (m.model_extra or {}).get("ttsq", {}).get("kind") == "model"]
    assert served_models and served_models[0].owned_by == "espeak"
    assert client.models.retrieve("tts-1").id == "tts-1"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")

    with http(gateway, token) as api:
        voices = api.get("/v1/audio/voices").json()
        assert voices["object"] == "list" and all(v["type"] in ("speaker", "reference") for v in voices["data"])
        wav = io.BytesIO()
        soundfile.write(wav, np.sin(np.arange(24_000) / 9).astype(np.float32) * 0.3, 24_000, format="WAV")
        reference = api.post("/v1/voices", files={"file": ("ref.wav", wav.getvalue())}, data={"text": "hi"}).json()
        listed = api.get("/v1/audio/voices").json()["data"]
        assert {"id": reference["reference"], "type": "reference", "mode": "voice_clone"}.items() <= next(
            v for v in listed if v["id"] == reference["reference"]
        ).items()

        for method, path, status in [
            ("GET", "/v1/no-such-route", 404),
            ("GET", "/nothing/here", 404),
            ("PUT", "/v1/audio/speech", 405),
            ("DELETE", "/v1/models", 405),
        ]:
            answer = api.request(method, path)
            assert answer.status_code == status, (method, path)
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and "detail" not in answer.json()
        assert httpx.get(f"{gateway.url}/v1/nowhere").json()["error"]["code"] == "unknown_url"  # no key needed

    for voice in ("", "  "):
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(model="tts-1", voice=voice, input="Hello.")
        assert info.value.param == "voice" and "empty" in info.value.message


def test_a_cancelled_jobs_audio_is_gone_for_good(no_worker: tuple[GatewayProcess, str, AudioStreams]) -> None:
    gateway, token, _ = no_worker
    with http(gateway, token) as api:
        queued = api.post("/v1/jobs", json={"text": "Cancelled before any worker runs."}).json()
        assert api.delete(f"/v1/jobs/{queued['id']}").status_code == 200
        gone = api.get(f"/v1/jobs/{queued['id']}/audio")
    # A final status: 410, no Retry-After (a 409 with one would have the client poll forever).
    assert gone.status_code == 410 and "retry-after" not in gone.headers
    assert gone.json()["error"]["code"] == "cancelled" and "cancelled" in gone.json()["error"]["message"]


@pytest.mark.slow
def test_a_stream_that_stalls_after_its_first_audio_is_broken_off(
    no_worker: tuple[GatewayProcess, str, AudioStreams], settings: Settings
) -> None:
    gateway, token, streams = no_worker
    reader = Reader(gateway, token, {"model": "tts-1", "input": TEXT, "response_format": "pcm"})
    reader.start()
    (task_id,) = started_job(settings)
    streams.start(task_id, sample_rate=24_000, run="first")
    streams.audio(task_id, 0, tone(0.5, 24_000))
    wait_until(lambda: len(reader.received) > 0, 30, "the first audio")
    started = time.monotonic()
    reader.join(60)  # its worker went quiet: 30 s without a piece
    assert reader.done and isinstance(reader.error, httpx.RemoteProtocolError), reader.error
    assert time.monotonic() - started >= 25 and bytes(reader.received) == tone(0.5, 24_000)


def test_a_request_joined_to_a_job_that_does_not_stream_gets_its_stored_file(
    no_worker: tuple[GatewayProcess, str, AudioStreams], settings: Settings, start_worker: StartWorker
) -> None:
    gateway, token, _ = no_worker
    with http(gateway, token) as api:
        plain = api.post("/v1/jobs", json={"text": TEXT, "format": "wav"}).json()  # not streamed
    reader = Reader(gateway, token, {"model": "tts-1", "input": TEXT, "response_format": "wav"})
    reader.start()
    wait_until(lambda: metric(gateway, "ttsq_gateway_streams_read") == 1, 30, "the joiner reading")
    assert queued_task_ids(settings) == [plain["id"]]  # single flight: the speech request joined it
    start_worker(settings, name="w2")  # the job runs, whole, writing no stream
    reader.join(60)
    assert reader.error is None and reader.status == 200 and reader.headers["x-ttsq-job-id"] == plain["id"]
    assert stream_entries(settings, plain["id"]) == []
    with http(gateway, token) as api:
        assert bytes(reader.received) == api.get(f"/v1/jobs/{plain['id']}/audio").content  # the stored file
    assert first_audio_count(gateway, "stored") == 1


@pytest.mark.parametrize("response_format", ["pcm", "wav", "mp3", "opus"])
def test_the_encoders_pieces_joined_are_one_readable_file(response_format: str) -> None:
    """Piece by piece, as a stream's pieces come: the bytes joined decode whole, at the full length."""
    rate = 22_050
    clip = tone(2.0, rate)
    coder = encoder(response_format, rate)
    pieces = [clip[i : i + 11_024] for i in range(0, len(clip), 11_024)]  # odd-sized halves of a second
    data = b"".join([*(coder.feed(piece) for piece in pieces), coder.finish()])
    if response_format == "pcm":
        assert len(data) // 2 == round(len(clip) // 2 * 24_000 / rate)
        return
    if response_format == "wav":
        with wave.open(io.BytesIO(data)) as reader:  # sizes 0xFFFFFFFF: read to the end of the bytes
            assert reader.getframerate() == rate and reader.readframes(10**9) == clip
    samples, read_rate = soundfile.read(io.BytesIO(data), dtype="float32")
    seconds = len(samples) / read_rate
    # mp3 keeps its encoder's delay and padding and one silent first frame (no Info header to trim them).
    assert seconds == pytest.approx(2.0, abs=0.15 if response_format == "mp3" else 0.03)
    assert np.sqrt(np.mean(samples**2)) > 0.1


# -- backpressure: slow and silent clients hold a bounded buffer, and give it back ------------------


def long_text(n: int, chars: int) -> str:
    """About ``chars`` characters of English for espeak (2,700: about 2.5 minutes of audio), distinct by ``n``."""
    words = f"Client {n} listens to a long passage about rivers, mills and the weather over the hills."
    return " ".join([words] * (chars // len(words) + 1))


def rss_bytes(gateway: GatewayProcess) -> int:
    with open(f"/proc/{gateway.process.pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.mark.slow
def test_clients_that_read_slowly_or_never_cost_a_bounded_buffer_and_give_it_back(
    served: tuple[GatewayProcess, str],
) -> None:
    """Acceptance (issue 41): 10 clients that never read and 10 that read 4 KB every half second, then
    all close: the gateway's memory within 80 MB of where it started 20 s later (an unbounded queue per
    reader took it up 271 MB and kept it), and the streams read beside them are the stored files."""
    gateway, token = served
    with http(gateway, token) as api:  # warm: the first stream's imports and encoders are counted before
        api.post("/v1/audio/speech", json={"model": "tts-1", "input": "Warm up.", "response_format": "wav"})
    before = rss_bytes(gateway)
    stop = threading.Event()
    opened: list[str] = []

    def client(n: int, reads: bool) -> None:
        body = {"model": "tts-1", "input": long_text(n, 2700), "response_format": "wav"}
        with http(gateway, token) as api, api.stream("POST", "/v1/audio/speech", json=body) as response:
            opened.append(response.headers["x-ttsq-job-id"])
            chunks = response.iter_raw(4096)
            while not stop.wait(0.5):
                if reads:
                    next(chunks, None)

    clients = [threading.Thread(target=client, args=(n, n % 2 == 0), daemon=True) for n in range(20)]
    for thread in clients:
        thread.start()
    # Beside them, clients that read as fast as the audio comes: their streams are the stored files.
    fast = [
        Reader(gateway, token, {"model": "tts-1", "input": long_text(100 + n, 700), "response_format": "wav"})
        for n in range(3)
    ]
    for reader in fast:
        reader.start()
    for reader in fast:
        reader.join(120)
        assert reader.done and reader.error is None and reader.status == 200
        stored, _ = stored_wav(gateway, token, reader.headers["x-ttsq-job-id"])
        assert bytes(reader.received[44:]) == stored.astype("<i2").tobytes()
    wait_until(lambda: len(opened) == 20, 120, "every slow client's first audio")
    with http(gateway, token) as api:  # every slow client's job is made: the window has moved past them
        for job_id in opened:
            wait_until(lambda j=job_id: api.get(f"/v1/jobs/{j}").json()["state"] == "SUCCESS", 120, "the job")
    held = rss_bytes(gateway)
    stop.set()
    for thread in clients:
        thread.join(30)
    wait_until(lambda: metric(gateway, "ttsq_gateway_streams_read") == 0, 30, "every reader gone")
    time.sleep(20)  # what the acceptance measures: memory 20 s after the clients left, not a timing
    after = rss_bytes(gateway)
    print(f"gateway RSS: {before} at the start, {held} with the clients open, {after} 20 s after they left")
    assert after - before < 80 * 2**20, f"gateway RSS went from {before} to {held} (clients open) to {after} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("response_format", ["wav", "mp3"])
def test_a_client_that_falls_behind_the_window_gets_the_rest_from_the_stored_file(
    settings: Settings,
    start_worker: StartWorker,
    start_gateway: StartGateway,
    faulty_engine: str,
    response_format: str,
) -> None:
    """A client that stops reading after its first audio: its reader stops at its bound, the worker
    trims the stream past it, and what the client reads later comes from the stored file, from the
    sample it had reached: for wav the stored samples, byte for byte."""
    faulty = settings.replace(engine=faulty_engine)
    start_worker(faulty.replace(stream_window_s=1))
    gateway, token = start_gateway(faulty.replace(gateway_stream_buffer_bytes=4096)), api_key(settings)
    # [slow]: the gateway reads the stream from its start. Longer than what the sockets between
    # gateway and client buffer (megabytes on loopback): about 4 minutes of audio.
    body = {"model": "tts-1", "input": "[slow] " + long_text(7, 4500), "response_format": response_format}
    with http(gateway, token) as api, api.stream("POST", "/v1/audio/speech", json=body) as response:
        job_id = response.headers["x-ttsq-job-id"]
        chunks = response.iter_raw(1024)
        data = next(chunks)
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS", 60, "the job")
        assert stream_entries(settings, job_id)[0] == "audio"  # the start and the early pieces are gone
        data += b"".join(chunks)
    if response_format == "wav":
        stored, _ = stored_wav(gateway, token, job_id)
        assert data[44:] == stored.astype("<i2").tobytes()
    else:
        with http(gateway, token) as api:
            duration = float(api.get(f"/v1/jobs/{job_id}").json()["result"]["duration_s"])
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        assert len(samples) / rate == pytest.approx(duration, abs=0.15)  # one file, its whole length


def test_a_late_reader_sends_the_bytes_a_live_one_would(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    """A gateway paused (SIGSTOP) while the worker writes and trims the whole stream: its reader finds
    the stream moved past it and goes on from the stored file; its pcm and wav are the bytes a live
    reader sends (a wav with the streamed header), not the stored file as is."""
    worker = start_worker(settings.replace(stream_window_s=1))
    gateway, token = start_gateway(settings), api_key(settings)
    # Stream pieces are bytes: the kinds are what these reads need.
    cache = redis.Redis.from_url(settings.cache_url, decode_responses=True, encoding_errors="replace")
    for response_format in ("wav", "pcm"):
        body = {
            "model": "tts-1",
            "input": f"{TEXT} {TEXT} Late, in {response_format}.",
            "response_format": response_format,
        }
        reader = Reader(gateway, token, body)
        late_reader(
            worker.process,
            gateway.process,
            reader.start,
            lambda: metric(gateway, "ttsq_gateway_streams_read") == 1,
            lambda: any(
                fields["kind"] == "end" for key in cache.keys(STREAM_PREFIX + "*") for _, fields in cache.xrange(key)
            ),
        )
        reader.join(60)
        assert reader.error is None and reader.status == 200
        stored, rate = stored_wav(gateway, token, reader.headers["x-ttsq-job-id"])
        data = bytes(reader.received)
        if response_format == "wav":
            assert data[4:8] == b"\xff\xff\xff\xff" and data[44:] == stored.astype("<i2").tobytes()
        else:
            received = np.frombuffer(data, dtype="<i2").astype(np.int32)
            expected = np.interp(
                np.arange(round(stored.size * 24_000 / rate)) * (rate / 24_000),
                np.arange(stored.size),
                stored / 32768.0,
            )
            assert received.size == expected.size
            assert np.abs(received - np.clip(np.floor(expected * 32768.0), -32768, 32767)).max() <= 1
        for key in cache.keys(STREAM_PREFIX + "*"):
            cache.delete(key)  # this test's own streams: the next format looks for its own end
    cache.close()
