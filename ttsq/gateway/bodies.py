"""The bodies of the gateway's API, declared: what ``/openapi.json`` shows each route takes (and its errors).

Pydantic declares the fields here and checks none of their values (``SkipValidation``): each model's
validator hands the body to ttsq's one validation point (``SynthesisRequest.from_dict``, and
``openai.check`` for OpenAI's own fields), so a wrong field is the same ``InvalidRequest`` naming it as
from ``ttsq submit``, and the gateway answers it in OpenAI's error shape. ``InvalidRequest`` is not a
``ValueError``: pydantic lets it through to the gateway's handler unchanged. What needs the settings or
the fleet (text lengths, where a long text becomes a document, model names, speakers) is checked where
the job is submitted, on a thread.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import UploadFile
from pydantic import BaseModel, ConfigDict, Field, SkipValidation, model_validator
from pydantic_core import PydanticCustomError

from ttsq.document import Options
from ttsq.errors import InvalidRequest
from ttsq.gateway import openai
from ttsq.job import LANGUAGES, AudioFormat, Mode, SynthesisRequest
from ttsq.records.named_voices import MAX_NAMED_VOICES, NamedVoice

#: Most requests one batch submit takes.
MAX_BATCH_REQUESTS = 100
# Checked at submit, on a thread, against the settings' limits: on the event loop, the character checks of
# a megabyte of text would stall every other request for a quarter of a second.
_FREE_TEXTS = ("text", "instruct")
_PEER = "vLLM-Omni's and SGLang-Omni's field."
_IGNORED = "Accepted, and reported in X-TTSQ-Ignored."
_MODES = "voice_design: a voice described in `instruct`; custom_voice: a `speaker`; voice_clone: a `reference`."


def decoded(data: Any) -> Any:
    """A body FastAPI left as bytes (sent without a JSON content type, which the gateway never required),
    as JSON; a ``json_invalid`` error, as FastAPI's own JSON decoding raises, if it is not JSON."""
    if not isinstance(data, bytes):
        return data
    try:
        return json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than Python recurses
        raise PydanticCustomError("json_invalid", "the body is not JSON") from None


class _RequestFields(BaseModel):
    """ttsq's request fields beside the text (``Client.submit``'s keyword arguments)."""

    model_config = ConfigDict(extra="forbid")

    language: SkipValidation[str] = Field(
        "auto", description=f"One of {', '.join(LANGUAGES)}, or a code such as ko, en, ja."
    )
    instruct: SkipValidation[str] = Field(
        "", description="voice_design: the voice, described in words; otherwise how to speak."
    )
    speaker: SkipValidation[str] = Field("", description="custom_voice: a speaker of the fleet's model.")
    reference: SkipValidation[str] = Field(
        "", description="voice_clone: a stored voice, `voices/<sha256>.wav` (`POST /v1/voices`)."
    )
    seed: SkipValidation[int | None] = None
    temperature: SkipValidation[float | None] = None
    top_p: SkipValidation[float | None] = None
    top_k: SkipValidation[int | None] = None
    repetition_penalty: SkipValidation[float | None] = None
    max_new_tokens: SkipValidation[int | None] = Field(
        None, description="Most codec frames to generate; absent: derived from the text's length."
    )
    deadline: SkipValidation[float | None] = Field(
        None, description="UNIX time (seconds) after which the job is dropped, not run late. Not for documents."
    )
    options: SkipValidation[Options | None] = Field(
        None, description="A text longer than one job is a document: how it is cut and joined."
    )
    lane: SkipValidation[str | None] = Field(
        None,
        description="interactive or bulk (docs/scheduling.md); absent: the API key's lane, else interactive for a "
        "job and bulk for a document.",
    )
    tenant: SkipValidation[str] = Field(
        "",
        description="Whose work this is, for fair shares. With API keys it is the key's id, and may be left out.",
    )
    timestamps: SkipValidation[str | bool | None] = Field(
        None,
        description='"word": the result also says when each word is said (`words`), and '
        "`GET /v1/jobs/{id}/captions.srt` or `.vtt` serves captions (docs/timestamps.md).",
    )
    stream: SkipValidation[bool] = Field(
        False,
        description="Also write the audio to the job's Redis stream as it is made (docs/streaming.md). The speech "
        "route streams wherever the format allows unless it is false (as vLLM-Omni's and SGLang-Omni's flag).",
    )

    def fields(self) -> dict[str, Any]:
        """The fields the body holds, with their values as sent (nothing pydantic converted)."""
        return {name: getattr(self, name) for name in self.model_fields_set}


