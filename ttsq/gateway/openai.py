"""OpenAI's speech API (``POST /v1/audio/speech``) in ttsq's terms: which job a request is, and how its
audio goes back.

Existing OpenAI client code runs unchanged: OpenAI's model and voice names map onto the fleet's modes and
speakers (a voice the mode lacks is ignored and reported, not refused), ttsq's own request fields ride
along as extra body fields, and what ttsq cannot do (``aac``, a ``speed`` other than 1.0) is refused
naming the field. A ``voice`` that names a named voice (``ttsq.records.named_voices``) fills in the fields
it stands for, where the request leaves them out. Every field: docs/gateway.md, "With OpenAI's client,
unchanged".

Clients written for other Qwen3-TTS servers run unchanged too: the extension fields vLLM-Omni and
SGLang-Omni document for their speech endpoint (``PEER_FIELDS``) are accepted, honoured where they mean
something here (``stream``, ``task_type``, a stored reference in ``ref_audio``) and otherwise reported in
``X-TTSQ-Ignored``, never refused for being there. OpenAI's own fields stay as strict as OpenAI's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ttsq.app import queue_for
from ttsq.audio import decode, resample
from ttsq.errors import InvalidRequest
from ttsq.gateway.encoders import stream_from_worker
from ttsq.job import MODES, REFERENCE_PATTERN, Limits, SynthesisRequest

if TYPE_CHECKING:
    from ttsq.engines.base import EngineIdentity
    from ttsq.records.named_voices import NamedVoice

#: How the speech route finds a named voice by a request's ``voice`` (``NamedVoices.find``).
FindVoice = Callable[[str], "NamedVoice | None"]

#: OpenAI's model names: the fleet's default mode.
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")
#: OpenAI's built-in voices: ignored (and reported) where the mode has no speaker of that name.
OPENAI_VOICES = (
    "alloy",
    "ash",
    "ballad",
    "coral",
    "echo",
    "fable",
    "onyx",
    "nova",
    "sage",
    "shimmer",
    "verse",
    "marin",
    "cedar",
)
#: response_format -> (the format ttsq stores, the content type sent back).
FORMATS: dict[str, tuple[str, str]] = {
    "mp3": ("mp3", "audio/mpeg"),
    "opus": ("ogg", "audio/ogg"),
    "flac": ("flac", "audio/flac"),
    "wav": ("wav", "audio/wav"),
    "pcm": ("wav", "audio/pcm"),
}
#: OpenAI's pcm: 16-bit signed little-endian mono at this rate.
PCM_RATE = 24_000
#: OpenAI's stream_format: the audio itself, or server-sent events carrying it.
STREAM_FORMATS = ("audio", "sse")
_OPENAI_FIELDS = {"model", "input", "voice", "instructions", "response_format", "speed", "stream_format"}
#: The extension fields of other Qwen3-TTS servers' ``/v1/audio/speech`` (vLLM-Omni's
#: ``OpenAICreateSpeechRequest``, SGLang-Omni's ``CreateSpeechRequest``) that ttsq's own request fields do
#: not already spell the same way (``language``, ``max_new_tokens``, ``speaker``, the sampling fields),
#: with the JSON type each must have: a value of another type is refused naming the field, ``null`` is
#: the field left out. ``stream`` is ttsq's own field too; the speech route honours it.
PEER_FIELDS: dict[str, type] = {
    "task_type": str,
    "non_streaming_mode": bool,
    "ref_audio": str,
    "ref_text": str,
    "x_vector_only_mode": bool,
    "sample_rate": int,
    "initial_codec_chunk_frames": int,
    "references": list,
    "token_count": int,
    "duration_tokens": int,
    "stage_params": dict,
}
#: The header that asks the speech route to queue the job and wait when no worker has announced itself
#: (``unserved``), as a job of the jobs API always does.
WAIT_FOR_WORKER_HEADER = "X-TTSQ-Wait-For-Worker"
#: ``task_type`` (Qwen3-TTS's names for its three checkpoints) -> ttsq's mode.
TASK_TYPES = {"voicedesign": "voice_design", "customvoice": "custom_voice", "base": "voice_clone"}
_DATED_MODEL = re.compile(r"gpt-4o(-mini)?-tts(-\d{4}-\d{2}-\d{2})?")


@dataclass(frozen=True)
class Speech:
    """One speech request, as a ttsq job and a way to answer it."""

    text: str
    #: ttsq request fields (mode, language, instruct, speaker, reference, format, sampling).
    fields: dict[str, Any]
    response_format: str
    content_type: str
    stream_format: str
    #: Request fields the gateway could not honour (an OpenAI voice name, a peer's extension field),
    #: reported with the result's own.
    ignored: tuple[str, ...]
    #: ``stream`` as sent (vLLM-Omni's and SGLang-Omni's flag): False asks for the whole clip once it is
    #: made; None (absent) and True stream wherever the format allows (``Speech.streamed``).
    stream: bool | None = None

    @property
    def streamed(self) -> bool:
        """Whether the audio is sent as the worker makes it: a job streams, and so does a document (chunk
        by chunk), unless the request said ``stream: false``; flac is sent from the stored file."""
        return stream_from_worker(self.response_format) and self.stream is not False

    def headers(self) -> dict[str, str]:
        """What the answer's headers say of its audio: ``pcm`` is headerless, so its rate rides along in
        ``X-Sample-Rate``, which clients of other Qwen3-TTS servers read."""
        return {"X-Sample-Rate": str(PCM_RATE)} if self.response_format == "pcm" else {}


def check(body: Any) -> Mapping[str, Any]:
    """The checks of a speech request that need no fleet: the body's shape and OpenAI's own fields (a model
    or voice name is resolved against the fleet by ``parse``, ttsq's fields by ``SynthesisRequest.from_dict``
    once the voice is placed). ``InvalidRequest`` naming the field; the body, unchanged, otherwise."""
    if not isinstance(body, Mapping):
        raise InvalidRequest("body", "expected a JSON object")
    if not isinstance(body.get("input"), str):
        raise InvalidRequest("input", "is required: the text to speak")
    if not body["input"].strip():  # OpenAI's name for it, not ttsq's `text`
        raise InvalidRequest("input", "is empty: the text to speak")
    mode, model = body.get("mode"), body.get("model")
    if mode is not None and (not isinstance(mode, str) or mode not in MODES):
        raise InvalidRequest("mode", f"expected one of {', '.join(MODES)}")
    if mode is None and (not isinstance(model, str) or not model):
        raise InvalidRequest("model", "is required")
    for ttsq_name, openai_name in (("format", "response_format"), ("text", "input")):
        if ttsq_name in body:
            raise InvalidRequest(ttsq_name, f"is {openai_name} in OpenAI's speech API")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("instructions", f"expected a string, got {type(instructions).__name__}")
    voice = _voice_name(body.get("voice"))
    if voice is not None and not isinstance(voice, str):
        raise InvalidRequest("voice", f"expected a string, got {type(voice).__name__}")
    if isinstance(voice, str) and not voice.strip():
        raise InvalidRequest(
            "voice",
            "is empty: name a named voice or a speaker (GET /v1/audio/voices), a stored voice "
            "(voices/<sha256>.wav), or one of OpenAI's voice names (alloy: ignored where the fleet has no such "
            "speaker), or leave it out where your client allows",
        )
    response_format = body.get("response_format", "mp3")
    if response_format == "aac":
        raise InvalidRequest("response_format", "aac is not produced by ttsq; use mp3, opus, flac, wav or pcm")
    if not isinstance(response_format, str) or response_format not in FORMATS:
        raise InvalidRequest("response_format", f"expected one of {', '.join(FORMATS)}")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not math.isfinite(speed):
        raise InvalidRequest("speed", "expected a number")
    if speed != 1.0:
        raise InvalidRequest("speed", f"{speed} cannot be applied: ttsq speaks at the model's own pace (1.0)")
    if body.get("stream_format", "audio") not in STREAM_FORMATS:
        raise InvalidRequest("stream_format", "expected audio or sse")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise InvalidRequest("stream", f"expected true or false, got {type(stream).__name__}")
    for name, expected in PEER_FIELDS.items():
        value = body.get(name)
        if value is not None and type(value) is not expected:  # JSON's types exactly: true is no int here
            raise InvalidRequest(name, f"expected {expected.__name__}, got {type(value).__name__}")
    task_type = body.get("task_type")
    if task_type is not None and _task_mode(task_type) is None:
        raise InvalidRequest("task_type", "expected VoiceDesign, CustomVoice or Base")
    return body


def parse(body: Any, fleet: Mapping[str, EngineIdentity], find: FindVoice | None = None) -> Speech:
    """An OpenAI speech request body as a ttsq job; ``InvalidRequest`` naming the field otherwise.
    ``find`` looks a ``voice`` up among the named voices (none are looked up without it)."""
    check(body)
    ignored: list[str] = []
    body = _peer_fields(body, ignored)
    mode = _mode(body.get("model"), body.get("mode"), fleet)
    extra = {name: value for name, value in body.items() if name not in _OPENAI_FIELDS}
    fields: dict[str, Any] = {**extra, "mode": mode}
    if body.get("instructions") is not None:
        fields["instruct"] = body["instructions"]
    voice = _voice_name(body.get("voice"))
    named = find(voice) if find is not None and isinstance(voice, str) else None
    if named is not None:
        fields["mode"] = _named(named, body.get("mode"), fields)
    else:
        fields["mode"] = _voice(voice, mode, fields, fleet, ignored)
    response_format = body.get("response_format", "mp3")
    fields["format"], content_type = FORMATS[response_format]
    if body.get("stream") is True and not stream_from_worker(response_format):
        ignored.append("stream")
    return Speech(
        text=body["input"],
        fields=fields,
        response_format=response_format,
        content_type=content_type,
        stream_format=body.get("stream_format", "audio"),
        ignored=tuple(ignored),
        stream=body.get("stream"),
    )


def unserved(
    speech: Speech, fleet: Mapping[str, EngineIdentity], queue: str, headers: Mapping[str, str], limits: Limits
) -> str | None:
    """Why the speech route should answer 503 at once instead of waiting for audio no one will make: no
    worker of the deployment has announced itself (``Client.identities``: none heard from within
    ``IDENTITY_MAX_AGE_S``, so a worker that is restarting still counts), and the request did not ask to
    wait (``WAIT_FOR_WORKER_HEADER``). None when it should go on. A wrong field is still the 400 naming
    it (``InvalidRequest``), checked first as ``Client.submit`` would: the fleet is the last question."""
    if fleet or headers.get(WAIT_FOR_WORKER_HEADER, "").strip().lower() in ("1", "true", "yes"):
        return None
    text = speech.text if len(speech.text) <= limits.max_text_chars else "x"  # a document: its fields only
    fields = {name: value for name, value in speech.fields.items() if name != "options"}  # a document's
    SynthesisRequest.from_dict({**fields, "text": text}, limits)
    mode = str(speech.fields.get("mode", "voice_design"))
    return (
        f"no worker serves {mode} on queue {queue_for(queue, mode)}: none has announced itself. Start one "
        f"(ttsq worker), or everything at once (ttsq serve --embedded); {WAIT_FOR_WORKER_HEADER}: true queues "
        "the job and waits for one"
    )


def _task_mode(task_type: str) -> str | None:
    """ttsq's mode for a ``task_type`` (``VoiceDesign``, ``voice_design``, ``Base``...), None if none."""
    return TASK_TYPES.get(task_type.replace("_", "").replace("-", "").lower())


