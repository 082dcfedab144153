"""Finished spans as an OTLP ``ExportTraceServiceRequest``, encoded by hand.

Why not the SDK's encoder: ``opentelemetry-exporter-otlp-proto-common`` builds a protobuf message object
for every span, attribute, value and link and then serializes them; on a worker whose Python is the
bottleneck (a fast engine on a few cores) that is about half of what tracing costs. The wire format of
the few messages a span needs is small and fixed (``opentelemetry/proto/trace/v1/trace.proto``), so this
module writes the bytes directly, and caches what repeats from span to span: the resource, the
instrumentation scope, span names and attribute keys. The result decodes to the same message the SDK's
``encode_spans`` builds (a contract test compares them field for field).

Only the encoding is ttsq's: the exporter that sends it (endpoint, headers, TLS, compression, retries)
stays OpenTelemetry's own (``ttsq.tracing``).
"""

from __future__ import annotations

import struct
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

#: The OTLP ``SpanKind`` of each API ``SpanKind`` value (the API counts from 0, OTLP from 1: 0 is unset).
_KIND = (b"\x30\x01", b"\x30\x02", b"\x30\x03", b"\x30\x04", b"\x30\x05")
#: ``Span.flags``: the context says whether its parent is remote (``SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK``),
#: and whether it is (``..._IS_REMOTE_MASK``); tag 16, fixed32.
_FLAGS_LOCAL = b"\x85\x01" + struct.pack("<I", 0x100)
_FLAGS_REMOTE = b"\x85\x01" + struct.pack("<I", 0x300)
_LINK_FLAGS_LOCAL = b"\x35" + struct.pack("<I", 0x100)
_LINK_FLAGS_REMOTE = b"\x35" + struct.pack("<I", 0x300)
_FIXED64 = struct.Struct("<Q").pack
_DOUBLE = struct.Struct("<d").pack
_EMPTY_STATUS = b"\x7a\x00"
#: Most distinct keys and names remembered; past it the caches start again (keys are a code's constants,
#: but an application's own spans might name things without bound).
_CACHE_ENTRIES = 4096


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _delimited(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: its tag, the payload's length, the payload."""
    return tag + _varint(len(payload)) + payload


def _text(tag: bytes, value: str) -> bytes:
    return _delimited(tag, value.encode("utf-8", "surrogatepass"))


def _value(value: Any) -> bytes:
    """An ``AnyValue``'s fields (the SDK's order of tests: bool before int, as bool is an int)."""
    if value is None:
        return b""
    if isinstance(value, str):
        return _text(b"\x0a", value)
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)
    if isinstance(value, float):
        return b"\x21" + _DOUBLE(value)
    if isinstance(value, bytes):
        return _delimited(b"\x3a", value)
    if isinstance(value, Mapping):
        return _delimited(b"\x32", b"".join(_delimited(b"\x0a", _key_value(str(k), v)) for k, v in value.items()))
    if isinstance(value, Sequence):
        return _delimited(b"\x2a", b"".join(_delimited(b"\x0a", _value(item)) for item in value))
    raise TypeError(f"an attribute's value of type {type(value).__name__} cannot be exported")


def _key_value(key: str, value: Any) -> bytes:
    return _text(b"\x0a", key) + _delimited(b"\x12", _value(value))


