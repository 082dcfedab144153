"""One way to send a job (accept, send, withdraw on failure) and one way to read what it left.

Against a real Redis: ``ttsq retry`` with the broker unreachable, the sweeper's re-send, the reader on
every shape of record Celery's result backend stores (written by Celery's own backend) and on records
no worker wrote, and the gateway rendering what the reader read.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from kombu.exceptions import OperationalError
from support import GatewayProcess, api_key, queue_length, run_cli, wait_until

from ttsq.app import make_app, queue_for, stored_result
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import ACCEPTED_PREFIX, CHORD_HEADER, TASK_NAME
from ttsq.errors import BrokerError, CorruptRecord, InvalidRequest, JobFailed, JobParked
from ttsq.job import SynthesisRequest
from ttsq.observer import Observer
from ttsq.ops.redis_server import free_port
from ttsq.records.attempts import ParkedJob
from ttsq.records.owner import RedisOwner
from ttsq.results import read_meta
from ttsq.sending import Outgoing, send_job
from ttsq.worker.sweeper import Sweeper

StartGateway = Callable[..., GatewayProcess]
PARKED = "was in 2 engine calls that never returned; parked: `ttsq retry` re-queues it"


@pytest.fixture
def owner(settings: Settings) -> Iterator[RedisOwner]:
    made = RedisOwner(settings, role="test")
    yield made
    made.close()


@pytest.fixture
def app(settings: Settings) -> Iterator[Any]:
    made = make_app(settings)
    yield made
    made.close()


def park(settings: Settings, owner: RedisOwner, app: Any) -> str:
    """Park a job the way a worker does once its attempts ran out: its attempts, its parked entry, and
    its ``JobParked`` failure stored as its result."""
    task_id = str(uuid.uuid4())
    for _ in range(2):  # two engine calls that never returned
        owner.attempts.charge(task_id)
    kwargs = SynthesisRequest.from_dict({"text": "A job that crashed its workers."}).to_dict()
    owner.attempts.park(
        ParkedJob(id=task_id, queue=settings.queue, kwargs=kwargs, attempts=2, error=PARKED, parked_at=time.time())
    )
    app.backend.store_result(task_id, JobParked(f"job {task_id} {PARKED}"), "FAILURE")
    return task_id


def sweep_for_a_while(settings: Settings, owner: RedisOwner, app: Any) -> int:
    """Sweep the way a worker's sweeper does, in this process, long enough for a job accepted now to
    count as lost (the grace, then suspect in two sweeps); return how many jobs it sent again."""
    sweeper = Sweeper(app, settings, owner, Observer(), node="sweeper@test")
    sent = 0
    give_up = time.monotonic() + 3 * settings.lost_job_grace_s + 3
    while time.monotonic() < give_up:
        sent += sweeper.sweep()
        time.sleep(0.25)
    return sent


def outgoing(settings: Settings, text: str = "One job, sent once.") -> Outgoing:
    return Outgoing(
        task_id=str(uuid.uuid4()),
        task=TASK_NAME,
        queue=settings.queue,
        kwargs=SynthesisRequest.from_dict({"text": text}).to_dict(),
        headers={},
        kwargsrepr="<a test job>",
    )


# -- ttsq retry: one send path, withdrawn when the send fails -------------------------------------


@pytest.mark.slow
def test_a_retry_the_broker_refuses_keeps_the_job_parked_and_leaves_nothing_to_send(
    settings: Settings, owner: RedisOwner, app: Any
) -> None:
    """``ttsq retry`` with the broker down: the job stays parked with its failure, as the operator found
    it, and no accepted record is left behind for the sweeper to send behind the operator's back (with
    its attempts cleared, so the worker would not isolate it)."""
    settings = settings.replace(lost_job_grace_s=1)
    task_id = park(settings, owner, app)
    down = f"redis://127.0.0.1:{free_port()}"
    out = run_cli("--broker-url", f"{down}/0", "retry", task_id, settings=settings, timeout=60)
    lines = out.stderr.decode().strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and lines[0].startswith(f"ttsq: error: cannot re-queue {task_id}")

    assert [job.id for job in owner.attempts.parked()] == [task_id]
    assert not owner.accepted.exists(task_id)  # the record written for the send is withdrawn
    with Client(settings) as client:
        assert client.status(task_id)["state"] == "FAILURE"  # the failure the operator saw, still there
        with pytest.raises(JobParked, match="re-queues it"):
            client.wait(task_id, timeout=5)
    assert sweep_for_a_while(settings, owner, app) == 0  # nothing for the sweeper to send
    assert queue_length(settings) == 0


def test_a_retry_sends_the_parked_job_with_its_record(settings: Settings, owner: RedisOwner, app: Any) -> None:
    task_id = park(settings, owner, app)
    with Client(settings) as client:
        assert client.retry(task_id) == task_id
        assert client.parked() == []
        assert client.status(task_id)["state"] == "PENDING"  # the old failure no longer answers a waiter
    record = owner.accepted.get(task_id)
    assert record is not None and (record.task, record.queue) == (TASK_NAME, settings.queue)
    assert owner.attempts.attempts(task_id) == 0
    (message,) = redis.Redis.from_url(settings.broker_url).lrange(settings.queue, 0, -1)
    headers = json.loads(message)["headers"]
    assert (headers["id"], headers["ttsq_seq"]) == (task_id, record.seq)


def test_a_retry_with_every_redis_down_is_a_broker_error_and_the_job_stays_parked(
    settings: Settings, owner: RedisOwner, app: Any
) -> None:
    task_id = park(settings, owner, app)
    down = f"redis://127.0.0.1:{free_port()}"
    broken = settings.replace(broker_url=f"{down}/0", result_backend=f"{down}/1")
    with Client(broken) as client, pytest.raises(BrokerError, match="cannot re-queue"):
        client.retry(task_id)
    assert [job.id for job in owner.attempts.parked()] == [task_id]
    assert not owner.accepted.exists(task_id)


# -- send_job and the sweeper ---------------------------------------------------------------------


def test_send_job_records_then_sends_and_withdraws_what_it_could_not_send(
    settings: Settings, owner: RedisOwner, app: Any
) -> None:
    sent = outgoing(settings)
    send_job(app, owner.accepted, sent)
    record = owner.accepted.get(sent.task_id)
    assert record is not None and record.seen_at is None and record.kwargs == sent.kwargs
    (message,) = redis.Redis.from_url(settings.broker_url).lrange(settings.queue, 0, -1)
    assert json.loads(message)["headers"]["ttsq_seq"] == record.seq
    redis.Redis.from_url(settings.broker_url).delete(settings.queue)

    down = make_app(settings.replace(broker_url=f"redis://127.0.0.1:{free_port()}/0"))
    lost, kept = outgoing(settings, "Not sent: withdrawn."), outgoing(settings, "Not sent: kept.")
    for job, withdraw in ((lost, True), (kept, False)):
        with pytest.raises(OperationalError):  # the broker's own error: the caller says what failed
            send_job(down, owner.accepted, job, withdraw=withdraw)
    down.close()
    assert not owner.accepted.exists(lost.task_id)  # a producer's send: its caller was told it failed
    assert owner.accepted.exists(kept.task_id)  # the sweeper's: still accepted, the next sweep tries again
    assert queue_length(settings) == 0


@pytest.mark.slow
def test_the_sweeper_sends_a_lost_job_again_and_drops_the_record_of_a_finished_one(
    settings: Settings, owner: RedisOwner, app: Any
) -> None:
    settings = settings.replace(lost_job_grace_s=1)
    lost, finished = outgoing(settings, "Lost on its way."), outgoing(settings, "Finished, record left.")
    # Given back once (its worker died before it took the message in), then lost: REQUEUED is no worker's.
    requeued = outgoing(settings, "Given back, then lost.")
    for job in (lost, finished, requeued):
        send_job(app, owner.accepted, job)
    first = owner.accepted.get(lost.task_id)
    redis.Redis.from_url(settings.broker_url).delete(settings.queue)  # every message lost
    app.backend.store_result(finished.task_id, {"key": "done"}, "SUCCESS")
    app.backend.store_result(requeued.task_id, {"reason": "its worker w1 died; waiting to run again"}, "REQUEUED")
    # Both overdue by the first sweep: one that turned overdue a sweep after the other stopped being
    # behind once the other was sent again (its message is in the queue now, and no worker here takes
    # it), and waited for a worker to move the queue past it (one run in three CI runs, under load).
    time.sleep(settings.lost_job_grace_s + 0.5)

    assert sweep_for_a_while(settings, owner, app) == 2
    again = owner.accepted.get(lost.task_id)
    assert first is not None and again is not None and again.seq > first.seq  # accepted again, then sent
    assert not owner.accepted.exists(finished.task_id)
    messages = redis.Redis.from_url(settings.broker_url).lrange(settings.queue, 0, -1)
    sent = {json.loads(message)["headers"]["id"]: json.loads(message)["headers"]["ttsq_seq"] for message in messages}
    assert sent.keys() == {lost.task_id, requeued.task_id} and sent[lost.task_id] == again.seq


@pytest.mark.slow
def test_lost_jobs_in_two_queues_are_both_sent_again(settings: Settings, owner: RedisOwner, app: Any) -> None:
    """A sweep of one queue forgot the suspects of the others: with lost jobs in two queues (two lanes
    here), each queue's sweep reset the other's, and neither was ever sent again."""
    settings = settings.replace(lost_job_grace_s=1)
    bulk = queue_for(settings.queue, "voice_design", "bulk")
    jobs = [outgoing(settings, "Lost in the interactive lane."), outgoing(settings, "Lost in the bulk lane.")]
    jobs[1] = dataclasses.replace(jobs[1], queue=bulk)
    for job in jobs:
        send_job(app, owner.accepted, job)
    redis.Redis.from_url(settings.broker_url).delete(settings.queue, bulk)  # both messages lost
    assert sweep_for_a_while(settings, owner, app) == 2


def test_a_job_a_worker_has_just_popped_is_not_sent_again(settings: Settings, owner: RedisOwner, app: Any) -> None:
    """kombu pops a message (BRPOP) before the worker's gate marks its job received: for that moment the
    job is in no list and unseen. The sweeper must not take it for lost on one look, or the job is sent
    twice (the second copy left in the queue is what a test once found after all its results were in)."""
    settings = settings.replace(lost_job_grace_s=1)
    job = outgoing(settings, "Popped, about to be marked received.")
    send_job(app, owner.accepted, job)
    accepted = owner.accepted.get(job.task_id)
    assert accepted is not None
    broker = redis.Redis.from_url(settings.broker_url)
    assert broker.rpop(settings.queue) is not None  # what kombu's BRPOP does; the gate has not run yet
    sweeper = Sweeper(app, settings, owner, Observer(), node="sweeper@test")
    time.sleep(1.1)  # past the grace: the job counts as suspect from here on
    assert sweeper.sweep() == 0  # suspect
    time.sleep(1.1)
    assert sweeper.sweep() == 0  # confirmed suspect, and in no list: seen missing once
    # The worker's gate takes it in (late, on a loaded machine): the next sweep finds it received.
    owner.accepted.received(job.task_id, task=job.task, queue=job.queue, seq=accepted.seq, plain=True)
    assert sweeper.sweep() == 0
    assert broker.llen(settings.queue) == 0
    broker.close()


# -- the one reader ---------------------------------------------------------------------------------


RESULT = {"key": "k" * 64, "object_key": "audio/ab/" + "a" * 64 + ".wav", "url": "https://x/y", "duration_s": 1.0}


def test_the_reader_on_what_celery_stores(app: Any) -> None:
    def stored(value: Any, state: str) -> str:
        task_id = str(uuid.uuid4())
        app.backend.store_result(task_id, value, state)
        return task_id

    done = stored_result(app, stored(RESULT, "SUCCESS"))
    assert (done.state, done.done, done.value(), done.error) == ("SUCCESS", True, RESULT, None)

    refused = stored_result(app, stored(InvalidRequest("language", "unknown value 'klingon'"), "FAILURE"))
    assert refused.done and isinstance(refused.error, InvalidRequest) and refused.error.field == "language"
    assert str(refused.failure) == "InvalidRequest: invalid language: unknown value 'klingon'"
    assert refused.failure is not None and refused.failure.reason == "unknown value 'klingon'"
    with pytest.raises(InvalidRequest):
        refused.value()

    parked_id = stored(JobParked(f"job x {PARKED}"), "FAILURE")
    with pytest.raises(JobParked, match="re-queues it"):
        stored_result(app, parked_id).value()

    crashed_id = stored(RuntimeError("boom"), "FAILURE")
    crashed = stored_result(app, crashed_id)
    assert str(crashed.failure) == "RuntimeError: boom"
    with pytest.raises(JobFailed, match=f"^job {crashed_id} failed: RuntimeError: boom$"):
        crashed.value()

    revoked_id = str(uuid.uuid4())
    app.backend.mark_as_revoked(revoked_id, "cancelled")
    revoked = stored_result(app, revoked_id)
    assert revoked.state == "REVOKED" and revoked.done
    with pytest.raises(JobFailed, match="TaskRevokedError: cancelled"):
        revoked.value()

    progress = stored_result(app, stored({"chunks_done": 1, "chunks_total": 3, "audio_s": 2.0}, "PROGRESS"))
    assert not progress.done and progress.progress == {"chunks_done": 1, "chunks_total": 3, "audio_s": 2.0}
    started = stored_result(app, stored({"pid": 1, "hostname": "w1"}, "STARTED"))
    assert (started.state, started.done, started.result) == ("STARTED", False, None)
    pending = stored_result(app, str(uuid.uuid4()))
    assert (pending.state, pending.done) == ("PENDING", False)


def _failure(exc_type: str, exc_module: str, exc_message: Any) -> dict[str, Any]:
    result = {"exc_type": exc_type, "exc_module": exc_module, "exc_message": exc_message}
    return {"status": "FAILURE", "result": result, "traceback": None}


CORRUPT: list[Any] = [
    b"\xff not json",
    b"[1, 2]",
    b"null",
    {"result": {}},
    {"status": 7, "result": {}},
    {"status": "SUCCESS", "result": "a string"},
    {"status": "SUCCESS"},
    {"status": "FAILURE", "result": "boom"},
    {"status": "FAILURE", "result": {"exc_message": ["no type"]}},
    {"status": "REVOKED", "result": None},
    {"status": "PROGRESS", "result": [1]},
    _failure("InvalidRequest", "ttsq.errors", ["one argument where two are due"]),
    _failure("InvalidRequest", "ttsq.errors", {"field": "text"}),
]


@pytest.mark.parametrize("record", CORRUPT, ids=range(len(CORRUPT)))
def test_a_record_no_worker_wrote_is_a_corrupt_record_everywhere_it_is_read(
    settings: Settings, app: Any, record: Any
) -> None:
    task_id = str(uuid.uuid4())
    raw = record if isinstance(record, bytes) else json.dumps(record).encode()
    redis.Redis.from_url(settings.result_backend).set(f"celery-task-meta-{task_id}", raw)
    with pytest.raises(CorruptRecord):
        stored_result(app, task_id)
    with Client(settings) as client:
        with pytest.raises(CorruptRecord):
            client.status(task_id)
        with pytest.raises(CorruptRecord):
            client.wait(task_id, timeout=5)


def test_a_key_of_another_type_under_a_result_name_is_a_corrupt_record(settings: Settings, app: Any) -> None:
    task_id = str(uuid.uuid4())
    redis.Redis.from_url(settings.result_backend).rpush(f"celery-task-meta-{task_id}", "not a result")
    with pytest.raises(CorruptRecord, match="cannot be read"):
        stored_result(app, task_id)


def test_the_reader_rebuilds_only_ttsq_errors_never_what_a_record_names() -> None:
    # Celery itself refuses a non-exception here; the reader does not even look outside ttsq.errors.
    for exc_type, module in (("system", "os"), ("TTSQError", "builtins"), ("BrokerError", "ttsq.client")):
        read = read_meta(_failure(exc_type, module, ["touch /tmp/pwned"]), "forged")
        assert isinstance(read.error, JobFailed) and read.failure is not None and read.failure.kind == exc_type
    not_an_error = read_meta(_failure("TASK_NAME", "ttsq.errors", ["x"]), "forged")
    assert isinstance(not_an_error.error, JobFailed)


# -- the gateway renders what the reader read ------------------------------------------------------


@pytest.mark.parametrize(
    ("failure", "status", "code", "message"),
    [
        (InvalidRequest("language", "unknown value 'klingon'"), 400, "invalid_value", "invalid language: unknown"),
        (RuntimeError("the engine fell over"), 500, "job_failed", "the job failed: RuntimeError: the engine fell"),
        (JobParked(f"job x {PARKED}"), 500, "job_failed", "the job failed: JobParked: job x was in 2"),
        (None, 410, "cancelled", "was cancelled: it has no audio and never will"),
    ],
)
def test_the_gateway_answers_a_failed_job_from_the_stored_failure(
    settings: Settings,
    start_gateway: StartGateway,
    owner: RedisOwner,
    app: Any,
    failure: BaseException | None,
    status: int,
    code: str,
    message: str,
) -> None:
    gateway = start_gateway(settings)
    token = api_key(settings)
    answers: list[httpx.Response] = []

    def generate() -> None:
        body = {"text": "Nobody serves this; its failure is stored by hand."}
        headers = {"Authorization": f"Bearer {token}"}
        answers.append(httpx.post(f"{gateway.url}/generate", json=body, headers=headers, timeout=60))

    waiting = threading.Thread(target=generate, daemon=True)
    waiting.start()
    wait_until(lambda: bool(owner.cache.keys(ACCEPTED_PREFIX + "*")), 30, "the gateway to accept the job")
    (key,) = owner.cache.keys(ACCEPTED_PREFIX + "*")
    task_id = str(key).removeprefix(ACCEPTED_PREFIX)
    if failure is None:
        app.backend.mark_as_revoked(task_id, "cancelled")
    else:
        app.backend.store_result(task_id, failure, "FAILURE")
    waiting.join(60)
    (answer,) = answers
    error = answer.json()["error"]
    assert (answer.status_code, error["code"]) == (status, code), answer.text
    assert message in error["message"], error
    if isinstance(failure, InvalidRequest):
        assert error["param"] == "language"


@pytest.mark.parametrize(
    "chord",
    [
        "not a place",
        {"group": "g", "index": "0", "body": {"task": "ttsq.stitch"}},
        {"group": "g", "index": 0, "body": {"task": "celery.backend_cleanup"}},
    ],
)
def test_a_released_job_whose_record_names_a_chord_body_no_fan_out_wrote_is_not_sent(
    settings: Settings, owner: RedisOwner, chord: Any
) -> None:
    # A chunk's place in its document's chord is read back from its record and sent on by whoever
    # releases or re-sends the chunk: only a stitch as the chord's body. Any other record is not one
    # ttsq wrote: the release takes it out of its tenant's place and sends nothing.
    accepted = owner.accepted
    ahead = [str(uuid.uuid4()) for _ in range(2)]
    for task_id in ahead:
        accepted.accept(task_id, task=TASK_NAME, queue=settings.queue, kwargs={"text": "x"}, headers={})
    task_id = str(uuid.uuid4())
    accepted.accept(task_id, task=TASK_NAME, queue=settings.queue, kwargs={"text": "x"}, headers={CHORD_HEADER: chord})
    assert accepted.defer(task_id, queue=settings.queue, tenant="t/chunks", window=1)
    assert accepted.get(task_id) is None
    assert accepted.release([settings.queue], window=10, most=10) == []
    assert not accepted.deferred(settings.queue)
    assert queue_length(settings) == 0


# -- one place for each: the source says so ---------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent / "ttsq"
#: Who may do what, by the file that does it: accept-and-send (``send_task``, ``apply_async``), and
#: decode a stored result (Celery's ``exc_type`` fields, its decoding helpers, ``AsyncResult``).
ONLY = {
    "send": {"ttsq/sending.py"},
    "decode": {"ttsq/results.py"},
    # ``Client.async_result``: Celery's own handle, public for callers that want it; ttsq never reads through it.
    "AsyncResult": {"ttsq/client.py"},
}
_SENDS = {"send_task", "apply_async"}
_DECODES = {"get_task_meta", "exception_to_python", "decode_result", "meta_from_decoded"}


def offences(source: str, path: str) -> list[str]:
    """What ``path`` does that only the one place for it may do."""
    found: list[tuple[str, str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _SENDS:
            found.append(("send", node.func.attr, node.lineno))
        if isinstance(node, ast.Attribute) and node.attr in _DECODES:
            found.append(("decode", node.attr, node.lineno))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "exc_type" in node.value:
            found.append(("decode", "exc_type", node.lineno))
        named = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        if named == "AsyncResult":
            found.append(("AsyncResult", named, getattr(node, "lineno", 0)))
    return [f"{path}:{line}: {what}" for rule, what, line in found if path not in ONLY[rule]]


def test_send_job_and_the_reader_are_the_only_places_that_send_and_decode() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = str(path.relative_to(ROOT.parent))
        wrong += offences(path.read_text(encoding="utf-8"), relative)
    assert not wrong, "send through ttsq.sending and read results through ttsq.results:\n" + "\n".join(wrong)
    # The check itself can fail: the sweeper's old copy, and the gateway's hand-parsed failure.
    old = "self._app.send_task(job.task)\nstate = self._app.AsyncResult(job.task_id).state\n"
    assert len(offences(old, "ttsq/worker/sweeper.py")) == 2
    assert offences('kind = error.get("exc_type", "")', "ttsq/gateway/routes.py")