def _peer_fields(body: Mapping[str, Any], ignored: list[str]) -> dict[str, Any]:
    """The body with the peers' extension fields taken out: what means something here becomes ttsq's own
    field (``task_type`` the mode, a stored voice in ``ref_audio`` the reference, where the request does
    not say them itself), the rest is appended to ``ignored``. ``null`` is the field left out."""
    rest = {name: value for name, value in body.items() if name not in PEER_FIELDS}
    if rest.get("stream") is None:
        rest.pop("stream", None)
    peers = {name: body[name] for name in PEER_FIELDS if body.get(name) is not None}
    task_type, ref_audio = peers.pop("task_type", None), peers.pop("ref_audio", None)
    if task_type is not None and rest.get("mode") is None:
        rest["mode"] = _task_mode(task_type)
    elif task_type is not None:
        ignored.append("task_type")  # the request's own mode wins
    if ref_audio is not None and REFERENCE_PATTERN.fullmatch(ref_audio) and "reference" not in rest:
        rest["reference"] = ref_audio
        rest.setdefault("mode", "voice_clone")
    elif ref_audio is not None:
        ignored.append("ref_audio")  # a URL, a data: URI or a path: ttsq clones only stored voices
    if peers.get("sample_rate") == PCM_RATE:
        peers.pop("sample_rate")  # what is sent anyway
    ignored.extend(peers)
    return rest


