"""What Celery's events, and so Flower, see of a job: never the input text, never a signed URL.

A producer that uses ``ttsq.client`` already sends a redacted ``kwargsrepr``, but a web backend that
calls ``send_task`` directly sends Celery's default, a repr of the kwargs with the text in it, and the
worker would copy that into its ``task-received`` event. So the worker decides: ``RedactedRequest``
(the task's ``Request`` class) describes the kwargs by field names and sizes only, and takes the
presigned URL out of the result repr of ``task-succeeded``. Flower's task list, task pages and API,
and ``celery inspect``, all show these redacted forms.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from celery.worker.request import Request

#: Request fields whose value is short, fixed vocabulary or a number: shown as they are (truncated).
_PLAIN_FIELDS = ("mode", "language", "format", "seed", "temperature", "top_p", "top_k",
                 "repetition_penalty", "max_new_tokens")
_URL = re.compile(r"""(['"]url['"]:\s*)(['"])[^'"]*(\2|$)""")


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


class RedactedRequest(Request):  # type: ignore[misc]
    """Celery's worker-side request, with the task's arguments and URL kept out of what it reports."""

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
