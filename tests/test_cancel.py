"""Cancel says what then happens (docs/guarantees.md, "Cancel"): whatever phase a job is in when it is
cancelled, the state the cancel answers is the state the job ends in, and audio a worker made is kept.

Real workers run the stand-in engine made slow (``TTSQ_STANDIN_A_US``), so a cancel can land inside an
engine call; the attempts ledger (charged while a job is in its engine call) says when it is there.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis
from support import GatewayProcess, WorkerProcess, api_key, wait_until

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import ACCEPTED_PREFIX, STREAM_PREFIX
from ttsq.errors import JobFailed

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]

#: The stand-in at 1 s of device time per second of audio: a sentence is an engine call of a few seconds.
SLOW_US = 1_000_000


def slow(settings: Settings) -> Settings:
    # Texts of up to 200 characters: a full batch fits the per-batch limit (the worker checks at start).
    return settings.replace(engine="standin", standin_a_us=SLOW_US, standin_b_us=0, max_text_chars=200)


def in_engine_call(client: Client, task_id: str) -> None:
    wait_until(lambda: client.redis.attempts.attempts(task_id) >= 1, 60, "the job's engine call")


def final_state(client: Client, task_id: str, worker: WorkerProcess, task: str = "ttsq.synthesize") -> str:
    """The job's state once its worker is done with it: Celery logs a task's end after storing its state
    (or storing none: ``ignored``), the gate a message it drops, Celery one it discards as revoked. A
    document ends with its stitch (``task``), which carries its id."""
    ends = [f"{task}[{task_id}] {word}" for word in ("succeeded", "ignored", "raised")]
    ends += [f"job {task_id}: cancelled before it ran", f"Discarding revoked task: {task}[{task_id}]"]
    wait_until(lambda: any(end in worker.log() for end in ends), 60, "the job's end")
    return str(client.status(task_id)["state"])


def test_a_job_cancelled_in_its_engine_call_ends_revoked_and_its_audio_is_cached(
    settings: Settings, start_worker: StartWorker
) -> None:
    worker = start_worker(slow(settings))
    client = Client(settings)
    text = "Cancelled while the engine speaks it."
    job = client.submit(text)
    in_engine_call(client, job.id)
    assert client.cancel(job.id) == "REVOKED"

    assert final_state(client, job.id, worker) == "REVOKED"
    with pytest.raises(JobFailed, match="TaskRevokedError"):
        client.wait(job.id, timeout=10)
    # The audio was made: it is kept, and the same text is answered from the cache, with no engine call.
    again = client.submit(text)
    assert again.result is not None and again.result["cached"] is True
    assert worker.log().count(": synthesized ") == 1
    # A cancel of a job that has ended changes nothing and says so.
    assert client.cancel(job.id) == "REVOKED"


def test_a_job_whose_canceller_died_after_its_cancel_won_still_ends_revoked(
    settings: Settings, start_worker: StartWorker
) -> None:
    """``Client.cancel`` wins in the job's record, then finishes it and stores REVOKED; a canceller that
    dies between the two (here: the record's cancel alone, as ``Client.cancel`` makes it) left a queued
    job PENDING forever, its copy dropped by the worker with nothing stored. The worker stores it now."""
    client = Client(settings)
    job = client.submit("Cancelled by a client that did not live to say so.")
    assert client.accepted.cancel(job.id, ttl_s=settings.result_ttl_s) is None  # and then the client died
    worker = start_worker(settings)
    dropped = f"job {job.id}: cancelled before it ran; dropped"
    wait_until(lambda: dropped in worker.log(), 60, "the worker to drop the job's copy")
    # Before: nothing stored, and the record's fields gone with the copy: "unknown job", for ever.
    wait_until(lambda: client.async_result(job.id).state == "REVOKED", 10, "the job to end REVOKED")
    assert client.status(job.id)["state"] == "REVOKED"
    assert ": synthesized " not in worker.log()


def test_the_answer_to_a_cancel_is_the_state_the_job_ends_in(settings: Settings, start_worker: StartWorker) -> None:
    """Cancels land in every phase (queued, in the engine call, storing, done): each answer is the end."""
    worker = start_worker(slow(settings).replace(max_batch=1, standin_a_us=300_000))
    client = Client(settings)
    jobs = [client.submit(f"Sentence number {i} of a run that is cancelled bit by bit.") for i in range(6)]
    in_engine_call(client, jobs[0].id)
    answers: dict[str, str] = {}
    for index in (0, 5, 2, 1, 4, 3):  # the first in its engine call, the last queued, then as they come
        answers[jobs[index].id] = client.cancel(jobs[index].id)
        time.sleep(0.5)  # about a third of one job's engine call
    ended = {job.id: final_state(client, job.id, worker) for job in jobs}
    assert ended == answers
    assert answers[jobs[0].id] == answers[jobs[5].id] == "REVOKED"


def test_a_stream_cancelled_through_the_gateway_ends_with_an_error_and_stays_revoked(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    worker = start_worker(slow(settings))
    gateway = start_gateway(settings)
    client = Client(settings)
    headers = {"Authorization": f"Bearer {api_key(settings)}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as api:
        job: dict[str, Any] = api.post("/v1/jobs", json={"text": "Streamed, then called off.", "stream": True}).json()
        in_engine_call(client, job["id"])
        answer = api.delete(f"/v1/jobs/{job['id']}")
        assert answer.status_code == 200 and answer.json() == {"id": job["id"], "state": "REVOKED"}

        assert final_state(client, job["id"], worker) == "REVOKED"
        assert api.get(f"/v1/jobs/{job['id']}").json()["state"] == "REVOKED"
        assert api.get(f"/v1/jobs/{job['id']}/audio").status_code == 410
        # Stream pieces are bytes: the kinds are what these reads need.
        cache = redis.Redis.from_url(settings.cache_url, decode_responses=True, encoding_errors="replace")
        try:
            kinds = [fields["kind"] for _, fields in cache.xrange(STREAM_PREFIX + job["id"])]
        finally:
            cache.close()
        assert kinds[-1] == "error" and "end" not in kinds, kinds
        again = api.post("/v1/jobs", json={"text": "Streamed, then called off."}).json()
        assert again["state"] == "SUCCESS" and again["result"]["cached"] is True, again


def test_cancel_and_settle_are_one_transition_whichever_comes_first(settings: Settings) -> None:
    accepted = Client(settings).accepted
    # The worker first: the cancel answers what the worker settled, and changes nothing.
    assert accepted.settle("done-first", "SUCCESS", ttl_s=60)
    assert accepted.cancel("done-first", ttl_s=60) == "SUCCESS"
    assert not accepted.cancelled("done-first")
    # The cancel first: the worker's outcome does not stand, and later cancels still answer REVOKED.
    assert accepted.cancel("cancelled-first", ttl_s=60) is None
    assert not accepted.settle("cancelled-first", "SUCCESS", ttl_s=60)
    assert accepted.cancel("cancelled-first", ttl_s=60) is None and accepted.cancelled("cancelled-first")
    # A parked job sent again (``ttsq retry``) forgets its FAILURE: it may be cancelled anew.
    assert accepted.settle("retried", "FAILURE", ttl_s=60)
    accepted.unsettle("retried")
    assert accepted.cancel("retried", ttl_s=60) is None


def test_a_document_cancelled_while_its_chunks_run_ends_revoked_and_keeps_their_audio(
    settings: Settings, start_worker: StartWorker
) -> None:
    small = slow(settings).replace(doc_target_chars=30, doc_max_chars=60)
    worker = start_worker(small)
    client = Client(small)
    document = client.submit_document("The first sentence of a document. The second sentence of it.")
    # Both chunks are at the worker (past the queue): they run to the end; the stitch, which carries the
    # document's id, is dropped when it arrives (or, already running, settles against the cancel).
    wait_until(lambda: worker.log().count("Task ttsq.synthesize[") >= 2, 60, "the chunks at the worker")
    assert client.cancel(document.id) == "REVOKED"
    assert final_state(client, document.id, worker, "ttsq.stitch") == "REVOKED"
    assert worker.log().count(": synthesized ") == 2  # the chunks' audio is made and cached


def test_a_speech_stream_whose_job_is_cancelled_ends_with_a_cancelled_error(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    """SSE says ``cancelled`` as ``/audio`` does (it said ``job_failed``, with ``JobCancelled`` in its
    message): a client tells a cancel from a failure by the code."""
    start_worker(slow(settings))
    gateway = start_gateway(settings)
    client = Client(settings)
    headers = {"Authorization": f"Bearer {api_key(settings)}"}
    events: list[dict[str, Any]] = []

    def listen() -> None:
        body = {"model": "tts-1", "input": "Spoken, then called off.", "response_format": "pcm", "stream_format": "sse"}
        with (
            httpx.Client(base_url=gateway.url, headers=headers, timeout=120) as api,
            api.stream("POST", "/v1/audio/speech", json=body) as response,
        ):
            events.extend(json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: "))

    listener = threading.Thread(target=listen)
    listener.start()
    cache = redis.Redis.from_url(settings.cache_url, decode_responses=True)
    try:
        wait_until(lambda: bool(cache.keys(ACCEPTED_PREFIX + "*")), 60, "the speech job accepted")
        task_id = cache.keys(ACCEPTED_PREFIX + "*")[0].removeprefix(ACCEPTED_PREFIX)
    finally:
        cache.close()
    in_engine_call(client, task_id)
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as api:
        assert api.delete(f"/v1/jobs/{task_id}").json()["state"] == "REVOKED"
    listener.join(120)
    assert events and events[-1]["type"] == "speech.audio.error", events[-1:]
    assert events[-1]["error"]["code"] == "cancelled", events[-1]
    client.close()
