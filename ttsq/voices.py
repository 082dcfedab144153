"""Reference voices for cloning: uploaded once, named by their content, loaded by ttsq itself.

A reference is a short recording of the voice to clone and, ideally, its transcript. ``add_voice``
(``ttsq voices add FILE --text "..."``) decodes the file (anything libsndfile reads: WAV, FLAC, OGG,
MP3), mixes it to mono, and stores it as 16-bit WAV under ``voices/<sha256>.wav`` with the transcript
beside it in ``voices/<sha256>.json``. The hash covers the WAV bytes and the transcript, so the object
key *is* the voice: a request's ``reference`` names exactly what the model hears, and every cloned
clip's content key changes when the reference does.

Workers read the reference through ttsq's storage and hand the model ``(samples, rate)``. The model
is never given a URL or a user string: qwen-tts would fetch a URL itself, or guess at base64.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import soundfile

from ttsq.audio import decode
from ttsq.errors import InvalidRequest
from ttsq.job import REFERENCE_PATTERN

if TYPE_CHECKING:
    from ttsq.storage import Storage

#: Qwen3-TTS clones from about 3 seconds; past a minute the prompt only costs time and memory.
MIN_REFERENCE_S = 1.0
MAX_REFERENCE_S = 60.0
MAX_TRANSCRIPT_CHARS = 2000
#: A minute of 48 kHz 32-bit stereo is about 23 MiB: anything larger is not a reference recording.
MAX_REFERENCE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class Voice:
    """A reference recording, decoded."""

    key: str
    samples: npt.NDArray[np.float32]
    sample_rate: int
    #: Empty when none was given: the engine then clones from the speaker embedding alone.
    transcript: str


def prepare_voice(data: bytes, transcript: str = "") -> tuple[str, bytes, bytes]:
    """Decode and normalize an uploaded recording: (object key, WAV bytes, metadata JSON bytes)."""
    if len(data) > MAX_REFERENCE_BYTES:
        raise InvalidRequest(
            "file", f"is {len(data) / 2**20:.0f} MiB; a reference must fit in {MAX_REFERENCE_BYTES // 2**20} MiB"
        )
    samples, rate = _decode(data, field="file")
    duration = samples.size / rate
    if not MIN_REFERENCE_S <= duration <= MAX_REFERENCE_S:
        raise InvalidRequest(
            "file", f"is {duration:.1f}s of audio; a reference must last {MIN_REFERENCE_S:.0f}-{MAX_REFERENCE_S:.0f}s"
        )
    if not np.any(np.abs(samples) > 1e-4):
        raise InvalidRequest("file", "is silent")
    transcript = " ".join(transcript.split())
    if len(transcript) > MAX_TRANSCRIPT_CHARS:
        raise InvalidRequest("text", f"is {len(transcript)} characters; the limit is {MAX_TRANSCRIPT_CHARS}")
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    wav = buffer.getvalue()
    digest = hashlib.sha256(wav + b"\0" + transcript.encode("utf-8")).hexdigest()
    meta = json.dumps(
        {"transcript": transcript, "sample_rate": rate, "duration_s": round(duration, 3)},
        ensure_ascii=False,
        sort_keys=True,
    ).encode("utf-8")
    return f"voices/{digest}.wav", wav, meta


def add_voice(storage: Storage, data: bytes, transcript: str = "") -> str:
    """Store a reference recording; return the key to pass as ``reference``. Idempotent."""
    key, wav, meta = prepare_voice(data, transcript)
    # The transcript first: a voice whose audio exists always has its transcript beside it.
    storage.put(_meta_key(key), meta, "application/json")
    storage.put(key, wav, "audio/wav")
    return key


def load_voice(storage: Storage, key: str) -> Voice:
    """Read and decode a stored reference; ``InvalidRequest`` names the field when it is unusable."""
    if not REFERENCE_PATTERN.fullmatch(key):  # nothing else in the bucket is readable through a reference
        raise InvalidRequest("reference", "expected a voice key like voices/<64 hex digits>.wav")
    if not storage.exists(key):
        raise InvalidRequest("reference", f"no voice {key} in storage; upload it with `ttsq voices add`")
    data = storage.get(key)
    if len(data) > MAX_REFERENCE_BYTES:  # not written by voices add: refuse before decoding
        raise InvalidRequest("reference", f"{key} is larger than a reference may be")
    samples, rate = _decode(data, field="reference")
    if samples.size / rate > MAX_REFERENCE_S:
        raise InvalidRequest("reference", f"{key} lasts longer than {MAX_REFERENCE_S:.0f}s")
    transcript = ""
    if storage.exists(_meta_key(key)):
        try:
            transcript = str(json.loads(storage.get(_meta_key(key)))["transcript"])
        except (ValueError, KeyError, TypeError):
            raise InvalidRequest("reference", f"the transcript of {key} is unreadable") from None
    return Voice(key=key, samples=samples, sample_rate=rate, transcript=transcript)


@dataclass(frozen=True)
class VoiceInfo:
    """A stored reference, as listings show it."""

    reference: str
    duration_s: float | None
    sample_rate: int | None
    #: Whether a transcript is stored beside it (the transcript itself is not listed).
    transcript: bool

    def summary(self) -> dict[str, object]:
        return {
            "reference": self.reference,
            "duration_s": self.duration_s,
            "sample_rate": self.sample_rate,
            "transcript": self.transcript,
        }


def list_voices(storage: Storage) -> list[VoiceInfo]:
    """Every stored reference voice, by key."""
    keys = storage.keys("voices/")
    voices = []
    for key in keys:
        if not REFERENCE_PATTERN.fullmatch(key):
            continue
        meta: dict[str, object] = {}
        if _meta_key(key) in keys:
            try:
                loaded = json.loads(storage.get(_meta_key(key)))
                meta = loaded if isinstance(loaded, dict) else {}
            except (ValueError, TypeError):
                meta = {}
        duration, rate = meta.get("duration_s"), meta.get("sample_rate")
        voices.append(
            VoiceInfo(
                reference=key,
                duration_s=float(duration) if isinstance(duration, (int, float)) else None,
                sample_rate=int(rate) if isinstance(rate, int) else None,
                transcript=bool(meta.get("transcript")),
            )
        )
    return voices


def delete_voice(storage: Storage, key: str) -> bool:
    """Remove a stored reference and its transcript; False if there was none."""
    if not REFERENCE_PATTERN.fullmatch(key):
        raise InvalidRequest("reference", "expected a voice key like voices/<64 hex digits>.wav")
    deleted = storage.delete(key)
    storage.delete(_meta_key(key))
    return deleted


def _meta_key(key: str) -> str:
    return key.removesuffix(".wav") + ".json"


def _decode(data: bytes, *, field: str) -> tuple[npt.NDArray[np.float32], int]:
    try:
        samples, rate = decode(data)
    except Exception:  # libsndfile's errors say little more than "unknown format"
        raise InvalidRequest(field, "is not audio that ttsq can read (WAV, FLAC, OGG or MP3)") from None
    if samples.size == 0:
        raise InvalidRequest(field, "holds no audio samples")
    return samples, rate
