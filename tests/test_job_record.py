"""A job's one record in the ledger says what the lifecycle says (``ttsq.delivery.lifecycle.RECORDED``):
the real scripts on a real Redis, walked along the moves the ledger makes, the record's ``state`` read
after each, and the outcomes that outlive the job's other fields for as long as the docs say."""

from __future__ import annotations

import uuid

import pytest

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import ACCEPTED_PREFIX
from ttsq.delivery.lifecycle import RECORDED, State
from ttsq.records.accepted import AcceptedJobs, Receipt

TASK = "ttsq.synthesize"


@pytest.fixture
def ledger(settings: Settings) -> AcceptedJobs:
    return Client(settings).accepted


def says(ledger: AcceptedJobs, task_id: str, state: State) -> None:
    found = ledger.state(task_id)
    assert (found in RECORDED[state]) if found is not None else not RECORDED[state], (state, found)


def accept(ledger: AcceptedJobs, queue: str, owner: str = "") -> tuple[str, int]:
    task_id = f"record-{uuid.uuid4().hex}"
    return task_id, ledger.accept(task_id, task=TASK, queue=queue, kwargs={}, headers={}, owner=owner)


def test_a_job_that_runs_and_succeeds(ledger: AcceptedJobs) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    task_id, seq = accept(ledger, queue)
    says(ledger, task_id, State.ACCEPTED)  # and, once sent, QUEUED and HELD: the record cannot tell
    says(ledger, task_id, State.HELD)
    assert ledger.received(task_id, task=TASK, queue=queue, seq=seq, plain=True) is Receipt.RUN
    says(ledger, task_id, State.RUNNING)
    assert ledger.received(task_id, task=TASK, queue=queue, seq=seq, plain=True) is Receipt.DUPLICATE
    # Stale (no progress for a visibility timeout): the sweeper sends it again from its record.
    ledger.accept(task_id, task=TASK, queue=queue, kwargs={}, headers={})
    says(ledger, task_id, State.QUEUED)
    assert ledger.received(task_id, task=TASK, queue=queue, seq=None, plain=False) is Receipt.RUN
    assert ledger.settle(task_id, "SUCCESS", ttl_s=60)
    says(ledger, task_id, State.DONE)
    ledger.finish(task_id)
    # The outcome outlives the record's other fields: a cancel that read the job unfinished still answers it,
    # and a plain copy that comes now (the sweeper's, beside the first) is a second copy; a redelivery runs.
    says(ledger, task_id, State.DONE)
    assert not ledger.exists(task_id)
    assert ledger.received(task_id, task=TASK, queue=queue, seq=None, plain=True) is Receipt.DUPLICATE
    assert ledger.received(task_id, task=TASK, queue=queue, seq=None, plain=False) is Receipt.RUN
    assert ledger.cancel(task_id, ttl_s=60) == "SUCCESS"
    assert 0 < ledger._redis.ttl(ACCEPTED_PREFIX + task_id) <= ledger.outcome_s


def test_a_job_deferred_released_and_cancelled_while_it_runs(ledger: AcceptedJobs) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    first, _ = accept(ledger, queue)
    assert not ledger.defer(first, queue=queue, tenant="t", window=1)
    task_id, _ = accept(ledger, queue, owner="t")
    assert ledger.defer(task_id, queue=queue, tenant="t", window=1)  # the queue's window is full
    says(ledger, task_id, State.DEFERRED)
    ledger.finish(first)
    (released,) = ledger.release([queue], window=1, most=1)
    assert released.task_id == task_id
    says(ledger, task_id, State.QUEUED)
    assert ledger.received(task_id, task=TASK, queue=queue, seq=released.seq, plain=True) is Receipt.RUN
    assert ledger.cancel(task_id, ttl_s=600) is None
    says(ledger, task_id, State.CANCELLED)
    assert not ledger.settle(task_id, "SUCCESS", ttl_s=60)  # its worker's outcome does not stand
    says(ledger, task_id, State.CANCELLED)
    ledger.finish(task_id)  # what the canceller does next: the cancel and the owner stay, for the results
    says(ledger, task_id, State.CANCELLED)
    assert ledger.owner(task_id) == ("t", "")
    assert ledger.received(task_id, task=TASK, queue=queue, seq=None, plain=False) is Receipt.CANCELLED
    assert ledger._redis.ttl(ACCEPTED_PREFIX + task_id) > ledger.outcome_s


