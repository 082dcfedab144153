"""The broker message is untrusted input: the envelope gate, against real Redis and real workers.

Raw messages are pushed onto a queue's Redis list exactly as kombu's Redis transport stores them (or
broken in one place), the way a buggy producer or client library, or anyone who can reach Redis,
would. What must hold: no worker ends, no bad message runs or comes back, none is left unacked, each
is kept once in the dead-letter list, and the jobs around them are served.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
import redis
from hypothesis import HealthCheck, given, seed
from hypothesis import settings as hypothesis_settings
from support import Launcher, WorkerProcess, run_cli, wait_until

from ttsq.app import make_app
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import RESTARTS_KEY
from ttsq.delivery.envelope import MAX_MESSAGE_BYTES, Refused, check_raw, check_task
from ttsq.records.deadletters import DeadLetters
from ttsq.records.owner import RedisOwner

StartWorker = Callable[..., WorkerProcess]
TASKS = ("ttsq.synthesize", "ttsq.document", "ttsq.stitch")


def envelope(
    queue: str,
    *,
    task_id: str | None = None,
    text: str = "An envelope test.",
    marker: str = "",
    headers: dict[str, Any] | None = None,
    body: Any = None,
) -> dict[str, Any]:
    """A message as kombu's Redis transport keeps it, for ``ttsq.synthesize``: valid unless changed."""
    task_id = task_id or str(uuid.uuid4())
    payload = [[], {"text": text}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    raw_body = json.dumps(payload if body is None else body).encode()
    return {
        "body": base64.b64encode(raw_body).decode(),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {
            "lang": "py",
            "task": "ttsq.synthesize",
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": "()",
            "kwargsrepr": "<envelope test>",
            "origin": "test",
            "ignore_result": None,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
            "x_marker": marker,
            **(headers or {}),
        },
        "properties": {
            "correlation_id": task_id,
            "reply_to": "",
            "delivery_mode": 2,
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
            "x_marker": marker,
        },
    }


def push(settings: Settings, raw: bytes | str, queue: str | None = None) -> None:
    """Put one list item on the queue the way kombu's producer would (LPUSH; workers pop the other end)."""
    client = redis.Redis.from_url(settings.broker_url)
    try:
        client.lpush(queue or settings.queue, raw)
    finally:
        client.close()


def dead_letters(settings: Settings) -> DeadLetters:
    return DeadLetters(redis.Redis.from_url(settings.broker_url))


def unacked(settings: Settings) -> int:
    client = redis.Redis.from_url(settings.broker_url)
    try:
        return int(client.hlen("unacked"))
    finally:
        client.close()


def encoded(message: dict[str, Any]) -> bytes:
    return json.dumps(message).encode()


# -- the checks alone -----------------------------------------------------------------------------------


def test_what_kombu_and_celery_write_passes_both_checks(settings: Settings) -> None:
    """A message a ttsq producer sends (read back from the real queue) is taken in as it is."""
    app = make_app(settings)
    app.send_task("ttsq.synthesize", kwargs={"text": "Real."}, queue=settings.queue, headers={"ttsq_seq": 3})
    raw = redis.Redis.from_url(settings.broker_url).lrange(settings.queue, 0, -1)[0]
    payload = check_raw(raw)
    body = base64.b64decode(payload["body"])
    found = check_task(
        payload["headers"],
        body,
        content_type=payload["content-type"],
        content_encoding=payload["content-encoding"],
        tasks=TASKS,
    )
    assert found.task == "ttsq.synthesize" and found.args_kwargs == ([], {"text": "Real."})
    app.close()


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    _containers,
    max_leaves=12,
)


@given(st.one_of(st.binary(max_size=200), JSON.map(lambda value: json.dumps(value).encode())))
@hypothesis_settings(max_examples=300, deadline=None)
def test_any_list_item_is_taken_in_or_refused_never_a_crash(item: bytes) -> None:
    try:
        payload = check_raw(item)
    except Refused as refused:
        assert refused.reason in ("envelope", "encoding", "headers", "body")
        return
    assert isinstance(payload["headers"], dict) and isinstance(payload["properties"], dict)