def _mode(model: Any, mode: Any, fleet: Mapping[str, EngineIdentity]) -> str:
    """The mode a checked request asks for: ``mode`` when given, else what ``model`` means here."""
    if mode is not None:
        return str(mode)
    if model in MODES:
        return str(model)
    served = {identity.model for identity in fleet.values()}
    if model in OPENAI_MODELS or _DATED_MODEL.fullmatch(model) or model == "ttsq" or model in served:
        return default_mode(fleet)
    raise InvalidRequest(
        "model",
        f"unknown model {model[:40]!r}; expected {', '.join(OPENAI_MODELS)}, a mode "
        f"({', '.join(MODES)}) or a model the fleet serves",
    )


def default_mode(fleet: Mapping[str, EngineIdentity]) -> str:
    """The mode an OpenAI model name means: voice_design where it is served (or nothing is announced yet),
    else the one mode the fleet serves first."""
    if not fleet or "voice_design" in fleet:
        return "voice_design"
    return sorted(fleet)[0]


def _named(voice: NamedVoice, mode: Any, fields: dict[str, Any]) -> str:
    """Fill in what a named voice stands for where the request left it out (a field the request sends wins);
    return the voice's mode. An explicit ``mode`` must be the voice's: any other would not be this voice."""
    if mode is not None and mode != voice.mode:
        raise InvalidRequest("mode", f"{mode} is not the mode of voice {voice.name!r} ({voice.mode}); leave mode out")
    for name, value in voice.fields().items():
        fields.setdefault(name, value)
    return voice.mode


