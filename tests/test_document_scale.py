"""Documents at scale (issue 26): small chunk messages, a fan-out sent once however often the document
task is delivered, a stitch plan read back as untrusted input, and a document waiting behind a backlog
that the sweeper leaves alone. Real Redis, moto S3, real ``ttsq worker`` processes, espeak."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from support import WorkerProcess, wait_until

from ttsq.app import make_app, queue_for
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import DOCUMENT_TASK_NAME
from ttsq.document import check_plan
from ttsq.errors import InvalidRequest
from ttsq.records.owner import RedisOwner
from ttsq.records.plans import SENT, chord_group_id, chunk_task_ids

StartWorker = Callable[..., WorkerProcess]


def good_plan() -> dict[str, Any]:
    return {
        "key": "a" * 64,
        "format": "wav",
        "seed": 7,
        "seed_given": False,
        "characters": 12,
        "queue": "ttsq",
        "options": {"target_chars": 200},
        "chunks": [{"key": "b" * 64, "start": 0, "end": 12, "boundary": "end", "sentences": [[0, 12, 0.5]]}],
    }


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda p: p.update(key="../../etc"), "plan.key"),
        (lambda p: p.update(format="exe"), "plan.format"),
        (lambda p: p.update(seed=-1), "plan.seed"),
        (lambda p: p.update(characters="12"), "plan.characters"),
        (lambda p: p.update(options={"crossfade_ms": 10**6}), "options.crossfade_ms"),
        (lambda p: p.update(chunks=[]), "plan.chunks"),
        (lambda p: p["chunks"][0].update(key="audio/x.wav"), "plan.chunks[0].key"),
        (lambda p: p["chunks"][0].update(start=13), "plan.chunks[0].start"),
        (lambda p: p["chunks"][0].update(boundary="chapter"), "plan.chunks[0].boundary"),
        (lambda p: p["chunks"][0].update(sentences=[["0", 1, 2]]), "plan.chunks[0].sentences"),
    ],
)
def test_a_stitch_plan_read_back_is_checked_field_by_field(
    change: Callable[[dict[str, Any]], None], field: str
) -> None:
    check_plan(good_plan())
    plan = good_plan()
    change(plan)
    with pytest.raises(InvalidRequest) as info:
        check_plan(plan)
    assert info.value.field == field


def test_chunk_task_ids_are_the_same_for_every_fan_out_of_a_document() -> None:
    first = chunk_task_ids("doc-1", 5)
    assert first == chunk_task_ids("doc-1", 5) and len(set(first)) == 5
    assert not set(first) & set(chunk_task_ids("doc-2", 5))


def test_a_document_delivered_twice_fans_out_once(settings: Settings, start_worker: StartWorker) -> None:
    # Two deliveries of one document task (a redelivery, or a sweeper's resend): the second sends nothing
    # and the chord's stitch still gives the document's id its result.
    worker = start_worker(settings)
    app = make_app(settings)
    text = " ".join(f"Twice delivered sentence number {n}." for n in range(6))
    kwargs = {"text": text, "options": {"target_chars": 1, "max_chars": 40}}
    first = app.send_task(DOCUMENT_TASK_NAME, kwargs=kwargs, queue=settings.queue, task_id="doc-twice")
    app.send_task(DOCUMENT_TASK_NAME, kwargs=kwargs, queue=settings.queue, task_id="doc-twice")
    result = first.get(timeout=120)
    assert len(result["chunks"]) == 6
    wait_until(lambda: "redelivered" in worker.log() or "cached" in worker.log(), 30, "the second delivery")
    log = worker.log()
    assert log.count("document doc-twice: 6 chunks") == 1, log[-3000:]
    assert len([line for line in log.splitlines() if "synthesized" in line and "in batch" in line]) == 6
    app.close()


@pytest.mark.slow
def test_a_document_behind_a_backlog_is_waiting_not_lost(
    settings: Settings, start_worker: StartWorker, faulty_engine: str
) -> None:
    # A visibility timeout and grace small enough that the backlog ahead of the document's chunks
    # (thirty one-second jobs, one at a time) outlasts them: the sweeper must see the chunks queued and
    # leave the document alone, and each chunk message must be small (no plan in it).
    small = settings.replace(
        engine=faulty_engine,
        max_batch=1,
        job_timeout_s=6,
        # Two tries of a second each: one try of one second failed a chunk's upload when the S3 server,
        # a thread of the test process, answered late on a loaded machine (the smallest timeout these
        # settings allow grows to 18 s; the backlog still outlasts it and the grace).
        storage_attempts=2,
        storage_timeout_s=1,
        visibility_timeout_s=18,
        lost_job_grace_s=2,
    )
    stale_s = small.visibility_timeout_s + small.lost_job_grace_s
    announcer = start_worker(small, name="w0")  # announces the model, so submits are keyed ...
    announcer.stop()  # ... then leaves: nothing consumes until the queue is laid out
    client = Client(small)
    text = " ".join(f"Backlog document sentence {n}." for n in range(3))
    document = client.submit_document(text, options={"target_chars": 1, "max_chars": 40})
    # In the document's lane (bulk), behind it: its chunks then queue behind the backlog.
    backlog = [client.submit(f"[slow] Backlog job number {n}.", lane="bulk") for n in range(30)]
    worker = start_worker(small, name="w1")  # takes the document first (FIFO), fans it out behind the backlog
    doc_id = document.id or ""
    broker = redis.Redis.from_url(small.broker_url)
    queue = queue_for(small.queue, "voice_design", "bulk")
    ids = [f'"id": "{task_id}"'.encode() for task_id in chunk_task_ids(doc_id, 3)]
    wait_until(
        lambda: any(needle in item for item in broker.lrange(queue, 0, -1) for needle in ids),
        30,
        "the document's chunks queued behind the backlog",
    )
    chunk_messages = [item for item in broker.lrange(queue, 0, -1) if any(n in item for n in ids)]
    assert chunk_messages and all(len(item) < 8_000 for item in chunk_messages), [len(m) for m in chunk_messages]
    assert all(b"sentences" not in item for item in chunk_messages)  # the plan is not in them
    started = time.monotonic()
    result = document.wait(timeout=180)
    assert time.monotonic() - started > stale_s  # it did wait longer than a stale period
    assert len(result["chunks"]) == 3  # type: ignore[typeddict-item]
    for job in backlog:
        job.wait(timeout=60)
    log = worker.log()
    assert f"document {doc_id}: waiting for its chunks" in log, log[-3000:]
    assert "sent again" not in log and log.count(f"document {doc_id}: 3 chunks") == 1, log[-3000:]
    broker.close()
    client.close()


def test_a_resumed_fan_out_sends_no_chunk_twice_and_its_chord_counts_jobs_not_chunks(
    settings: Settings, start_worker: StartWorker, faulty_engine: str
) -> None:
    # A fan-out resumed after its worker died sends only the chunks the first one never sent. A chunk a
    # worker is popping at that moment is in no list and not yet in kombu's unacked hash, and has no
    # result: a resume that went by the broker took it for never sent and sent it a second time. Here the
    # test is that worker: it holds one queued chunk's message while the resumed fan-out runs.
    # The first fan-out died before Celery set the chord's size (it sets it with the last chunk it
    # sends): the resume sets it, to the document's chunk jobs. A repeated sentence is one job and a
    # paragraph with nothing to speak none: set to the chunks, the chord waited for results never to come.
    slow = settings.replace(engine=faulty_engine, max_batch=1, doc_target_chars=1, lost_job_grace_s=120)
    worker = start_worker(slow)
    client = Client(slow)
    sentences = [f"[slow] Popped sentence number {n} of the resume test." for n in range(7)]
    text = " ".join(sentences) + "\n\n* * *\n\n" + sentences[0]  # 9 chunks, 7 jobs
    document = client.submit_document(text)
    doc_id = document.id or ""
    owner = RedisOwner(slow, role="test")
    broker = redis.Redis.from_url(slow.broker_url)
    queue = queue_for(slow.queue, "voice_design", "bulk")
    ids = [f'"id": "{task_id}"'.encode() for task_id in chunk_task_ids(doc_id, 7)]
    app = make_app(slow)
    try:
        wait_until(lambda: owner.plans.fan_out_state(doc_id) == SENT, 30, "the first fan-out")
        wait_until(lambda: broker.llen(queue) >= 3, 30, "chunks queued behind the slow ones")
        popped = broker.lpop(queue)  # the newest chunk: what a worker is taking right now
        assert popped is not None and any(needle in popped for needle in ids)
        # The document's message given back with its fan-out half way (as kombu restores a dead
        # worker's), from before its chord had a size.
        app.backend.client.delete(app.backend.get_key_for_group(chord_group_id(doc_id), ".s"))
        record = owner.accepted.get(doc_id)
        assert record is not None
        plans = owner.plans
        plans.forget_fan_out(doc_id)
        assert plans.begin_fan_out(doc_id, lease_s=300)
        app.send_task(DOCUMENT_TASK_NAME, kwargs=record.kwargs, queue="held-aside", task_id=doc_id)
        message = json.loads(broker.rpop("held-aside") or b"{}")
        message["headers"]["redelivered"] = True
        message["properties"]["delivery_info"].update(redelivered=True, routing_key=queue)
        broker.rpush(queue, json.dumps(message))  # taken next
        wait_until(lambda: f"document {doc_id}: redelivered half sent" in worker.log(), 60, "the resumed fan-out")
        broker.lpush(queue, popped)  # the popping worker goes on with its chunk
        result = document.wait(timeout=60)
    finally:
        app.close()
        broker.close()
        owner.close()
        client.close()
    assert len(result["chunks"]) == 9  # type: ignore[typeddict-item]
    log = worker.log()
    assert f"document {doc_id}: redelivered half sent; 0 of 7 chunks sent again" in log, log[-3000:]