@given(
    headers=st.dictionaries(
        st.sampled_from(
            [
                "id",
                "task",
                "timelimit",
                "eta",
                "expires",
                "retries",
                "argsrepr",
                "kwargsrepr",
                "root_id",
                "parent_id",
                "group",
                "stamps",
                "ignore_result",
                "ttsq_seq",
                "ttsq_sent_at",
            ]
        ),
        JSON,
    ),
    body=st.one_of(st.binary(max_size=60), JSON.map(lambda value: json.dumps(value).encode())),
)
@hypothesis_settings(max_examples=500, deadline=None)
@pytest.mark.slow
def test_any_headers_and_body_are_taken_in_or_refused_never_a_crash(headers: dict[str, Any], body: bytes) -> None:
    try:
        check_task(headers, body, content_type="application/json", content_encoding="utf-8", tasks=TASKS)
    except Refused as refused:
        assert refused.reason in ("protocol", "headers", "body", "unknown task")


def test_a_protocol_1_message_is_refused_as_one() -> None:
    # Celery 3, or task_protocol=1: the task and its id in the body, nothing in the headers.
    body = json.dumps({"task": "ttsq.synthesize", "id": "p1", "args": [], "kwargs": {"text": "hello"}}).encode()
    with pytest.raises(Refused) as info:
        check_task({}, body, content_type="application/json", content_encoding="utf-8", tasks=TASKS)
    assert info.value.reason == "protocol" and "protocol 2" in info.value.detail
    # Protocol 2 headers without an id are a headers fault, whatever the body holds.
    with pytest.raises(Refused) as info:
        check_task(
            {"task": "ttsq.synthesize"}, body, content_type="application/json", content_encoding="utf-8", tasks=TASKS
        )
    assert info.value.reason == "headers"


# -- against real workers -------------------------------------------------------------------------------


def test_a_timelimit_that_is_a_string_or_three_long_stops_no_worker(
    settings: Settings, start_worker: StartWorker
) -> None:
    """Celery's request unpacks ``timelimit`` outside any handler: once, one such message ended every
    worker it reached in turn."""
    worker = start_worker(settings)
    push(settings, encoded(envelope(settings.queue, marker="string", headers={"timelimit": "x"})))
    push(settings, encoded(envelope(settings.queue, marker="three", headers={"timelimit": [1, 2, 3]})))
    with Client(settings) as client:
        results = [client.submit(f"Served after a bad time limit, {i}.").wait(timeout=60) for i in range(5)]
    assert all(result["duration_s"] > 0 for result in results)
    assert worker.process is not None and worker.process.poll() is None
    letters = dead_letters(settings).letters()
    assert sorted(letter.detail for letter in letters) == ["timelimit is not [hard, soft] seconds"] * 2
    wait_until(lambda: unacked(settings) == 0, 10, "every message acknowledged")  # late acks: after results
    assert "Unrecoverable" not in worker.log()


def test_a_message_without_an_id_is_dead_lettered_once_and_never_comes_back(
    settings: Settings, start_worker: StartWorker
) -> None:
    settings = settings.replace(visibility_timeout_s=210)
    worker = start_worker(settings)
    message = envelope(settings.queue, marker="no id")
    del message["headers"]["id"]
    push(settings, encoded(message))
    with Client(settings) as client:
        assert client.submit("Served beside a message without an id.").wait(timeout=60)["duration_s"] > 0
    wait_until(lambda: len(dead_letters(settings).letters()) == 1, 10, "the message in the dead-letter list")
    (letter,) = dead_letters(settings).letters()
    assert (letter.reason, letter.task_id, letter.queue) == ("headers", None, settings.queue)
    # Acked: nothing for Redis to hand out again after the visibility timeout, and the connection held.
    wait_until(lambda: unacked(settings) == 0, 10, "every message acknowledged")
    assert redis.Redis.from_url(settings.broker_url).llen(settings.queue) == 0
    assert "KeyError" not in worker.log() and "Unrecoverable" not in worker.log()
    assert worker.process is not None and worker.process.poll() is None


