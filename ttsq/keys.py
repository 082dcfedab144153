"""The content key: one SHA-256 over everything that shapes the audio.

Two requests with the same key must be allowed to share one stored file, so the key covers the
engine and the exact model revision as well as every request field that changes the sound, and
nothing else (no request id, no time). The recipe is canonical JSON: sorted keys, no whitespace,
UTF-8, with text already NFC-normalized by ``SynthesisRequest``. Python's float repr is the shortest
round-trip form, so the bytes are the same on every Python 3 version and every machine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from ttsq.constants import KEY_SCHEMA_VERSION, POSTPROCESS_VERSION
from ttsq.errors import InvalidRequest

if TYPE_CHECKING:
    from ttsq.request import SynthesisRequest


@dataclass(frozen=True, kw_only=True)
class EngineIdentity:
    """What model renders the audio: part of every content key."""

    engine: str
    model: str
    revision: str
    sample_rate: int
    modes: tuple[str, ...] = ("voice_design",)
    languages: tuple[str, ...] = ()
    #: CustomVoice checkpoints: the speakers it knows (lowercase).
    speakers: tuple[str, ...] = ()
    #: Longest item in codec frames (12.5 per second); 0 when the engine has no such limit.
    max_frames: int = 0
    #: Most UTF-8 bytes of text plus instruct that fit the engine's prompt; 0 when it has no such limit.
    #: Bytes, because the producer has no tokenizer, and a byte-level BPE never makes more tokens than bytes.
    max_prompt_bytes: int = 0

    def check(self, request: SynthesisRequest) -> None:
        """Refuse, naming the field, a request this model cannot serve (mode, language, speaker).

        Producers call it at submit time with the identity the workers announced; workers call it
        again on every message, since a raw ``send_task`` never met a producer.
        """
        if request.mode not in self.modes:
            raise InvalidRequest("mode", f"{request.mode} is not served by the {self.engine} workers "
                                         f"(model {self.model} serves {', '.join(self.modes)})")
        if self.languages and request.language not in self.languages:
            raise InvalidRequest("language", f"{request.language} is not spoken by model {self.model}; "
                                             f"expected one of {', '.join(self.languages)}")
        if request.mode == "custom_voice" and request.speaker.lower() not in self.speakers:
            raise InvalidRequest("speaker", f"unknown speaker {request.speaker[:40]!r} for model {self.model}; "
                                            f"expected one of {', '.join(self.speakers) or '(none)'}")
        if self.max_frames:
            from ttsq.engines.base import FRAMES_PER_SECOND, reading_seconds

            limit_s = self.max_frames / FRAMES_PER_SECOND
            if request.max_new_tokens is not None and request.max_new_tokens > self.max_frames:
                raise InvalidRequest("max_new_tokens", f"{request.max_new_tokens} is above this model's limit "
                                                       f"of {self.max_frames} frames ({limit_s:.0f} s)")
            # Refuse what would certainly be cut (even read fast), instead of returning it truncated.
            if reading_seconds(request.text) / 2 > limit_s:
                raise InvalidRequest("text", f"is about {reading_seconds(request.text) / 2:.0f}-"
                                             f"{reading_seconds(request.text):.0f} s of speech; this model's limit "
                                             f"is {limit_s:.0f} s per job (TTSQ_QWEN_MAX_FRAMES); split it")

        if self.max_prompt_bytes:
            size = len(request.text.encode()) + len(request.instruct.encode())
            if size > self.max_prompt_bytes:
                raise InvalidRequest("text", f"with its instruct is {size} bytes of UTF-8; the {self.engine} "
                                             f"workers take at most {self.max_prompt_bytes}; split it")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON, as workers publish it in Redis."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineIdentity:
        """The identity a worker published."""
        return cls(engine=data["engine"], model=data["model"], revision=data["revision"],
                   sample_rate=int(data["sample_rate"]), modes=tuple(data.get("modes", ())),
                   languages=tuple(data.get("languages", ())), speakers=tuple(data.get("speakers", ())),
                   max_frames=int(data.get("max_frames", 0)), max_prompt_bytes=int(data.get("max_prompt_bytes", 0)))


#: File extension per output format.
EXTENSIONS = {"wav": "wav", "flac": "flac", "ogg": "ogg", "mp3": "mp3"}


def canonical_json(value: Any) -> bytes:
    """The one serialization that keys are computed over."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode("utf-8")


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
    # When the audio is wanted does not change how it sounds: the same audio serves any deadline.
    del material["deadline"]
    return hashlib.sha256(canonical_json(material)).hexdigest()


def object_key(key: str, audio_format: str) -> str:
    """Where the audio for a content key lives in storage (fanned out by the first two hex digits)."""
    return f"audio/{key[:2]}/{key}.{EXTENSIONS[audio_format]}"
