"""What ttsq withholds from logs, events and operator views: input text, presigned URLs, passwords.

Every place that reports a job outside its result goes through here:

- ``printable``: an untrusted name (a task id, a task name from a broker message) with its control
  characters escaped and its length cut, for terminals and stored notes (log lines are escaped by the
  log guard, ``ttsq.logs``, whoever writes them);
- ``redact_url``: a Redis (or any) URL with its password masked, for messages and logs;
- ``describe_kwargs``: raw task kwargs as field names and sizes (a producer outside ttsq sends
  Celery's default repr, with the text in it);
- ``redact_result``: a result repr with its presigned URL replaced;
- ``redact_task_logs``: filters on Celery's own worker log lines (the task's kwargs and return value,
  the body of a message it cannot use);
- ``RedactedRequest``: the worker-side Celery request whose events (Flower) and ``inspect`` replies
  carry only the redacted forms.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from celery.worker.request import Request

from ttsq.errors import InvalidRequest

#: Request fields whose value is short, fixed vocabulary or a number: shown as they are (truncated).
_PLAIN_FIELDS = (
    "mode",
    "language",
    "format",
    "seed",
    "temperature",
    "top_p",
    "top_k",
    "repetition_penalty",
    "max_new_tokens",
)
_URL = re.compile(r"""(['"]url['"]:\s*)(['"])[^'"]*(\2|$)""")


def printable(text: Any, limit: int = 120) -> str:
    """``text`` for a terminal or a note: characters that are not printable (newlines, terminal
    escape sequences, bidirectional overrides) as ``\\xNN``/``\\uNNNN`` escapes, cut to ``limit``
    characters with ``...`` marking the cut. A forged log line or a terminal command cannot pass."""
    text = text if isinstance(text, str) else str(text)
    out: list[str] = []
    size = 0
    for char in text:
        shown = char if char.isprintable() else _escaped(char)
        if size + len(shown) > limit:
            out.append("...")
            break
        out.append(shown)
        size += len(shown)
    return "".join(out)


def _escaped(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def redact_url(url: str) -> str:
    """The URL with any password replaced, for messages and logs; each address of a Sentinel URL
    (``sentinel://...;sentinel://...``) on its own."""
    if url.startswith("sentinel://") and ";" in url:
        return ";".join(redact_url(address) for address in url.split(";"))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def describe_kwargs(kwargs: Any) -> str:
    """A log- and Flower-safe summary of raw task kwargs: sizes of free text, values of the rest."""
    if not isinstance(kwargs, Mapping):
        return "<redacted>"
    parts = []
    for name in sorted(kwargs, key=str):
        value = kwargs[name]
        if name in _PLAIN_FIELDS and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            parts.append(f"{name}={str(value)[:24]}")
        elif isinstance(value, str):
            parts.append(f"{str(name)[:24]}=<{len(value)} chars>")
        else:
            parts.append(f"{str(name)[:24]}=<{type(value).__name__}>")
    return " ".join(parts)


def redact_result(text: Any) -> Any:
    """A result repr with the presigned URL replaced (the rest is key, sizes and timings)."""
    if not isinstance(text, str):
        return text
    return _URL.sub(lambda m: f"{m.group(1)}{m.group(2)}<url>{m.group(2)}", text)


def redact_task_logs() -> None:
    """Keep input text and presigned URLs out of Celery's own task log lines (worker processes), and a
    refused request out of the error log: it is one line at WARNING, without a traceback."""
    trace_logger = logging.getLogger("celery.app.trace")
    if _redact_return_value not in trace_logger.filters:
        trace_logger.addFilter(_redact_return_value)
    if _quiet_refusal not in trace_logger.filters:
        trace_logger.addFilter(_quiet_refusal)
    consumer_logger = logging.getLogger("celery.worker.consumer.consumer")
    if _redact_message_body not in consumer_logger.filters:
        consumer_logger.addFilter(_redact_message_body)


def _redact_message_body(record: logging.LogRecord) -> bool:
    """Celery logs the body of a message it cannot use (undecodable, malformed, unknown task): that
    body is a request, input text included. Keep the reason, withhold the body."""
    if record.levelno >= logging.WARNING and isinstance(record.msg, str) and "body" in record.msg:
        reason = record.args[0] if isinstance(record.args, tuple) and record.args else None
        summary = f"{type(reason).__name__}: {reason}" if isinstance(reason, BaseException) else str(reason)[:200]
        if record.msg.startswith("Received and deleted unknown message"):
            summary = "unknown message format"
        record.msg = "%s; message dropped (its body is withheld from the log: it may hold input text)"
        record.args = (summary,)
        record.exc_info = None
        record.exc_text = None
    return True


def _quiet_refusal(record: logging.LogRecord) -> bool:
    """A job failed with ``InvalidRequest`` is the request's fault, foreseen and named: a warning in one
    line, not an error with the worker's traceback."""
    if record.exc_info and isinstance(record.exc_info[1], InvalidRequest):
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = None
        record.exc_text = None
    return True


def _redact_return_value(record: logging.LogRecord) -> bool:
    """Celery's task log lines carry the kwargs (input text) and the return value (a presigned URL)."""
    if isinstance(record.args, dict):
        redacted = {"return_value": "<ttsq result>", "args": "<redacted>", "kwargs": "<redacted>"}
        record.args = {name: redacted.get(name, value) for name, value in record.args.items()}
    return True


class RedactedRequest(Request):  # type: ignore[misc]
    """Celery's worker-side request, with the task's arguments and URL kept out of what it reports.

    A producer that uses ``ttsq.client`` already sends a redacted ``kwargsrepr``; a web backend that
    calls ``send_task`` directly sends a repr of the kwargs with the text in it, which the worker would
    copy into its ``task-received`` event. Flower's task list, task pages and API, and ``celery
    inspect``, all show what this class reports instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Every report (task-received event, the "Received task" log line, inspect replies) reads
        # these two; the real arguments stay in the request for the task itself.
        self._argsrepr = "()" if not self._args else f"<{len(self._args)} positional arguments>"
        self._kwargsrepr = describe_kwargs(self._kwargs)

    def info(self, safe: bool = False) -> dict[str, Any]:
        """What ``celery inspect active`` (and Flower's worker page) shows: the redacted forms, always."""
        info: dict[str, Any] = super().info(safe=True)
        return info

    def send_event(self, type: str, **fields: Any) -> None:  # Celery's own signature
        if "result" in fields:
            fields["result"] = redact_result(fields["result"])
        super().send_event(type, **fields)