def test_a_job_ttsq_accepted_whose_message_a_worker_refuses_is_sent_again_from_its_record(
    settings: Settings, start_worker: StartWorker
) -> None:
    """A message altered on the way (or written by a producer of another version): the refused copy is
    dead-lettered, and the job, which ttsq accepted, is found nowhere and sent again by the sweeper from
    its record, as ttsq's producer writes it: it runs once (docs/guarantees.md, "A job's lifecycle")."""
    settings = settings.replace(lost_job_grace_s=1)
    start_worker(settings)
    message = envelope(settings.queue, marker="accepted, then refused", body={"text": "x"})
    task_id = message["headers"]["id"]
    owner = RedisOwner(settings, role="test")
    owner.accepted.accept(
        task_id,
        task="ttsq.synthesize",
        queue=settings.queue,
        kwargs={"text": "Sent again from its record."},
        headers={},
    )
    push(settings, encoded(message))
    with Client(settings) as client:
        assert client.wait(task_id, timeout=60)["duration_s"] > 0
    assert not owner.accepted.exists(task_id)
    (letter,) = dead_letters(settings).letters()
    assert (letter.task_id, letter.reason) == (task_id, "body")
    owner.close()


#: Bodies Celery 5.7 cannot take apart as a task's ``[args, kwargs, embed]``: a JSON object or a number
#: once ended the worker, kwargs that were not an object left the task without a result, and kwargs
#: written in kombu's typed JSON (``__type__``/``__value__``) reach the task as a ``Decimal`` or a
#: ``datetime``, or fail kombu's decoder inside Celery's consumer.
CELERY_BODIES: list[Any] = [
    {"text": "x"},
    5,
    "null",
    [[], {}],
    [[], "x", None],
    [[], [], None],
    [[], {"__type__": "decimal", "__value__": "1"}, None],
    [[], {"__type__": "datetime", "__value__": "2026-01-01T00:00:00"}, None],
    [[], {"text": {"__type__": "datetime", "__value__": "not a time"}}, None],
    [[], {"text": "x"}, {"__type__": "decimal", "__value__": "1"}],
]


def test_every_body_celery_cannot_take_is_dead_lettered_and_stops_no_worker(
    settings: Settings, start_worker: StartWorker
) -> None:
    """The gate alone stands between these bodies and Celery's strategy: no task class checks them again."""
    worker = start_worker(settings)
    ids = []
    for n, body in enumerate(CELERY_BODIES):
        message = envelope(settings.queue, marker=f"body {n}", body=body)
        ids.append(message["headers"]["id"])
        push(settings, encoded(message))
    with Client(settings) as client:
        assert client.submit("Served after bodies Celery cannot take.").wait(timeout=60)["duration_s"] > 0
    store = dead_letters(settings)
    wait_until(lambda: len(store.letters()) >= len(ids), 30, "every bad body in the dead-letter list")
    letters = store.letters()
    assert sorted(letter.task_id or "" for letter in letters) == sorted(ids)
    assert {letter.reason for letter in letters} == {"body"}
    wait_until(lambda: unacked(settings) == 0, 10, "every message acknowledged")
    assert redis.Redis.from_url(settings.broker_url).llen(settings.queue) == 0
    log = worker.log()
    # Not dropped by Celery either (its consumer logs these and acks, keeping nothing).
    assert "Unrecoverable" not in log and "InvalidTaskError" not in log and "DecodeError" not in log
    assert worker.process is not None and worker.process.poll() is None
    app = make_app(settings)
    assert all(app.AsyncResult(task_id).state == "PENDING" for task_id in ids)  # none ran, none failed
    app.close()


def test_ttsq_dead_lists_without_text_and_purges(settings: Settings, start_worker: StartWorker) -> None:
    secret = "The Osprey contract is signed on Friday"
    start_worker(settings)
    push(settings, encoded(envelope(settings.queue, text=secret, marker="m", headers={"retries": "many"})))
    wait_until(lambda: len(dead_letters(settings).letters()) == 1, 30, "the dead letter")
    listed = run_cli("dead", "--json", settings=settings)
    assert listed.returncode == 0, listed.stderr
    (letter,) = json.loads(listed.stdout)
    assert letter["reason"] == "headers" and letter["detail"] == "retries is not an integer 0..1000000"
    assert secret not in listed.stdout.decode() and secret not in run_cli("dead", settings=settings).stdout.decode()
    # The raw message is kept whole for an operator.
    assert secret.encode() in base64.b64decode(json.loads(dead_letters(settings).raw()[0])["body"])
    purged = run_cli("dead", "--purge", settings=settings)
    assert purged.returncode == 0 and b"purged 1" in purged.stdout
    assert dead_letters(settings).letters() == []


# -- the fuzz test: a burst with hostile messages mixed in, on a two-worker launcher -----------------------