def test_a_job_cancelled_while_deferred_is_released_only_to_be_dropped(ledger: AcceptedJobs) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    first, _ = accept(ledger, queue)
    assert not ledger.defer(first, queue=queue, tenant="t", window=1)
    task_id, _ = accept(ledger, queue)
    assert ledger.defer(task_id, queue=queue, tenant="t", window=1)
    # The canceller dies before it finishes the record: the record alone says the job is cancelled, and
    # its release sends it to a worker that drops it (and stores REVOKED: tests/test_cancel.py).
    assert ledger.cancel(task_id, ttl_s=60) is None
    ledger.finish(first)
    (released,) = ledger.release([queue], window=1, most=10)
    says(ledger, task_id, State.CANCELLED)
    assert ledger.received(task_id, task=TASK, queue=queue, seq=released.seq, plain=True) is Receipt.CANCELLED
    # Finished by its canceller instead: nothing is released.
    accept(ledger, queue)  # ahead of it, not yet received: the window is full
    other, _ = accept(ledger, queue)
    assert ledger.defer(other, queue=queue, tenant="t", window=1)
    assert ledger.cancel(other, ttl_s=60) is None
    ledger.finish(other)
    assert ledger.release([queue], window=10, most=10) == []


def test_a_failed_job_and_its_retry(ledger: AcceptedJobs) -> None:
    queue = f"q-{uuid.uuid4().hex}"
    task_id, seq = accept(ledger, queue)
    assert ledger.received(task_id, task=TASK, queue=queue, seq=seq, plain=True) is Receipt.RUN
    assert ledger.settle(task_id, "FAILURE", ttl_s=60)
    says(ledger, task_id, State.FAILED)  # or PARKED: the ledger of attempts tells them apart
    says(ledger, task_id, State.PARKED)
    ledger.finish(task_id)
    assert ledger.cancel(task_id, ttl_s=60) == "FAILURE"
    # ``ttsq retry``: its FAILURE no longer answers, and it is a job accepted anew.
    ledger.unsettle(task_id)
    ledger.accept(task_id, task=TASK, queue=queue, kwargs={}, headers={})
    says(ledger, task_id, State.ACCEPTED)


def test_a_job_with_no_record_gets_one_for_its_outcome_only(ledger: AcceptedJobs) -> None:
    # A raw send_task from a web backend: nothing accepted it, its worker still settles against a cancel.
    settled, cancelled = f"raw-{uuid.uuid4().hex}", f"raw-{uuid.uuid4().hex}"
    assert ledger.settle(settled, "SUCCESS", ttl_s=60)
    assert ledger.cancel(cancelled, ttl_s=120) is None
    assert ledger.state(settled) == "done" and ledger.cancelled(cancelled)
    assert 0 < ledger._redis.ttl(ACCEPTED_PREFIX + settled) <= 60
    assert 60 < ledger._redis.ttl(ACCEPTED_PREFIX + cancelled) <= 120
    assert ledger.owner(settled) is None and not ledger.exists(cancelled)


def test_a_job_never_sent_leaves_nothing(ledger: AcceptedJobs) -> None:
    task_id, _ = accept(ledger, f"q-{uuid.uuid4().hex}", owner="t")
    ledger.forget(task_id)
    says(ledger, task_id, State.WITHDRAWN)
    assert not ledger._redis.exists(ACCEPTED_PREFIX + task_id)
