"""Named voices: a voice a user keeps under a name, as the request fields that make it.

A named voice (``POST /v1/audio/voices``, ``ttsq voices named add``) holds a mode and the fields that
make its voice: for ``voice_design`` a description (``instruct``), a ``language`` and a ``seed`` (one is
drawn when none is given, so the voice is fixed from the start); for ``custom_voice`` a ``speaker``; for
``voice_clone`` a ``reference``. ``voice: "narrator-kim"`` on the speech route fills those fields in, and
on qwen-fast, whose seeded rows do not depend on their batch, the same fields are the same voice.

A named voice is content, not identity: the content key is computed from the fields it resolves to,
never from its name, so two names with the same fields share their cached audio and renaming a voice
changes nothing that was made with it.

All of them live in one hash in the cache database (``NAMED_VOICES_KEY``: name -> JSON record), so a
create is one ``HSETNX`` (an existing name is refused, never overwritten) and a listing one ``HGETALL``.
Names are 1-40 characters of ``a-z 0-9 _ -``, starting with a letter or digit, and case-insensitive
(stored lower-cased). A record read back is as untrusted as a request: one that is not what ttsq writes
is a ``CorruptRecord`` naming the voice and the field.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from ttsq.constants import NAMED_VOICES_KEY
from ttsq.errors import CorruptRecord, InvalidRequest
from ttsq.job import Limits, SynthesisRequest
from ttsq.records.connection import address, patiently

if TYPE_CHECKING:
    import redis

T = TypeVar("T")

#: What a name may be (after lower-casing): short, and safe in a URL path, a shell and a log line.
NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9_-]{0,39}")
#: The fields a named voice holds beside its name, and what each defaults to when left out.
VOICE_FIELDS = ("mode", "instruct", "language", "seed", "speaker", "reference")
#: The modes a named voice may have: every mode (voice_clone names a stored reference).
VOICE_MODES = ("voice_design", "custom_voice", "voice_clone")
#: Most named voices kept at once: each is a few hundred bytes of Redis, and the listing reads them all.
MAX_NAMED_VOICES = 1000
#: The longest description a record read back may hold: the most ``TTSQ_MAX_INSTRUCT_CHARS`` may be (the
#: setting itself is checked when a voice is created, and again when a request uses it).
_STORED_INSTRUCT_CHARS = 100_000
#: What a stored record holds, exactly.
_RECORD_KEYS = frozenset({"name", *VOICE_FIELDS, "created_at"})
#: A seed drawn for a voice created without one (within every engine's seed range).
_DRAWN_SEED_BELOW = 2**31


def check_name(value: Any, field: str = "name") -> str:
    """A voice's name, lower-cased; ``InvalidRequest`` naming ``field`` when it is not one."""
    if not isinstance(value, str):
        raise InvalidRequest(field, f"expected a string, got {type(value).__name__}")
    name = value.strip().lower()
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidRequest(
            field,
            f"{value[:60]!r} is not a voice name: 1-40 characters of a-z, 0-9, _ and -, "
            "starting with a letter or digit",
        )
    return name


