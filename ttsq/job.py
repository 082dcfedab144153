"""What a job is: the request a producer sends and the result a worker returns.

Both are plain JSON on the wire (the kwargs and the return value of the ``ttsq.synthesize`` task), so a
web backend can build them without importing ttsq. ``SynthesisRequest.from_dict`` is the one place
where input is validated; producers call it before anything is queued and workers call it again on
every message, because a raw ``send_task`` bypasses the producer.

Why one file over 400 lines: the request, its one validation point and the result types are the task
contract, and are read together.
"""

from __future__ import annotations

import math
import re
import time
import unicodedata
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, TypedDict, cast, get_args

from ttsq.alignment import TIMESTAMPS, Timestamps
from ttsq.constants import CHUNKS_SUFFIX, DEFAULT_TENANT, TENANT_PATTERN
from ttsq.errors import InvalidRequest

if TYPE_CHECKING:
    # Only under TYPE_CHECKING: content keys are also computed on Python 3.10 (tests/test_keys.py), which has none.
    from typing import NotRequired

    from ttsq.config import Settings

Mode = Literal["voice_design", "custom_voice", "voice_clone"]
AudioFormat = Literal["wav", "flac", "ogg", "mp3"]
#: Which of a mode's queues a job waits in (docs/scheduling.md): workers take interactive work first,
#: and give bulk work a guaranteed share.
Lane = Literal["interactive", "bulk"]

MODES: tuple[str, ...] = get_args(Mode)
FORMATS: tuple[str, ...] = get_args(AudioFormat)
LANES: tuple[str, ...] = get_args(Lane)
#: The suffix of a bulk lane's queue (``ttsq.app.queue_for``).
BULK_SUFFIX = ".bulk"


def lane_of(queue: str) -> Lane:
    """The lane a queue belongs to."""
    return "bulk" if queue.endswith(BULK_SUFFIX) else "interactive"


def turn_of(tenant: str | None, *, chunk: bool = False) -> str:
    """Whose turn a job waits for under the release window (``AcceptedJobs.defer``; docs/scheduling.md):
    its tenant's place, the default tenant's when it names none; a document's ``chunk`` waits in its
    tenant's chunk place (``CHUNKS_SUFFIX``).

    Every sender of a new job asks here, so nothing new reaches a queue past the window. Chunks wait
    too, in a place of their own: they take turns with the other tenants instead of filling the list, and
    are held to no per-tenant cap, since their document already counts against its tenant's cap and waits
    for them (counted with it, under a cap of one, they would wait for it for ever). The fan-out defers
    them with no cap (defer.lua counts nothing), and release.lua knows the place by its suffix and neither
    checks nor counts a cap there. Sent with no tenant, as they once were, chunks went to the queue at
    once, past the window (tests/test_ledger_simulation.py fails so). A job sent again (the sweeper,
    ``ttsq retry``) is sent with no tenant on purpose and does not ask: it waited its turn once."""
    return (tenant or DEFAULT_TENANT) + (CHUNKS_SUFFIX if chunk else "")


#: Request fields that say when and for whom the audio is made, not what it sounds like: no part of
#: a content key or a document's fields, so the same audio is one cache entry whatever they were.
SCHEDULING_FIELDS: tuple[str, ...] = ("deadline", "stream", "lane", "tenant")

#: The ten languages Qwen3-TTS speaks, by the lowercase English name qwen-tts uses, plus "auto".
LANGUAGES: tuple[str, ...] = (
    "auto",
    "chinese",
    "english",
    "japanese",
    "korean",
    "german",
    "french",
    "russian",
    "portuguese",
    "spanish",
    "italian",
)
_LANGUAGE_ALIASES: dict[str, str] = {
    "zh": "chinese",
    "zh-cn": "chinese",
    "cmn": "chinese",
    "mandarin": "chinese",
    "中文": "chinese",
    "en": "english",
    "eng": "english",
    "ja": "japanese",
    "jp": "japanese",
    "日本語": "japanese",
    "ko": "korean",
    "kor": "korean",
    "한국어": "korean",
    "de": "german",
    "fr": "french",
    "ru": "russian",
    "pt": "portuguese",
    "es": "spanish",
    "it": "italian",
}

