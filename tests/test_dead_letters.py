"""Dead letters and what kombu reads from a raw message, against real Redis and real workers.

An envelope whose ``properties.delivery_info`` kombu cannot file in its ``unacked`` record must be
refused like any other hostile envelope, not drop the broker connection under the jobs a worker
holds; a letter is bounded whatever the message carried; an untrusted id reaches no log line and no
terminal with its control characters; ``ttsq dead --purge`` removes what it listed and nothing that
arrived after.
"""

from __future__ import annotations

import json
import threading
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from support import WorkerProcess, run_cli, wait_until
from test_envelope import dead_letters, encoded, envelope, push, unacked

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import DEAD_LETTERS_KEY
from ttsq.records.deadletters import MAX_DEAD_LETTER_RECORD_BYTES, MAX_FIELD_CHARS, DeadLetters

#: Real workers and a slow engine: minutes on two cores.
pytestmark = pytest.mark.slow

StartWorker = Callable[..., WorkerProcess]


def _without_delivery_info(message: dict[str, Any]) -> None:
    del message["properties"]["delivery_info"]


def _empty_delivery_info(message: dict[str, Any]) -> None:
    message["properties"]["delivery_info"] = {}


def _no_exchange(message: dict[str, Any]) -> None:
    del message["properties"]["delivery_info"]["exchange"]


def _no_routing_key(message: dict[str, Any]) -> None:
    del message["properties"]["delivery_info"]["routing_key"]


INCOMPLETE_DELIVERY_INFO = [_without_delivery_info, _empty_delivery_info, _no_exchange, _no_routing_key]


def test_incomplete_delivery_info_is_dead_lettered_while_jobs_are_in_the_engine(
    settings: Settings, start_worker: StartWorker, faulty_engine: str, tmp_path: Path
) -> None:
    """kombu files every message it delivers under ``delivery_info``'s exchange and routing key: one
    without them once dropped the worker's broker connection, and every job it held stayed unacked."""
    settings = settings.replace(engine=faulty_engine)
    worker = start_worker(settings)
    client = Client(settings)
    jobs = [client.submit(f"[slow] Job {n} held while broken envelopes arrive.") for n in range(8)]
    wait_until(lambda: unacked(settings) >= 8, 30, "8 jobs held by the worker")
    ids = []
    for n, breaks in enumerate(INCOMPLETE_DELIVERY_INFO):
        message = envelope(settings.queue, marker=f"delivery info {n}")
        breaks(message)
        ids.append(message["headers"]["id"])
        push(settings, encoded(message))
    for job in jobs:
        assert job.wait(timeout=120)["duration_s"] > 0
    store = dead_letters(settings)
    wait_until(lambda: len(store.letters()) >= len(ids), 30, "every broken envelope in the dead-letter list")
    letters = store.letters()
    assert sorted(letter.task_id or "" for letter in letters) == sorted(ids)
    assert {letter.reason for letter in letters} == {"envelope"}
    wait_until(lambda: unacked(settings) == 0, 10, "no stale unacked entry")
    assert redis.Redis.from_url(settings.broker_url).llen(settings.queue) == 0
    log = worker.log()
    assert "Connection to broker lost" not in log and "KeyError" not in log and "Unrecoverable" not in log
    assert worker.process is not None and worker.process.poll() is None
    client.close()


def test_letters_from_an_8_mib_id_and_task_name_stay_within_the_stated_size(
    settings: Settings, start_worker: StartWorker
) -> None:
    huge = "x" * (8 * 2**20)
    start_worker(settings)
    push(settings, encoded(envelope(settings.queue, task_id=huge, marker="huge id")))
    push(settings, encoded(envelope(settings.queue, marker="huge task", headers={"task": huge})))
    wait_until(lambda: len(dead_letters(settings).letters()) == 2, 60, "both letters")
    broker = redis.Redis.from_url(settings.broker_url)
    records = broker.lrange(DEAD_LETTERS_KEY, 0, -1)
    assert all(len(record) <= MAX_DEAD_LETTER_RECORD_BYTES for record in records), [len(r) for r in records]
    for letter in dead_letters(settings).letters():
        assert len(letter.task_id or "") <= MAX_FIELD_CHARS and len(letter.task or "") <= MAX_FIELD_CHARS
        assert len(letter.detail) <= MAX_FIELD_CHARS and len(letter.queue) <= MAX_FIELD_CHARS
        assert letter.size > 8 * 2**20  # the size of what was refused, still said


