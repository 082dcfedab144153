"""The broker message is untrusted input too: what a ttsq worker accepts around a task's kwargs.

Celery parses a message's envelope (headers such as ``timelimit``, ``eta``, ``id``; the body's
``[args, kwargs, embed]`` shape) in its own consumer, strategy and request code, before any task
runs; an exception there is "Unrecoverable" and ends the worker, and the message goes back to the
queue for the next worker. So every message is checked here first, in two steps:

1. ``check_raw``: the Redis list item as kombu's Redis transport stores it (a JSON object with
   ``body``, ``content-type``, ``content-encoding``, ``headers``, ``properties``), before kombu builds
   a message from it;
2. ``check_task``: the decoded headers and body, before Celery's strategy builds a request from them.

A message that fails either is not run: the worker moves it, raw, to the bounded dead-letter list
(``ttsq.records.deadletters``, ``ttsq dead``), acknowledges it and keeps consuming. The reasons are a fixed
vocabulary (they label a metric); the detail that goes with one never quotes the message's text.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kombu.utils import json as kombu_json

from ttsq.constants import CLAIM_HEADER, DOCUMENT_HEADER, SENT_AT_HEADER, SEQ_HEADER

if TYPE_CHECKING:
    pass

#: The reasons a message is refused (the ``reason`` label of ``ttsq_dead_letters_total``).
REASONS = ("envelope", "encoding", "protocol", "headers", "body", "unknown task", "celery")
#: Largest raw message a worker takes: a 200,000-character document is under 1 MB of JSON.
MAX_MESSAGE_BYTES = 16 * 2**20
_MAX_ID_CHARS = 255
_MAX_RETRIES = 1_000_000
# Headers whose type Celery's strategy and request rely on: name -> the JSON types allowed (None: null).
_OPTIONAL_STRINGS = (
    "shadow",
    "group",
    "root_id",
    "parent_id",
    "argsrepr",
    "kwargsrepr",
    "origin",
    "lang",
    CLAIM_HEADER,
)
_EMBED_KEYS = {"callbacks", "errbacks", "chain", "chord"}
#: The JSON decoder Celery reads a task's body with (kombu's, typed here: kombu ships no annotations).
_kombu_loads: Callable[[bytes | str], Any] = kombu_json.loads


class Refused(Exception):
    """A message a worker will not run: why (one of ``REASONS``) and a detail without its text."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


def check_raw(item: bytes | str) -> dict[str, Any]:
    """The Redis list item as a dict kombu can build a message from; ``Refused`` if it is not one."""
    if len(item) > MAX_MESSAGE_BYTES:
        raise Refused("envelope", f"message of {len(item)} bytes; the limit is {MAX_MESSAGE_BYTES}")
    try:
        text = item.decode("utf-8") if isinstance(item, bytes) else item
        payload = json.loads(text)
    except (UnicodeDecodeError, ValueError):
        raise Refused("envelope", "not a JSON document") from None
    if not isinstance(payload, dict):
        raise Refused("envelope", f"a JSON {type(payload).__name__}, not an object")
    properties = payload.get("properties")
    if not isinstance(properties, dict):
        raise Refused("envelope", "properties is not an object")
    tag = properties.get("delivery_tag")
    if not isinstance(tag, str) or not 0 < len(tag) <= _MAX_ID_CHARS or not tag.isprintable():
        raise Refused("envelope", f"properties.delivery_tag is not a printable string of 1..{_MAX_ID_CHARS} characters")
    _check_delivery_info(properties.get("delivery_info"))
    priority = properties.get("priority")
    if priority is not None and not (_is_int(priority) and 0 <= priority <= 255):
        raise Refused("envelope", "properties.priority is not an integer 0..255")
    headers = payload.get("headers")
    if not isinstance(headers, dict):
        raise Refused("headers", "headers is not an object")
    for name in ("content-type", "content-encoding"):
        if not isinstance(payload.get(name), str):
            raise Refused("encoding", f"{name} is not a string")
    body = payload.get("body")
    if not isinstance(body, str):
        raise Refused("body", "body is not a string")
    encoding = properties.get("body_encoding")
    if encoding != "base64":
        raise Refused("encoding", f"body_encoding {str(encoding)[:20]!r}; expected base64")
    try:
        base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise Refused("encoding", "body is not valid base64") from None
    return payload


def _check_delivery_info(info: Any) -> None:
    # kombu files every delivered message in its ``unacked`` record under ``delivery_info``'s exchange
    # and routing key (``QoS.append``), and restores it by them: a message without them raises inside
    # the consumer's event loop, and the worker loses its broker connection with every job it holds.
    if not isinstance(info, dict):
        raise Refused("envelope", "properties.delivery_info is not an object")
    for name in ("exchange", "routing_key"):
        value = info.get(name)
        if not isinstance(value, str) or len(value) > _MAX_ID_CHARS or not value.isprintable():
            raise Refused("envelope", f"properties.delivery_info.{name} is not a printable string")
    if not info["routing_key"]:
        raise Refused("envelope", "properties.delivery_info.routing_key is empty")
    if info.get("redelivered") is not None and not isinstance(info["redelivered"], bool):
        raise Refused("envelope", "properties.delivery_info.redelivered is not a boolean")


