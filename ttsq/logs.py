"""One guard for every log record a ttsq process writes, whatever library writes it.

Untrusted values reach logs through code ttsq does not own: OpenTelemetry's parser logs an invalid
``tracestate`` member as it came, kombu and Celery log message fields, uvicorn logs request lines.
Escaping at ttsq's own call sites cannot reach those, so ``guard_logs`` (called once, first thing, by
the ``ttsq`` entry point that starts every worker, launcher, gateway, Flower and command) makes every
record the process creates a ``GuardedRecord``:

- its message, arguments included, comes out with every control character escaped (every C0 control,
  tab and newline included; DEL; the C1 controls, 8-bit escape sequence introducer among them; the line
  and paragraph separators and the bidirectional overrides, which break or reorder a line in a viewer):
  one record, one line, and no escape sequence reaches an operator's terminal;
- its arguments are escaped as well, for formatters that read them without the message (uvicorn's
  access log builds its request line from them);
- its traceback and stack keep their newlines, with every other control character escaped and every
  line indented under the record's first. A traceback stays readable, and an exception's message,
  which may quote anything, cannot begin a line of its own. Escaping the message inside a traceback
  instead would mean reparsing text Python formats (chained exceptions, groups, notes), and a multi-line
  message would become one long line; an indented continuation is also what log shippers' multi-line
  rules join to the record above.

Why a record factory, not a filter or formatter on each handler: handlers come and go out of ttsq's
hands (Celery gives its task loggers their own when the worker starts, uvicorn installs its own from
its config, a record no handler takes goes to ``logging.lastResort``), and a guard on each is one
missed when a library adds another. Every record, whichever logger and handler, is made by the factory.
Formatters stay what they were: colours a formatter adds around a line are its own, not the record's,
and so are the fields it adds (a logger's name, Celery's task id, which the worker's gate has already
checked). What a process writes without logging (Celery's start-up banner, a warning printed before
Celery captures warnings) is not a record and carries no request's values.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

#: What the guard escapes: C0 controls, DEL and C1 controls; the line and paragraph separators; the
#: bidirectional embeddings, overrides and isolates; lone surrogates (JSON's ``\ud800`` decodes to one,
#: and a stream that writes UTF-8 fails on it: the record would be lost).
_OTHERS = "\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE = re.compile(f"[\x00-\x1f{_OTHERS}]")
_UNSAFE_BUT_NEWLINE = re.compile(f"[\x00-\x09\x0b-\x1f{_OTHERS}]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
#: What each line of a traceback or a stack starts with, under its record.
INDENT = "    "


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) <= 0xFF else f"\\u{ord(char):04x}")


def escape(text: str) -> str:
    """``text`` with its control characters as escapes (``\\n``, ``\\x1b``, ``\\u2028``): one line, no
    terminal control. Text without any is returned as it is."""
    # isprintable is the fast answer for nearly every message; what it refuses, the pattern decides.
    return text if text.isprintable() or _UNSAFE.search(text) is None else _UNSAFE.sub(_escaped, text)


def indented(text: str) -> str:
    """A traceback or a stack for a log: control characters but the newline escaped, every line indented."""
    return INDENT + _UNSAFE_BUT_NEWLINE.sub(_escaped, text).replace("\n", "\n" + INDENT)


def _unsafe(value: Any) -> bool:
    return isinstance(value, str) and escape(value) is not value


def _escaped_argument(value: Any) -> Any:
    return escape(value) if isinstance(value, str) else value


class GuardedRecord(logging.LogRecord):
    """A log record whose message, arguments, traceback and stack come out escaped (see the module)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Copied only when an argument needs escaping: nearly every record keeps its own.
        if isinstance(self.args, tuple):
            if any(_unsafe(value) for value in self.args):
                self.args = tuple(_escaped_argument(value) for value in self.args)
        elif isinstance(self.args, Mapping) and any(_unsafe(value) for value in self.args.values()):
            self.args = {name: _escaped_argument(value) for name, value in self.args.items()}

    def getMessage(self) -> str:
        return escape(super().getMessage())

    # A formatter formats the traceback once and keeps it here; the stack is kept as it was taken.
    @property
    def exc_text(self) -> str | None:
        return self._exc_text

    @exc_text.setter
    def exc_text(self, text: str | None) -> None:
        self._exc_text = text if not text else indented(text)

    @property
    def stack_info(self) -> str | None:
        return self._stack_info

    @stack_info.setter
    def stack_info(self, text: str | None) -> None:
        self._stack_info = text if not text else indented(text)


def guard_logs() -> None:
    """Make every log record this process creates from now on a ``GuardedRecord``. Once per process,
    at its entry point, before anything logs; a second call changes nothing."""
    if logging.getLogRecordFactory() is not GuardedRecord:
        logging.setLogRecordFactory(GuardedRecord)
