"""ttsq's own recording span: what the SDK's span records, at a third of its cost a span.

Why: a job makes a dozen spans (``ttsq.tracing``), and on a worker whose engine is fast (espeak on a few
cores) opening and ending them through the SDK's tracer was about half of what tracing cost: a sampler
call, a validated copy of every attribute, a lock, a limits check and a second, read-only copy of the
span at its end. A span whose parent is sampled needs none of the sampler's deciding: with the SDK's
default sampler (parent-based) a child of a sampled span is always recorded, with its parent's flags and
trace state. So such a span is made here: it implements OpenTelemetry's ``Span`` API (current in the
context, seen by ``get_current_span``, by other instrumentation and by the propagator like any other),
and at its end it hands the SDK's own ``ReadableSpan`` to the provider's span processors, which export
it as they export every span.

Everything else stays the SDK's: a root span (the sampler decides), a span whose parent is not sampled,
any span under a sampler that is not parent-based, and every span of a tracer provider the application
installed (its processors may want ``on_start``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode

_UNSET = Status(StatusCode.UNSET)
#: The SDK's default span limits (``OTEL_SPAN_*_LIMIT``), which ttsq's spans stay far below: a span that
#: would pass them (application code annotating a ttsq span without end) drops the excess.
_MAX_ATTRIBUTES = 128
_MAX_EVENTS = 128


_SCALARS = (str, bool, int, float, bytes)


def _clean(value: Any) -> Any:
    """An attribute value as OpenTelemetry keeps it: a scalar, a sequence (as a tuple) or a mapping of
    them; None for anything else, which is dropped (an export must not fail on one odd value)."""
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, Sequence):
        items = tuple(_clean(item) for item in value)
        return items if all(item is not None for item in items) else None
    if isinstance(value, Mapping):
        cleaned = {str(key): _clean(item) for key, item in value.items()}
        return cleaned if all(item is not None for item in cleaned.values()) else None
    return None


class Maker:
    """Makes recording spans for one SDK tracer: its span processors, resource, ids and scope."""

    def __init__(self, tracer: Any, scope: InstrumentationScope) -> None:
        self.processor = tracer.span_processor
        self.resource = tracer.resource
        self.ids = tracer.id_generator
        self.scope = scope

    @staticmethod
    def serves(tracer: Any) -> bool:
        """Whether spans made here are the ones ``tracer`` would make: its sampler records every child
        of a sampled parent (OpenTelemetry's default, ``parentbased_always_on``, and every
        ``parentbased_*`` sampler the ``OTEL_TRACES_SAMPLER`` variable names)."""
        sampler = getattr(tracer, "sampler", None)
        return (
            isinstance(sampler, ParentBased)
            and getattr(sampler, "_local_parent_sampled", None) is ALWAYS_ON
            and getattr(sampler, "_remote_parent_sampled", None) is ALWAYS_ON
            and all(hasattr(tracer, name) for name in ("span_processor", "resource", "id_generator"))
        )

    def start(
        self,
        name: str,
        parent: SpanContext,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, Any] | None = None,
        links: Sequence[trace.Link] = (),
        start_time: int | None = None,
    ) -> LiteSpan:
        """A span under ``parent`` (valid and sampled), started now or at ``start_time`` (ns since the epoch)."""
        context = SpanContext(
            parent.trace_id,
            self.ids.generate_span_id(),
            is_remote=False,
            trace_flags=parent.trace_flags,
            trace_state=parent.trace_state,
        )
        kept = {key: clean for key, value in (attributes or {}).items() if (clean := _clean(value)) is not None}
        return LiteSpan(self, name, context, parent, kind, kept, links, start_time or time.time_ns())

    def finished(self, span: LiteSpan, end_time: int) -> None:
        self.processor.on_end(
            ReadableSpan(
                name=span.name,
                context=span.context,
                parent=span.parent,
                resource=self.resource,
                attributes=span.attributes,
                events=span.events,
                links=span.links,
                kind=span.kind,
                status=span.status,
                start_time=span.start_time,
                end_time=end_time,
                instrumentation_scope=self.scope,
            )
        )


class LiteSpan(Span):
    """A recording span ``Maker`` made: attributes, events, a name and a status until it ends, once."""

    __slots__ = (
        "attributes",
        "context",
        "ended",
        "events",
        "kind",
        "links",
        "lock",
        "maker",
        "name",
        "parent",
        "start_time",
        "status",
    )

    def __init__(
        self,
        maker: Maker,
        name: str,
        context: SpanContext,
        parent: SpanContext,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: Sequence[trace.Link],
        start_time: int,
    ) -> None:
        self.maker, self.name, self.context, self.parent, self.kind = maker, name, context, parent, kind
        self.attributes, self.links, self.start_time = attributes, tuple(links), start_time
        self.events: list[Event] = []
        self.status = _UNSET
        self.ended = False
        # Another thread may annotate a span that is current where it runs (a ttsq span is ended by the
        # thread that opened it, but an application's code may hold it).
        self.lock = threading.Lock()

    def end(self, end_time: int | None = None) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
        self.maker.finished(self, end_time or time.time_ns())

    def get_span_context(self) -> SpanContext:
        return self.context

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        with self.lock:
            if self.ended:
                return
            for key, value in attributes.items():
                clean = _clean(value)
                if clean is not None and (key in self.attributes or len(self.attributes) < _MAX_ATTRIBUTES):
                    self.attributes[key] = clean

    def set_attribute(self, key: str, value: Any) -> None:
        self.set_attributes({key: value})

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None, timestamp: int | None = None) -> None:
        with self.lock:
            if not self.ended and len(self.events) < _MAX_EVENTS:
                self.events.append(Event(name, dict(attributes or {}), timestamp or time.time_ns()))

    def update_name(self, name: str) -> None:
        with self.lock:
            if not self.ended:
                self.name = name

    def is_recording(self) -> bool:
        return not self.ended

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        if isinstance(status, StatusCode):
            status = Status(status, description)
        with self.lock:
            # As the SDK: OK is final, and UNSET never replaces what was set.
            if self.ended or self.status.status_code is StatusCode.OK or status.status_code is StatusCode.UNSET:
                return
            self.status = status

    def record_exception(
        self,
        exception: BaseException,
        attributes: Mapping[str, Any] | None = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        # The type only, as ttsq's own spans record failures: a message may quote what a job was asked to say.
        kind = type(exception)
        self.add_event(
            "exception",
            {"exception.type": f"{kind.__module__}.{kind.__qualname__}", **(attributes or {})},
            timestamp,
        )