def check_task(
    headers: Any, body: bytes | str | None, *, content_type: Any, content_encoding: Any, tasks: Collection[str]
) -> TaskMessage:
    """A protocol-2 task message that Celery can take apart without failing; ``Refused`` otherwise."""
    if not isinstance(headers, Mapping):
        raise Refused("headers", "headers is not an object")
    if content_type != "application/json":
        raise Refused("encoding", f"content type {str(content_type)[:40]!r}; ttsq accepts application/json only")
    if content_encoding not in ("utf-8", "utf8"):
        raise Refused("encoding", f"content encoding {str(content_encoding)[:20]!r}; expected utf-8")
    if "task" not in headers and "id" not in headers and _protocol_1(body):
        raise Refused("protocol", "a protocol 1 message (task and id in the body); ttsq workers take protocol 2")
    task_id = headers.get("id")
    if not isinstance(task_id, str) or not 0 < len(task_id) <= _MAX_ID_CHARS or not task_id.isprintable():
        raise Refused("headers", f"id must be a printable string of 1..{_MAX_ID_CHARS} characters")
    task = headers.get("task")
    if not isinstance(task, str):
        raise Refused("headers", "task is not a string")
    if task not in tasks:
        raise Refused("unknown task", f"task {task[:60]!r} is not a ttsq task")
    _check_headers(headers)
    return TaskMessage(task_id=task_id, task=task, args_kwargs=_check_body(body))


def _protocol_1(body: bytes | str | None) -> bool:
    """Whether a body is Celery's task protocol 1: one object naming the task and its id (protocol 2
    keeps both in the headers and the body is ``[args, kwargs, embed]``)."""
    try:
        payload = json.loads(body) if body else None
    except (ValueError, TypeError):
        return False
    return isinstance(payload, dict) and "task" in payload and "id" in payload


@dataclass(frozen=True)
class TaskMessage:
    """What ``check_task`` found: the task, its id and its decoded body."""

    task_id: str
    task: str
    args_kwargs: tuple[list[Any], dict[str, Any]]


def _check_headers(headers: Mapping[str, Any]) -> None:
    for name in _OPTIONAL_STRINGS:
        if headers.get(name) is not None and not isinstance(headers[name], str):
            raise Refused("headers", f"{name} is not a string")
    for name in ("eta", "expires"):
        value = headers.get(name)
        if value is not None and not _is_iso_time(value):
            raise Refused("headers", f"{name} is not an ISO 8601 time")
    retries = headers.get("retries")
    if retries is not None and (not _is_int(retries) or not 0 <= retries <= _MAX_RETRIES):
        raise Refused("headers", f"retries is not an integer 0..{_MAX_RETRIES}")
    for name in ("group_index", "replaced_task_nesting"):
        if headers.get(name) is not None and not _is_int(headers[name]):
            raise Refused("headers", f"{name} is not an integer")
    limits = headers.get("timelimit")
    if limits is not None and not (
        isinstance(limits, (list, tuple))
        and len(limits) == 2
        and all(limit is None or (_is_number(limit) and limit >= 0) for limit in limits)
    ):
        raise Refused("headers", "timelimit is not [hard, soft] seconds")
    if headers.get("ignore_result") is not None and not isinstance(headers["ignore_result"], bool):
        raise Refused("headers", "ignore_result is not a boolean")
    stamped = headers.get("stamped_headers")
    if stamped is not None and not (isinstance(stamped, list) and all(isinstance(s, str) for s in stamped)):
        raise Refused("headers", "stamped_headers is not a list of strings")
    if headers.get("stamps") is not None and not isinstance(headers["stamps"], dict):
        raise Refused("headers", "stamps is not an object")
    if headers.get(SENT_AT_HEADER) is not None and not _is_number(headers[SENT_AT_HEADER]):
        raise Refused("headers", f"{SENT_AT_HEADER} is not a number")
    if headers.get(SEQ_HEADER) is not None and not _is_int(headers[SEQ_HEADER]):
        raise Refused("headers", f"{SEQ_HEADER} is not an integer")
    if headers.get(DOCUMENT_HEADER) is not None and not isinstance(headers[DOCUMENT_HEADER], dict):
        raise Refused("headers", f"{DOCUMENT_HEADER} is not an object")


def _check_body(body: bytes | str | None) -> tuple[list[Any], dict[str, Any]]:
    # Decoded as Celery will decode it, with kombu's JSON: kombu turns an object of exactly ``__type__``
    # and ``__value__`` into a Python value (a ``Decimal``, a ``datetime``), so kwargs that are an
    # object to plain JSON may reach Celery as something else, or fail its decoder inside the consumer.
    try:
        decoded = _kombu_loads(body if body is not None else "")
    except Exception:  # kombu's type decoders raise whatever their constructors raise
        raise Refused("body", "body is not JSON kombu can decode") from None
    if not (isinstance(decoded, list) and len(decoded) == 3):
        raise Refused("body", "body is not [args, kwargs, embed]")
    args, kwargs, embed = decoded
    if not isinstance(args, list):
        raise Refused("body", "args is not a list")
    if not isinstance(kwargs, dict):
        raise Refused("body", "kwargs is not an object")
    if embed is not None:
        if not isinstance(embed, dict) or not set(embed) <= _EMBED_KEYS:
            raise Refused("body", "embed is not an object of callbacks, errbacks, chain, chord")
        for name in ("callbacks", "errbacks", "chain"):
            value = embed.get(name)
            if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
                raise Refused("body", f"embed.{name} is not a list of signatures")
        if embed.get("chord") is not None and not isinstance(embed["chord"], dict):
            raise Refused("body", "embed.chord is not a signature")
    return args, kwargs


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_iso_time(value: Any) -> bool:
    if not isinstance(value, str) or len(value) > 64:
        return False
    from celery.utils.time import maybe_iso8601

    try:
        maybe_iso8601(value)
    except (AttributeError, ValueError, TypeError, OverflowError):
        return False
    return True