#: One way to break a valid envelope each: (name, change). Every one of them must be refused.
HEADER_BREAKS: list[tuple[str, Any]] = [
    ("id", None),
    ("id", 7),
    ("id", ["a"]),
    ("id", ""),
    ("id", "x" * 300),
    ("id", "new\nline"),
    ("task", None),
    ("task", 5),
    ("task", "ttsq.synthesise"),
    ("task", "celery.backend_cleanup"),
    ("timelimit", "x"),
    ("timelimit", [1, 2, 3]),
    ("timelimit", ["a", "b"]),
    ("timelimit", {"soft": 1}),
    ("timelimit", [-1, None]),
    ("eta", "tomorrow"),
    ("eta", 12345),
    ("eta", ["2026"]),
    ("expires", "soon"),
    ("expires", {}),
    ("retries", -1),
    ("retries", "x"),
    ("retries", True),
    ("retries", 1.5),
    ("argsrepr", 5),
    ("kwargsrepr", ["x"]),
    ("root_id", 5),
    ("parent_id", {}),
    ("group", 3),
    ("shadow", 9),
    ("origin", []),
    ("ignore_result", "yes"),
    ("stamped_headers", "x"),
    ("stamps", ["x"]),
    ("group_index", "1"),
    ("replaced_task_nesting", "0"),
    ("ttsq_sent_at", "now"),
    ("ttsq_seq", 1.5),
    ("ttsq_seq", "1"),
    ("ttsq_document", ["x"]),
    ("ttsq_claim", 5),
    ("lang", 1),
]
BODY_BREAKS: list[Any] = [
    {"text": "x"},
    5,
    "hello",
    None,
    [[], {}],
    [[], {}, {}, {}],
    ["x", {}, {}],
    [[], "x", {}],
    [[], [], {}],
    [[], {}, "embed"],
    [[], {}, {"callbacks": "x"}],
    [[], {}, {"chord": []}],
    [[], {}, {"surprise": None}],
    [[], {}, {"chain": [1]}],
]


@st.composite
def hostile(draw: st.DrawFn, queue: str, marker: str) -> bytes:
    """One message that must be refused, carrying ``marker`` wherever the breakage leaves room for it."""
    message = envelope(queue, marker=marker)
    kind = draw(st.sampled_from(["header", "missing", "body", "envelope", "encoding", "garbage", "json"]))
    if kind == "header":
        name, value = draw(st.sampled_from(HEADER_BREAKS))
        message["headers"][name] = value
    elif kind == "missing":
        del message["headers"][draw(st.sampled_from(["id", "task"]))]
    elif kind == "body":
        choice = draw(st.sampled_from(["shape", "not json", "not utf-8", "not base64", "not a string"]))
        if choice == "shape":
            message["body"] = base64.b64encode(json.dumps(draw(st.sampled_from(BODY_BREAKS))).encode()).decode()
        elif choice == "not json":
            message["body"] = base64.b64encode(b"{[ not json " + marker.encode()).decode()
        elif choice == "not utf-8":
            message["body"] = base64.b64encode(b'[[], {"text": "caf\xe9"}, {}]').decode()
        elif choice == "not base64":
            message["body"] = "!!" + draw(st.text(alphabet="!@#$%^&*", min_size=1, max_size=8))
        else:
            message["body"] = draw(st.sampled_from([5, None, ["x"], {"b": 1}]))
    elif kind == "envelope":
        target, value = draw(
            st.sampled_from(
                [
                    ("properties", "x"),
                    ("properties", None),
                    ("delivery_tag", 5),
                    ("delivery_tag", None),
                    ("delivery_info", "x"),
                    ("priority", "high"),
                    ("priority", 1000),
                    ("headers", "x"),
                    ("headers", ["a"]),
                    ("headers", None),
                ]
            )
        )
        if target in ("properties", "headers"):
            message[target] = value
        else:
            message["properties"][target] = value
    elif kind == "encoding":
        target, value = draw(
            st.sampled_from(
                [
                    ("content-type", "application/x-python-serialize"),
                    ("content-type", "text/plain"),
                    ("content-type", None),
                    ("content-encoding", "latin-1"),
                    ("content-encoding", 8),
                    ("body_encoding", "hex"),
                    ("body_encoding", None),
                ]
            )
        )
        if target == "body_encoding":
            message["properties"][target] = value
        else:
            message[target] = value
    elif kind == "garbage":  # not JSON at all, or cut short
        cut = draw(st.integers(min_value=1, max_value=40))
        return marker.encode() + draw(st.sampled_from([b" \x00\xff not json", encoded(message)[:cut]]))
    else:  # JSON, but not an object
        return json.dumps(draw(st.sampled_from([[marker], marker, [marker, 1], {"marker": marker}]))).encode()
    return encoded(message)