@dataclass(frozen=True)
class NamedVoice:
    """A named voice: the request fields it stands for."""

    name: str
    mode: str
    instruct: str
    language: str
    seed: int
    speaker: str
    reference: str
    created_at: float

    @classmethod
    def create(cls, data: Any, *, limits: Limits | None = None) -> NamedVoice:
        """A new voice from an untrusted body (``name`` and ``VOICE_FIELDS``); ``InvalidRequest`` naming the
        field at fault. A voice without a ``seed`` gets one drawn now."""
        if not isinstance(data, Mapping):
            raise InvalidRequest("body", "expected a JSON object: name, instruct, language, seed, mode, speaker")
        for field in data:
            if field == "instructions":
                raise InvalidRequest("instructions", "is instruct here: the voice, described in words")
            if field not in ("name", *VOICE_FIELDS):
                raise InvalidRequest(str(field)[:40], f"unknown field; expected name, {', '.join(VOICE_FIELDS)}")
        if "name" not in data:
            raise InvalidRequest("name", "is required: the name requests will use as their voice")
        fields = {field: data[field] for field in VOICE_FIELDS if data.get(field) is not None}
        fields.setdefault("seed", secrets.randbelow(_DRAWN_SEED_BELOW))
        return cls._checked(check_name(data["name"]), fields, time.time(), limits or Limits())

    @classmethod
    def from_record(cls, name: str, raw: str) -> NamedVoice:
        """A record as read back from Redis; ``CorruptRecord`` naming the voice and the field otherwise."""
        label = f"named voice {name[:60]!r}"
        try:
            record = json.loads(raw)
        except ValueError:
            raise CorruptRecord(label, "is not JSON") from None
        if not isinstance(record, dict):
            raise CorruptRecord(label, "is not a JSON object")
        if set(record) != _RECORD_KEYS:
            raise CorruptRecord(label, f"holds {sorted(record)[:12]}, not {sorted(_RECORD_KEYS)}")
        created_at = record["created_at"]
        if isinstance(created_at, bool) or not isinstance(created_at, (int, float)) or created_at < 0:
            raise CorruptRecord(f"{label} created_at", "is not a time")
        if record["name"] != name:
            raise CorruptRecord(f"{label} name", "differs from the name it is stored under")
        if not isinstance(record["seed"], int) or isinstance(record["seed"], bool):
            raise CorruptRecord(f"{label} seed", "is not an integer")
        try:
            return cls._checked(
                check_name(name),
                {field: record[field] for field in VOICE_FIELDS},
                float(created_at),
                Limits(max_instruct_chars=_STORED_INSTRUCT_CHARS),
            )
        except InvalidRequest as exc:
            raise CorruptRecord(f"{label} {exc.field}", exc.reason) from None

    @classmethod
    def _checked(cls, name: str, fields: dict[str, Any], created_at: float, limits: Limits) -> NamedVoice:
        """The voice's fields checked as a request's are (``SynthesisRequest.from_dict``), and normalized."""
        mode = fields.get("mode", "voice_design")
        if isinstance(mode, str) and mode.lower() not in VOICE_MODES:
            raise InvalidRequest("mode", f"expected one of {', '.join(VOICE_MODES)}")
        request = SynthesisRequest.from_dict({**fields, "text": "x"}, limits)
        if request.mode == "voice_design" and not request.instruct:
            raise InvalidRequest("instruct", "is required for a voice_design voice: the voice, described in words")
        if request.seed is None:  # ``create`` draws one; a record read back has one
            raise InvalidRequest("seed", "is required")
        return cls(
            name=name,
            mode=request.mode,
            instruct=request.instruct,
            language=request.language,
            seed=request.seed,
            speaker=request.speaker,
            reference=request.reference,
            created_at=created_at,
        )

    def fields(self) -> dict[str, Any]:
        """The request fields the voice stands for (``mode`` among them), those it leaves empty left out."""
        fields: dict[str, Any] = {"mode": self.mode, "language": self.language, "seed": self.seed}
        for name in ("instruct", "speaker", "reference"):
            if getattr(self, name):
                fields[name] = getattr(self, name)
        return fields

    def record(self) -> str:
        """The JSON stored for it."""
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    def summary(self) -> dict[str, Any]:
        """As listings show it: OpenAI's voice object, with the fields it stands for."""
        return {
            "id": self.name,
            "object": "audio.voice",
            "name": self.name,
            "type": "named",
            "created_at": int(self.created_at),
            **self.fields(),
        }


class NamedVoices:
    """The named voices, in the cache database."""

    def __init__(self, client: redis.Redis, *, patience_s: float = 0.0) -> None:
        self.url = address(client)
        self.patience_s = patience_s
        self._redis = client

    def add(self, voice: NamedVoice) -> bool:
        """Keep ``voice``; False, and nothing written, when its name is taken (delete it first to change
        it). ``InvalidRequest`` when ``MAX_NAMED_VOICES`` are kept already."""
        if self._do(lambda: self._redis.hlen(NAMED_VOICES_KEY)) >= MAX_NAMED_VOICES:
            raise InvalidRequest("name", f"{MAX_NAMED_VOICES} named voices are kept already; delete one first")
        return bool(self._do(lambda: self._redis.hsetnx(NAMED_VOICES_KEY, voice.name, voice.record())))

    def get(self, name: str) -> NamedVoice | None:
        """The voice called ``name`` (``InvalidRequest`` for a name no voice may have), or None."""
        name = check_name(name)
        raw = self._do(lambda: self._redis.hget(NAMED_VOICES_KEY, name))
        return None if raw is None else NamedVoice.from_record(name, _text(raw))

    def find(self, voice: str) -> NamedVoice | None:
        """The voice a request's ``voice`` names, or None when it names none (or could not be a name):
        the speech route asks this first, for every ``voice`` that could be one."""
        name = voice.strip().lower()
        if not NAME_PATTERN.fullmatch(name):
            return None
        return self.get(name)

    def list(self) -> dict[str, NamedVoice | CorruptRecord]:
        """Every voice by name, in name order; a record that is not what ttsq writes is listed as its
        ``CorruptRecord``, so one bad record neither hides nor blocks the others (and can be deleted)."""
        raw = {
            _text(name): _text(record)
            for name, record in self._do(lambda: self._redis.hgetall(NAMED_VOICES_KEY)).items()
        }
        voices: dict[str, NamedVoice | CorruptRecord] = {}
        for name in sorted(raw):
            try:
                voices[name] = NamedVoice.from_record(name, raw[name])
            except CorruptRecord as exc:
                voices[name] = exc
        return voices

    def delete(self, name: str) -> bool:
        """Remove the voice called ``name``; False if there was none. A record stored under a name no voice
        may have (a corrupt one, listed as such) is removed by that name as it is listed."""
        try:
            stored = check_name(name)
        except InvalidRequest:
            if not self._do(lambda: self._redis.hexists(NAMED_VOICES_KEY, name)):
                raise
            stored = name
        return bool(self._do(lambda: self._redis.hdel(NAMED_VOICES_KEY, stored)))

    def _do(self, call: Callable[[], T]) -> T:
        return patiently(call, self.url, self.patience_s)


def _text(value: str | bytes) -> str:
    """A value as read back (the owner's clients answer ``str``; a byte that is not UTF-8 reads as U+FFFD)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value