def _check_job(data: Any) -> Any:
    """A job's body, by ``SynthesisRequest.from_dict`` (``InvalidRequest`` naming the field)."""
    if not isinstance(data, Mapping):
        raise InvalidRequest("body", "expected a JSON object of request fields")
    text = data.get("text")
    if not isinstance(text, str):
        raise InvalidRequest("text", "is required" if text is None else f"expected a string, got {type(text).__name__}")
    # The options are a document's (``Document.parse``): whether the text is one is the settings' to say.
    others = {name: value for name, value in data.items() if name not in (*_FREE_TEXTS, "options")}
    SynthesisRequest.from_dict({**others, "text": "x"})  # a stand-in, as ``Document.parse`` checks fields
    return data


class JobRequest(_RequestFields):
    """One job (``POST /v1/jobs``, and each of a batch's ``requests``)."""

    text: SkipValidation[str] = Field(
        description="The text to speak. Longer than one job may be (`TTSQ_MAX_TEXT_CHARS`), it is a document."
    )
    mode: SkipValidation[Mode] = Field("voice_design", description=_MODES)
    format: SkipValidation[AudioFormat] = Field("wav", description="The stored audio's format.")

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        return _check_job(decoded(data))


class BatchRequest(BaseModel):
    """Jobs submitted at once (``POST /v1/jobs/batch``); each is answered, or refused, on its own."""

    requests: SkipValidation[list[JobRequest]] = Field(description=f"1..{MAX_BATCH_REQUESTS} jobs.")

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        # Only the list: a wrong job is that job's answer, not the batch's (the route checks each).
        data = decoded(data)
        requests = data.get("requests") if isinstance(data, Mapping) else None
        if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_BATCH_REQUESTS:
            raise InvalidRequest("requests", f"must be a list of 1..{MAX_BATCH_REQUESTS} job requests")
        return data


class GenerateRequest(JobRequest):
    """The design documents' ``POST /generate``: ``instruction`` is ``instruct``, the language korean."""

    language: SkipValidation[str] = Field("korean", description=_RequestFields.model_fields["language"].description)
    instruction: SkipValidation[str] = Field("", description="The job's `instruct`.")

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        data = decoded(data)
        if not isinstance(data, Mapping):
            raise InvalidRequest("body", "expected a JSON object")
        _check_job(_as_job(data))
        return data

    def job_fields(self) -> dict[str, Any]:
        """The job's fields, ``text`` among them."""
        return _as_job(self.fields())


def _as_job(body: Mapping[str, Any]) -> dict[str, Any]:
    fields = {name: value for name, value in body.items() if name != "instruction"}
    fields.setdefault("language", "korean")
    if "instruction" in body:
        fields["instruct"] = body["instruction"]
    return fields


class VoiceId(BaseModel):
    """OpenAI's custom voice object."""

    id: str