@seed(20261201)
@given(data=st.data())
@hypothesis_settings(
    max_examples=1,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_hostile_envelopes_mixed_into_a_burst_stop_nothing_and_lose_nothing(
    settings: Settings, launch: Callable[..., Launcher], tmp_path: Path, data: st.DataObject
) -> None:
    settings = settings.replace(visibility_timeout_s=210, lost_job_grace_s=3)
    launcher = launch(settings, "cpu:2")
    pids = launcher.wait_ready(["cpu0@test", "cpu1@test"])
    markers = [f"fuzz-marker-{n:04d}" for n in range(220)]
    bad = [data.draw(hostile(settings.queue, marker)) for marker in markers]
    # Too large to take in at all (checked before it is parsed).
    bad.append(b'{"marker": "fuzz-marker-huge", "pad": "' + b"x" * (MAX_MESSAGE_BYTES + 1) + b'"}')
    markers.append("fuzz-marker-huge")
    # Valid raw messages a worker must serve: optional headers missing, headers of its own added.
    good_raw: list[str] = []
    for n in range(10):
        message = envelope(
            settings.queue, text=f"A raw but valid message, number {n}.", headers={"x_custom": {"n": n}, "x_list": [n]}
        )
        for optional in ("shadow", "eta", "expires", "group", "group_index", "root_id", "stamps")[: n % 7]:
            message["headers"].pop(optional)
        good_raw.append(message["headers"]["id"])
        bad.insert(n * 20, encoded(message))  # interleaved with the hostile ones
    client = Client(settings)
    jobs = []
    for n, item in enumerate(bad):
        push(settings, item)
        if n % 6 == 0:
            jobs.append(client.submit(f"Ordinary job {n} of the hostile burst."))
    for job in jobs:
        assert job.wait(timeout=120)["duration_s"] > 0
    app = make_app(settings)
    for task_id in good_raw:
        assert app.AsyncResult(task_id).get(timeout=120)["duration_s"] > 0
    store = dead_letters(settings)
    wait_until(lambda: len(store.letters()) >= len(markers), 60, "every hostile message in the dead-letter list")

    # No worker ended: the same two processes, never restarted.
    assert launcher.wait_ready(["cpu0@test", "cpu1@test"]) == pids
    assert not redis.Redis.from_url(settings.cache_url).hgetall(RESTARTS_KEY)
    log = launcher.log()
    assert "died" not in log and "Unrecoverable" not in log
    # Every hostile message kept exactly once; nothing left unacked or queued.
    raws = store.raw()
    assert len(raws) == len(store.letters()) == len(markers)
    for marker in markers:
        assert sum(marker.encode() in raw for raw in raws) == 1, marker
    wait_until(lambda: unacked(settings) == 0, 10, "every message acknowledged")
    assert redis.Redis.from_url(settings.broker_url).llen(settings.queue) == 0
    # Each good job ran exactly once.
    for task_id in [job.id for job in jobs] + good_raw:
        assert log.count(f"job {task_id}: synthesized") == 1, task_id
    assert "sent again" not in log and "second copy" not in log
    client.close()
    app.close()


@pytest.fixture
def launch(tmp_path: Path) -> Any:
    started: list[Launcher] = []

    def start(settings: Settings, devices: str) -> Launcher:
        launcher = Launcher(settings, devices, tmp_path / f"launcher{len(started)}.log")
        started.append(launcher)
        return launcher

    yield start
    for launcher in started:
        launcher.stop()


def test_the_dead_letter_list_is_bounded(settings: Settings) -> None:
    store = DeadLetters(redis.Redis.from_url(settings.broker_url), limit=5)
    for n in range(8):
        store.put(f"message {n}".encode(), queue="q", reason="body", detail="test")
    assert [raw.decode() for raw in store.raw()] == [f"message {n}" for n in (7, 6, 5, 4, 3)]
    assert time.time() - store.letters()[0].at < 60
