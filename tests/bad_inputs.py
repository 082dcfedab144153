"""The corpus of hostile and broken requests in ``tests/data/bad_requests.json``, expanded.

Three kinds of case live in the one file:

- ``"field"``: a request the edge refuses with ``InvalidRequest`` naming that field (producer, CLI,
  and the worker's own re-validation for a raw ``send_task``);
- ``"outcome": "result" | "EngineError"``: a request that is valid at the edge and that the worker
  answers with audio or with a clear engine error (markup, emoji, punctuation only, ...);
- ``"raw"``: a message no ttsq producer would send, put on the broker by hand (positional args,
  malformed bodies, an unregistered task name, invalid UTF-8, pickle); ``outcome`` says what the
  worker does with it: ``InvalidRequest:<field>``, ``failure`` (a failed result), or ``dropped``
  (refused before it becomes a task: no result, not redelivered).
"""

from __future__ import annotations

import json
import pickle
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from celery import Celery

CORPUS_PATH = Path(__file__).parent / "data" / "bad_requests.json"


def _expand(request: dict[str, Any]) -> dict[str, Any]:
    request = dict(request)
    if "_repeat" in request:
        request["text"] = request["text"] * request.pop("_repeat")
    if "_repeat_instruct" in request:
        request["instruct"] = request["instruct"] * request.pop("_repeat_instruct")
    return request


def cases() -> list[dict[str, Any]]:
    """Every case, with repeated texts expanded."""
    loaded = json.loads(CORPUS_PATH.read_text(encoding="utf-8"))
    return [{**case, "request": _expand(case["request"])} if "request" in case else case for case in loaded]


def load() -> list[Any]:
    return [
        pytest.param(
            case["request"], case["field"], id=case["name"], marks=[] if case.get("cli", True) else [pytest.mark.no_cli]
        )
        for case in cases()
        if "field" in case
    ]


#: Requests the edge refuses, with the field it names.
BAD_REQUESTS = load()
#: The cases a shell can express with ttsq's flags (no JSON types, no fields without a flag).
BAD_CLI_REQUESTS = [case for case in BAD_REQUESTS if not any(m.name == "no_cli" for m in case.marks)]
#: Every case, for the worker: each is sent straight to the broker.
ALL_CASES = cases()


def send_raw(app: Celery, queue: str, case: dict[str, Any]) -> str:
    """Put one case on the broker the way a careless or hostile producer would; return its task id."""
    task_id = str(uuid.uuid4())
    if "request" in case:  # a web backend's send_task, which skips ttsq's producer checks
        app.send_task(
            "ttsq.synthesize", kwargs=case["request"], task_id=task_id, queue=queue, kwargsrepr="<bad input corpus>"
        )
        return task_id
    raw = case["raw"]
    if "args" in raw:
        app.send_task("ttsq.synthesize", args=raw["args"], kwargs=raw["kwargs"], task_id=task_id, queue=queue)
        return task_id
    headers = {
        "lang": "py",
        "task": raw.get("task", "ttsq.synthesize"),
        "id": task_id,
        "root_id": task_id,
        "parent_id": None,
        "group": None,
        "retries": 0,
        "timelimit": [None, None],
        "eta": None,
        "expires": None,
        "argsrepr": "()",
        "kwargsrepr": "{}",
        "origin": "bad-input-corpus",
    }
    if "pickle" in raw:
        body, content_type, encoding = pickle.dumps(((), raw["pickle"], {})), "application/x-python-serialize", "binary"
    elif "latin1" in raw:
        body, content_type, encoding = raw["latin1"].encode("latin-1"), "application/json", "utf-8"
    else:
        body, content_type, encoding = json.dumps(raw["body"]).encode(), "application/json", "utf-8"
    from kombu import Exchange, Queue

    with app.producer_or_acquire() as producer:
        # Declared like Celery declares it: a message published to an exchange with no binding yet
        # (the worker may still be connecting) would be dropped by the broker, not refused by ttsq.
        producer.publish(
            body,
            exchange=queue,
            routing_key=queue,
            headers=headers,
            content_type=content_type,
            content_encoding=encoding,
            correlation_id=task_id,
            serializer=None,
            declare=[Queue(queue, Exchange(queue, type="direct"), routing_key=queue)],
        )
    return task_id