class SpeechRequest(_RequestFields):
    """OpenAI's speech request (``audio.speech.create``); ttsq's request fields may ride along (OpenAI's
    SDK: ``extra_body``)."""

    model: SkipValidation[str | None] = Field(
        None,
        description=f"{', '.join(openai.OPENAI_MODELS)}: the fleet's default mode; a mode's name; or a model "
        "the fleet serves. Required unless `mode` is given.",
    )
    input: SkipValidation[str] = Field(description="The text to speak.")
    voice: SkipValidation[str | VoiceId | None] = Field(
        None,
        description="A named voice (`POST /v1/audio/voices`: it fills in the fields it stands for that the request "
        "leaves out), a speaker of the fleet's CustomVoice model, a stored voice (`voices/<sha256>.wav`), or one "
        "of OpenAI's voice names (ignored where the fleet has no such speaker, and said so in X-TTSQ-Ignored).",
    )
    instructions: SkipValidation[str | None] = Field(
        None, description="voice_design: the voice, described in words; otherwise how to speak."
    )
    response_format: SkipValidation[str] = Field(
        "mp3",
        description="pcm: raw 16-bit little-endian mono at 24 kHz. aac is refused: no encoder ttsq ships writes it.",
        json_schema_extra={"enum": list(openai.FORMATS)},
    )
    speed: SkipValidation[float] = Field(1.0, description="1.0 only: ttsq speaks at the model's own pace.")
    stream_format: SkipValidation[str] = Field(
        "audio",
        description="sse: the audio in `speech.audio.delta` events, then `speech.audio.done`.",
        json_schema_extra={"enum": list(openai.STREAM_FORMATS)},
    )
    mode: SkipValidation[Mode | None] = Field(None, description=f"{_MODES} Absent: what `model` and `voice` imply.")
    # Other Qwen3-TTS servers' extension fields (vLLM-Omni, SGLang-Omni): their clients run unchanged.
    task_type: SkipValidation[str | None] = Field(
        None, description=f"{_PEER} VoiceDesign, CustomVoice or Base: the mode, where `mode` is not given."
    )
    ref_audio: SkipValidation[str | None] = Field(
        None, description=f"{_PEER} A stored voice (`voices/<sha256>.wav`) is the `reference`; a URL is ignored."
    )
    non_streaming_mode: SkipValidation[bool | None] = Field(None, description=f"{_PEER} {_IGNORED}")
    ref_text: SkipValidation[str | None] = Field(
        None, description=f"{_PEER} {_IGNORED} A stored voice keeps its transcript (`POST /v1/voices`)."
    )
    x_vector_only_mode: SkipValidation[bool | None] = Field(None, description=f"{_PEER} {_IGNORED}")
    sample_rate: SkipValidation[int | None] = Field(
        None, description=f"{_PEER} pcm is 24000 Hz (`X-Sample-Rate`); another rate is ignored."
    )
    initial_codec_chunk_frames: SkipValidation[int | None] = Field(None, description=f"{_PEER} {_IGNORED}")
    references: SkipValidation[list[Any] | None] = Field(None, description=f"{_PEER} {_IGNORED}")
    token_count: SkipValidation[int | None] = Field(None, description=f"{_PEER} {_IGNORED}")
    duration_tokens: SkipValidation[int | None] = Field(None, description=f"{_PEER} {_IGNORED}")
    stage_params: SkipValidation[dict[str, Any] | None] = Field(None, description=f"{_PEER} {_IGNORED}")

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        return openai.check(decoded(data))


class VoiceUpload(BaseModel):
    """A reference recording for voice_clone (``POST /v1/voices``, a multipart form)."""

    file: UploadFile = Field(description="The recording: anything libsndfile reads (WAV, FLAC, Ogg, MP3).")
    text: str = Field("", description="Its transcript, which makes a closer clone.")


class NamedVoiceRequest(BaseModel):
    """A named voice (``POST /v1/audio/voices``): the request fields ``voice: NAME`` stands for."""

    model_config = ConfigDict(extra="forbid")

    name: SkipValidation[str] = Field(
        description="1-40 characters of a-z, 0-9, _ and -, starting with a letter or digit; case-insensitive. "
        f"Taken already: 409. At most {MAX_NAMED_VOICES} are kept."
    )
    mode: SkipValidation[Mode] = Field("voice_design", description=_MODES)
    instruct: SkipValidation[str] = Field(
        "", description="voice_design (required): the voice, described in words; otherwise how to speak."
    )
    language: SkipValidation[str] = Field("auto", description=_RequestFields.model_fields["language"].description)
    seed: SkipValidation[int | None] = Field(
        None, description="Fixes the voice a description makes. Absent: one is drawn now, and kept."
    )
    speaker: SkipValidation[str] = Field("", description=_RequestFields.model_fields["speaker"].description)
    reference: SkipValidation[str] = Field("", description=_RequestFields.model_fields["reference"].description)

    @model_validator(mode="before")
    @classmethod
    def _checked(cls, data: Any) -> Any:
        # The description against the settings' limit at creation, on a thread (as a job's ``instruct``).
        data = decoded(data)
        if isinstance(data, Mapping) and isinstance(data.get("instruct"), str) and data["instruct"].strip():
            NamedVoice.create({**data, "instruct": "x"})
        else:
            NamedVoice.create(data)
        return data

    def fields(self) -> dict[str, Any]:
        """The fields the body holds, with their values as sent."""
        return {name: getattr(self, name) for name in self.model_fields_set}


class ErrorDetail(BaseModel):
    """What went wrong, and which field (``param``) was at fault."""

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """Every error the gateway answers, in OpenAI's shape (``ttsq.gateway.errors``)."""

    error: ErrorDetail