# Sampling ranges: wide enough for every sane use, narrow enough that a typo is caught at the edge.
_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.01, 2.0),
    "top_p": (0.01, 1.0),
    "repetition_penalty": (0.5, 2.0),
}
_INT_RANGES: dict[str, tuple[int, int]] = {
    "top_k": (1, 1000),
    "max_new_tokens": (1, 8192),  # codec frames; 8192 frames at 12.5 Hz is about 11 minutes
    "seed": (0, 2**32 - 1),
}
# A deadline is an absolute UNIX time: 2001..5138. A small number is a relative time sent by mistake.
_DEADLINE_RANGE = (1e9, 1e11)
# Bidi embeddings, overrides and isolates: they make text render differently from what is spoken.
_BIDI_CONTROLS = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_WHITESPACE = re.compile(r"\s+")
#: What a ``reference`` may hold: a voice stored by ``ttsq voices add``, and nothing else in the bucket.
REFERENCE_PATTERN = re.compile(r"voices/[0-9a-f]{64}\.wav")


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Input limits, taken from settings at the edge."""

    max_text_chars: int = 5000
    max_instruct_chars: int = 1000

    @classmethod
    def from_settings(cls, settings: Settings) -> Limits:
        """The limits a producer or worker enforces, from its settings."""
        return cls(max_text_chars=settings.max_text_chars, max_instruct_chars=settings.max_instruct_chars)


@dataclass(frozen=True, kw_only=True)
class SynthesisRequest:
    """One synthesis job, validated and normalized. Build it with ``from_dict``."""

    text: str
    mode: Mode = "voice_design"
    language: str = "auto"
    instruct: str = ""
    speaker: str = ""
    #: Object key of a reference recording in ttsq's storage (voice_clone only).
    reference: str = ""
    format: AudioFormat = "wav"
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    #: Frame cap; None lets the engine derive it from the text length.
    max_new_tokens: int | None = None
    #: UNIX time (seconds) after which the job is worthless: dropped before synthesis, not run late.
    #: Not part of the content key: it changes when the audio is wanted, not what it sounds like.
    deadline: float | None = None
    #: Whether the worker also streams the audio as it is made (``ttsq.records.streams``). Not part
    #: of the content key either: a streamed clip is the same audio, stored and cached the same way.
    stream: bool = False
    #: The lane it waits in; None for the producer's default (``default_lane``). Not in the content key.
    lane: Lane | None = None
    #: Whose work it is, for fair shares between tenants (at the gateway: the API key's id). Not in
    #: the content key.
    tenant: str = ""
    #: The cache this request's audio is shared in: "" for the whole fleet's, or a tenant's id
    #: (``TTSQ_CACHE_SCOPE=tenant``): part of the content key, so a tenant's cache entries, stored files
    #: and single-flight claims are its own.
    cache_scope: str = ""
    #: ``"word"``: the result also says when each word is said (``words``, docs/timestamps.md). Part of
    #: the content key only as this flag: the audio is stored once, under the key of the same request
    #: without it (``ttsq.keys.audio_key``), and the word times beside it.
    timestamps: Timestamps | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], limits: Limits | None = None) -> SynthesisRequest:
        """Validate untrusted input (task kwargs, parsed JSON, flags); raise ``InvalidRequest``."""
        limits = limits or Limits()
        if not isinstance(data, Mapping):
            raise InvalidRequest("request", f"expected a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        for name in data:
            if name not in known:
                raise InvalidRequest(str(name)[:40], f"unknown field; expected one of {sorted(known)}")
        if "text" not in data:
            raise InvalidRequest("text", "is required")

        text = _clean_text("text", data["text"], limits.max_text_chars, required=True)
        instruct = _clean_text("instruct", data.get("instruct", ""), limits.max_instruct_chars)
        mode = _choice("mode", data.get("mode", "voice_design"), MODES)
        fmt = _choice("format", data.get("format", "wav"), FORMATS)
        language = _language(data.get("language", "auto"))
        # Speakers are case-insensitive in Qwen3-TTS: one spelling, one content key.
        speaker = _clean_text("speaker", data.get("speaker", ""), 64).lower()
        reference = _clean_text("reference", data.get("reference", ""), 1024)
        if reference and not REFERENCE_PATTERN.fullmatch(reference):
            raise InvalidRequest(
                "reference", "expected a voice key like voices/<64 hex digits>.wav, as printed by `ttsq voices add`"
            )

        if mode == "custom_voice" and not speaker:
            raise InvalidRequest("speaker", "is required for mode custom_voice")
        if mode != "custom_voice" and speaker:
            raise InvalidRequest("speaker", f"is only used by mode custom_voice, not {mode}")
        if mode == "voice_clone" and not reference:
            raise InvalidRequest("reference", "is required for mode voice_clone")
        if mode != "voice_clone" and reference:
            raise InvalidRequest("reference", f"is only used by mode voice_clone, not {mode}")

        numbers: dict[str, Any] = {}
        for name, (low, high) in _FLOAT_RANGES.items():
            numbers[name] = _number(name, data.get(name), float, low, high)
        for name, (ilow, ihigh) in _INT_RANGES.items():
            numbers[name] = _number(name, data.get(name), int, ilow, ihigh)

        numbers["deadline"] = _deadline(data.get("deadline"))
        stream = data.get("stream", False)
        if not isinstance(stream, bool):
            raise InvalidRequest("stream", f"expected true or false, got {type(stream).__name__}")
        lane, tenant = scheduling(data)
        cache_scope = data.get("cache_scope", "")
        if not isinstance(cache_scope, str) or (cache_scope and not TENANT_PATTERN.fullmatch(cache_scope)):
            raise InvalidRequest("cache_scope", "expected a tenant's id (1-64 letters, digits and . _ : @ -) or ''")

        timestamps = _timestamps(data.get("timestamps"))

        return cls(
            text=text,
            mode=cast(Mode, mode),
            language=language,
            instruct=instruct,
            speaker=speaker,
            reference=reference,
            format=cast(AudioFormat, fmt),
            stream=stream,
            lane=lane,
            tenant=tenant,
            cache_scope=cache_scope,
            timestamps=timestamps,
            **numbers,
        )

    def expired(self, now: float | None = None) -> bool:
        """Whether the deadline has passed."""
        return self.deadline is not None and (time.time() if now is None else now) >= self.deadline

    def to_dict(self) -> dict[str, Any]:
        """The task kwargs: plain JSON, accepted back by ``from_dict``. ``stream``, ``lane`` and ``tenant``
        only when set: a worker of an earlier release, which does not know them, still takes every other job."""
        data = asdict(self)
        unsets = (("stream", False), ("lane", None), ("tenant", ""), ("cache_scope", ""), ("timestamps", None))
        for name, unset in unsets:
            if data[name] == unset:
                del data[name]
        return data

    def lane_or(self, default: Lane) -> Lane:
        """The lane this job waits in, ``default`` when the request names none."""
        return self.lane or default

    def group(self) -> tuple[Any, ...]:
        """Requests with equal groups can share one forward pass."""
        # The seed is part of the group: a seed is set once per forward pass, not per row. Language,
        # voice and frame cap are per row (qwen-tts takes lists), so they do not split batches.
        return (self.mode, self.seed, self.temperature, self.top_p, self.top_k, self.repetition_penalty)

    def describe(self) -> str:
        """A log-safe summary: never the text itself."""
        return f"mode={self.mode} language={self.language} chars={len(self.text)} format={self.format}"


class RequestFields(TypedDict, total=False):
    """Keyword arguments of ``Client.submit`` beside the text: the request fields, all optional."""

    mode: Mode
    language: str
    instruct: str
    speaker: str
    reference: str
    format: AudioFormat
    seed: int
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    max_new_tokens: int
    deadline: float
    lane: Lane
    tenant: str
    cache_scope: str
    timestamps: Timestamps


class Timings(TypedDict):
    """Seconds spent in each stage of one job."""

    queue_wait_s: float
    #: In the worker's batcher before its batch started (waiting to fill, or behind a running batch).
    batch_wait_s: float
    synthesis_s: float
    #: This job's share of its batch's engine time (``synthesis_s``), apportioned by generated audio
    #: length: what the job cost on the device. 0 for a cache hit.
    device_s: float
    encode_s: float
    upload_s: float
    index_s: float
    #: The whole task body, from the worker picking the job up to the result; the rest of it is
    #: validation, the cache re-check, claim release and URL signing.
    worker_s: float


class StoredAudio(TypedDict):
    """What the cache index remembers about one stored object."""

    object_key: str
    format: str
    content_type: str
    sample_rate: int
    duration_s: float
    bytes: int
    engine: str
    model: str
    model_revision: str
    #: The engine hit the frame cap before its end token: the audio may stop mid-sentence.
    truncated: bool
    #: Request fields the engine could not honour (for example an instruct for espeak).
    ignored: list[str]
    #: Where the word times are stored (``ttsq.keys.words_key``), for a request that asked for them.
    words_key: NotRequired[str]


class JobResult(StoredAudio):
    """The return value of ``ttsq.synthesize``: plain JSON, no audio and no input text."""

    key: str
    url: str
    url_expires_s: int
    cached: bool
    #: How many jobs shared the forward pass (0: answered from the cache).
    batch_size: int
    timings: Timings
    #: Node name of the worker that answered ("" when the producer answered from the cache).
    worker: str
    #: When each word is said, ``{"word", "start", "end"}`` in seconds of the stored audio: only for a
    #: request with ``timestamps`` (docs/timestamps.md).
    words: NotRequired[list[dict[str, Any]]]


def no_timings() -> Timings:
    """All stages zero: a result answered from the cache by the producer."""
    return Timings(
        queue_wait_s=0.0,
        batch_wait_s=0.0,
        synthesis_s=0.0,
        device_s=0.0,
        encode_s=0.0,
        upload_s=0.0,
        index_s=0.0,
        worker_s=0.0,
    )


def _clean_text(name: str, value: Any, max_chars: int, *, required: bool = False) -> str:
    check_characters(name, value)
    text = _WHITESPACE.sub(" ", unicodedata.normalize("NFC", value)).strip()
    if required and not text:
        raise InvalidRequest(name, "is empty")
    if required:
        check_speakable(name, text)
    if len(text) > max_chars:
        raise InvalidRequest(name, f"is {len(text)} characters; the limit is {max_chars}")
    return text


def speakable(text: str) -> bool:
    """Whether ``text`` holds something to speak: a letter, a digit or an ideograph (not only
    punctuation, symbols, emoji or invisible format characters such as zero-width joiners)."""
    return any(unicodedata.category(ch)[0] in "LN" for ch in text)


def check_speakable(name: str, text: str) -> None:
    """Refuse a text with nothing to speak (``speakable``), naming the field."""
    if not speakable(text):
        raise InvalidRequest(name, "has nothing to speak (no letter, digit or ideograph)")


def check_characters(name: str, value: Any) -> None:
    """Refuse a value that is not a string of speakable text: surrogates, control characters other
    than tab and line breaks, bidirectional controls. Raises ``InvalidRequest`` naming ``name``."""
    if not isinstance(value, str):
        raise InvalidRequest(name, f"expected a string, got {type(value).__name__}")
    for ch in value:
        category = unicodedata.category(ch)
        if category == "Cs":
            raise InvalidRequest(name, "is not valid UTF-8")
        if category == "Cc" and ch not in "\t\n\r":
            raise InvalidRequest(name, f"contains control character U+{ord(ch):04X}")
        if ch in _BIDI_CONTROLS:
            raise InvalidRequest(name, f"contains bidirectional control character U+{ord(ch):04X}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(name, f"expected a string, got {type(value).__name__}")
    if value.lower() not in allowed:
        raise InvalidRequest(name, f"unknown value {value[:40]!r}; expected one of {', '.join(allowed)}")
    return value.lower()


def _language(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidRequest("language", f"expected a string, got {type(value).__name__}")
    lowered = value.strip().lower()
    language = _LANGUAGE_ALIASES.get(lowered, lowered)
    if language not in LANGUAGES:
        raise InvalidRequest("language", f"unknown language {value[:40]!r}; expected one of {', '.join(LANGUAGES)}")
    return language


def scheduling(data: Mapping[str, Any]) -> tuple[Lane | None, str]:
    """The ``lane`` and ``tenant`` fields of untrusted input, checked; ``InvalidRequest`` naming the field."""
    lane = data.get("lane")
    if lane is not None:
        lane = _choice("lane", lane, LANES)
    tenant = data.get("tenant", "")
    if not isinstance(tenant, str) or (tenant and not TENANT_PATTERN.fullmatch(tenant)):
        raise InvalidRequest(
            "tenant", "expected a name of 1-64 letters, digits and . _ : @ - (an identifier, never a secret)"
        )
    return cast("Lane | None", lane), tenant


def _timestamps(value: Any) -> Timestamps | None:
    if value is None or value is False:
        return None
    if not isinstance(value, str) or value.lower() not in TIMESTAMPS:
        raise InvalidRequest("timestamps", f"expected false or one of {', '.join(TIMESTAMPS)}, got {str(value)[:40]!r}")
    return cast(Timestamps, value.lower())


def _deadline(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest("deadline", f"expected a UNIX time in seconds, got {type(value).__name__}")
    low, high = _DEADLINE_RANGE
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidRequest("deadline", f"{value} is not a UNIX time in seconds (send time.time() + seconds)")
    return float(value)


def _number(name: str, value: Any, kind: type, low: float, high: float) -> Any:
    if value is None:
        return None
    # bool is an int in Python; "temperature": true is a typo, not 1.0.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(name, f"expected a number, got {type(value).__name__}")
    if kind is int and isinstance(value, float):
        if not value.is_integer():
            raise InvalidRequest(name, f"expected an integer, got {value}")
        value = int(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(name, "must be a finite number")
    if not low <= value <= high:
        raise InvalidRequest(name, f"{value} is out of range [{low}, {high}]")
    return kind(value)
