"""The content key: one SHA-256 over everything that shapes the audio.

Two requests with the same key must be allowed to share one stored file, so the key covers the
engine and the exact model revision as well as every request field that changes the sound, and
nothing else (no request id, no time). The recipe is canonical JSON: sorted keys, no whitespace,
UTF-8, with text already NFC-normalized by ``SynthesisRequest``. Python's float repr is the shortest
round-trip form, so the bytes are the same on every Python 3 version and every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

from ttsq.constants import KEY_SCHEMA_VERSION, POSTPROCESS_VERSION
from ttsq.job import SCHEDULING_FIELDS

if TYPE_CHECKING:
    from ttsq.engines.base import EngineIdentity
    from ttsq.job import SynthesisRequest


#: File extension per output format.
EXTENSIONS = {"wav": "wav", "flac": "flac", "ogg": "ogg", "mp3": "mp3"}


def canonical_json(value: Any) -> bytes:
    """The one serialization that keys are computed over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")


def content_key(request: SynthesisRequest, identity: EngineIdentity) -> str:
    """Hex SHA-256 of the request as the given engine would render it."""
    material = {
        "schema": KEY_SCHEMA_VERSION,
        "postprocess": POSTPROCESS_VERSION,
        "engine": identity.engine,
        "model": identity.model,
        "revision": identity.revision,
        "sample_rate": identity.sample_rate,
        **request.to_dict(),
    }
    # When, how and for whom the audio is wanted (deadline, streamed or not, lane, tenant) does not
    # change how it sounds: the same audio serves them all.
    for name in SCHEDULING_FIELDS:
        material.pop(name, None)
    return hashlib.sha256(canonical_json(material)).hexdigest()


def audio_key(request: SynthesisRequest, identity: EngineIdentity) -> str:
    """The content key whose object holds a request's audio: its own key, or for a request that asks
    for word timestamps, the key of the same request without them (one stored file serves both; the
    words are stored beside it, under ``words_key`` of the request's own key)."""
    if request.timestamps is None:
        return content_key(request, identity)
    return content_key(dataclasses.replace(request, timestamps=None), identity)


def words_key(key: str) -> str:
    """Where the word times of a content key (or a document key) live in storage, beside the audio."""
    return f"audio/{key[:2]}/{key}.words.json"


#: Every key ``words_key`` makes, and nothing else.
WORDS_KEY_PATTERN = re.compile(r"audio/([0-9a-f]{2})/(\1[0-9a-f]{62})\.words\.json")


def is_words_key(value: object) -> bool:
    """Whether ``value`` is a key ``words_key`` could have made (checked before storage reads it)."""
    return isinstance(value, str) and WORDS_KEY_PATTERN.fullmatch(value) is not None


def object_key(key: str, audio_format: str) -> str:
    """Where the audio for a content key lives in storage (fanned out by the first two hex digits)."""
    return f"audio/{key[:2]}/{key}.{EXTENSIONS[audio_format]}"


#: Every object key ``object_key`` makes, and nothing else.
OBJECT_KEY_PATTERN = re.compile(r"audio/([0-9a-f]{2})/(\1[0-9a-f]{62})\.(?:wav|flac|ogg|mp3)")


def is_object_key(value: object) -> bool:
    """Whether ``value`` is a key ``object_key`` could have made: a result read back is held to this
    before storage or a download touches it (no path of another shape, no ``..``)."""
    return isinstance(value, str) and OBJECT_KEY_PATTERN.fullmatch(value) is not None