def test_every_field_of_a_letter_is_bounded(settings: Settings) -> None:
    store = DeadLetters(redis.Redis.from_url(settings.broker_url))
    huge = "\u00e9" * (4 * 2**20)  # two bytes each in UTF-8
    store.put(b"r" * (8 * 2**20), queue=huge, reason="envelope", detail=huge, task_id=huge, task=huge)
    (record,) = redis.Redis.from_url(settings.broker_url).lrange(DEAD_LETTERS_KEY, 0, -1)
    assert len(record) <= MAX_DEAD_LETTER_RECORD_BYTES
    (letter,) = store.letters()
    assert letter.size == 8 * 2**20


def _control_characters(text: str) -> list[str]:
    return sorted({c for c in text if c != "\n" and unicodedata.category(c) == "Cc"})


FORGED = "job-1\n[2026-01-01 00:00:00,000: CRITICAL/MainProcess] Unrecoverable error\x1b[2J\x1b]0;owned\x07\x9b"


def test_a_hostile_id_reaches_no_log_line_and_no_terminal_with_its_control_characters(
    settings: Settings, start_worker: StartWorker
) -> None:
    worker = start_worker(settings)
    push(settings, encoded(envelope(settings.queue, task_id=FORGED, marker="forged")))
    push(settings, encoded(envelope(settings.queue, marker="forged task", headers={"task": FORGED})))
    wait_until(lambda: len(dead_letters(settings).letters()) == 2, 60, "both letters")
    log = worker.log()
    assert _control_characters(log) == []
    assert not any(line.startswith("[2026-01-01 00:00:00,000: CRITICAL") for line in log.splitlines())
    listed = run_cli("dead", settings=settings)
    assert listed.returncode == 0, listed.stderr
    text = listed.stdout.decode()
    assert _control_characters(text) == []
    assert len(text.splitlines()) == 2  # one line a letter, nothing forged
    as_json = run_cli("dead", "--json", settings=settings)
    assert _control_characters(as_json.stdout.decode()) == []
    # The id as kept stays whole enough to recognise: the escapes show what was there.
    assert any(letter["id"].startswith("job-1") for letter in json.loads(as_json.stdout))


def test_purge_removes_only_what_it_listed_while_letters_keep_arriving(settings: Settings) -> None:
    store = DeadLetters(redis.Redis.from_url(settings.broker_url))
    for n in range(5):
        store.put(b"old", queue="q", reason="body", detail="test", task_id=f"old-{n}")
    listed = store.letters()
    store.put(b"new", queue="q", reason="body", detail="test", task_id="arrived-after-listing")
    assert store.purge(listed) == 5
    assert [letter.task_id for letter in store.letters()] == ["arrived-after-listing"]

    # The command line, with a producer of letters running all along.
    stop = threading.Event()
    sent: list[str] = []

    def produce() -> None:
        producer = DeadLetters(redis.Redis.from_url(settings.broker_url))
        while not stop.is_set() and len(sent) < 900:  # under the list's cap: none is trimmed away
            letter_id = f"letter-{len(sent):06d}"
            producer.put(b"raw", queue="q", reason="body", detail="test", task_id=letter_id)
            sent.append(letter_id)
            stop.wait(0.004)

    thread = threading.Thread(target=produce)
    thread.start()
    try:
        wait_until(lambda: len(sent) >= 50, 10, "letters arriving")
        purged = run_cli("dead", "--purge", settings=settings)
    finally:
        stop.set()
        thread.join()
    assert purged.returncode == 0, purged.stderr
    lines = purged.stdout.decode().splitlines()
    shown = {line.split()[3] for line in lines[:-1]}
    assert lines[-1] == f"purged {len(shown)}"
    left = {letter.task_id for letter in store.letters()}
    assert not shown & left
    assert shown | left == {"arrived-after-listing", *sent}