class Encoder:
    """Encodes batches of SDK ``ReadableSpan``s; one per exporter (its caches are not shared between
    threads: an exporter is called by its one batch processor thread)."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        self._names: dict[str, bytes] = {}
        self._groups: dict[Any, bytes] = {}

    def request(self, spans: Iterable[Any]) -> bytes:
        """The serialized ``ExportTraceServiceRequest`` of ``spans``, grouped by resource, then scope."""
        grouped: defaultdict[Any, defaultdict[Any, list[bytes]]] = defaultdict(lambda: defaultdict(list))
        for span in spans:
            grouped[span.resource][span.instrumentation_scope or None].append(
                _delimited(b"\x12", self.span(span))  # ScopeSpans.spans
            )
        out = []
        for resource, scopes in grouped.items():
            body = [self._group(_resource, resource)]
            for scope, encoded in scopes.items():
                head = self._group(_scope, scope)
                body.append(_delimited(b"\x12", head + b"".join(encoded)))  # ResourceSpans.scope_spans
            if resource.schema_url:
                body.append(_text(b"\x1a", resource.schema_url))
            out.append(_delimited(b"\x0a", b"".join(body)))  # ExportTraceServiceRequest.resource_spans
        return b"".join(out)

    def span(self, span: Any) -> bytes:
        """One ``Span`` message's fields."""
        context = span.context
        parent = span.parent
        parts = [
            b"\x0a\x10" + context.trace_id.to_bytes(16, "big"),
            b"\x12\x08" + context.span_id.to_bytes(8, "big"),
        ]
        if context.trace_state:
            parts.append(_text(b"\x1a", ",".join(f"{k}={v}" for k, v in context.trace_state.items())))
        if parent is not None:
            parts.append(b"\x22\x08" + parent.span_id.to_bytes(8, "big"))
        parts.append(self._name(span.name))
        parts.append(_KIND[span.kind.value])
        parts.append(b"\x39" + _FIXED64(span.start_time or 0))
        parts.append(b"\x41" + _FIXED64(span.end_time or 0))
        if span.attributes:
            parts.append(self._attributes(b"\x4a", span.attributes))
        if span.dropped_attributes:
            parts.append(b"\x50" + _varint(span.dropped_attributes))
        for event in span.events:
            fields = b"\x09" + _FIXED64(event.timestamp) + _text(b"\x12", event.name)
            if event.attributes:
                fields += self._attributes(b"\x1a", event.attributes)
            if event.dropped_attributes:
                fields += b"\x20" + _varint(event.dropped_attributes)
            parts.append(_delimited(b"\x5a", fields))
        if span.dropped_events:
            parts.append(b"\x60" + _varint(span.dropped_events))
        for link in span.links:
            linked = link.context
            fields = b"\x0a\x10" + linked.trace_id.to_bytes(16, "big") + b"\x12\x08" + linked.span_id.to_bytes(8, "big")
            if link.attributes:
                fields += self._attributes(b"\x22", link.attributes)
            if link.dropped_attributes:
                fields += b"\x28" + _varint(link.dropped_attributes)
            fields += _LINK_FLAGS_REMOTE if linked.is_remote else _LINK_FLAGS_LOCAL
            parts.append(_delimited(b"\x6a", fields))
        if span.dropped_links:
            parts.append(b"\x70" + _varint(span.dropped_links))
        status = span.status
        if status is not None:  # the SDK writes an UNSET status too, as an empty message
            fields = _text(b"\x12", status.description) if status.description else b""
            if status.status_code.value:
                fields += b"\x18" + _varint(status.status_code.value)
            parts.append(_delimited(b"\x7a", fields) if fields else _EMPTY_STATUS)
        parts.append(_FLAGS_REMOTE if parent is not None and parent.is_remote else _FLAGS_LOCAL)
        return b"".join(parts)

    def _attributes(self, tag: bytes, attributes: Mapping[str, Any]) -> bytes:
        keys = self._keys
        out = []
        for key, value in attributes.items():
            head = keys.get(key)
            if head is None:
                head = _remember(keys, key, _text(b"\x0a", key))
            out.append(_delimited(tag, head + _delimited(b"\x12", _value(value))))
        return b"".join(out)

    def _name(self, name: str) -> bytes:
        found = self._names.get(name)
        return found if found is not None else _remember(self._names, name, _text(b"\x2a", name))

    def _group(self, encode: Callable[[Any], bytes], value: Any) -> bytes:
        """A resource's or a scope's fields, encoded once (both are immutable and hashable)."""
        key = (encode, value)
        found = self._groups.get(key)
        return found if found is not None else _remember(self._groups, key, encode(value))


def _remember(cache: dict[Any, bytes], key: Any, encoded: bytes) -> bytes:
    if len(cache) >= _CACHE_ENTRIES:
        cache.clear()
    cache[key] = encoded
    return encoded


def _attributes(tag: bytes, attributes: Mapping[str, Any]) -> bytes:
    return b"".join(_delimited(tag, _key_value(k, v)) for k, v in attributes.items())


def _resource(resource: Any) -> bytes:
    """``ResourceSpans.resource``: the ``Resource`` message, as a field."""
    return _delimited(b"\x0a", _attributes(b"\x0a", resource.attributes))


def _scope(scope: Any) -> bytes:
    """``ScopeSpans.scope`` (and its schema URL) as fields; nothing for a span without a scope."""
    if scope is None:
        return b""
    fields = _text(b"\x0a", scope.name) if scope.name else b""
    if scope.version:
        fields += _text(b"\x12", scope.version)
    if scope.attributes:
        fields += _attributes(b"\x1a", scope.attributes)
    out = _delimited(b"\x0a", fields)
    if scope.schema_url:
        out += _text(b"\x1a", scope.schema_url)
    return out