def _voice(
    voice: Any, mode: str, fields: dict[str, Any], fleet: Mapping[str, EngineIdentity], ignored: list[str]
) -> str:
    """Place a checked ``voice`` in the request; return the mode it implies."""
    if voice is None or voice == "":
        return mode
    if REFERENCE_PATTERN.fullmatch(voice):
        fields["reference"] = voice
        return "voice_clone"
    speakers = {speaker for identity in fleet.values() for speaker in identity.speakers}
    if voice.lower() in speakers:
        fields["speaker"] = voice
        return "custom_voice"
    if voice.lower() in OPENAI_VOICES:
        ignored.append("voice")
        custom = fleet.get("custom_voice")
        if mode == "custom_voice" and custom is not None and custom.speakers:
            fields["speaker"] = custom.speakers[0]  # the model's first speaker stands in
        return mode
    if mode == "custom_voice":
        fields["speaker"] = voice  # checked against the model's speakers at submit
        return mode
    raise InvalidRequest(
        "voice",
        f"unknown voice {voice[:40]!r}: a named voice (POST /v1/audio/voices), a speaker of the fleet's "
        "CustomVoice model, a reference from `ttsq voices add`, or one of OpenAI's voice names",
    )


def _voice_name(voice: Any) -> Any:
    """``voice`` as sent: a name, or OpenAI's custom voice object ``{"id": ...}``."""
    return voice.get("id") if isinstance(voice, Mapping) else voice


def pcm(wav: bytes) -> bytes:
    """A stored WAV as OpenAI's ``pcm``: 16-bit signed little-endian mono samples at 24 kHz."""
    samples, rate = decode(wav)
    samples = resample(samples, rate, PCM_RATE)
    return (np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
