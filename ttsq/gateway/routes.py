"""The gateway's API: OpenAI's speech endpoint, the jobs API, voices (reference recordings and named voices), and
the design documents' ``/generate``.

The routes sit on ``router``; ``ttsq.gateway.app`` includes it. Each body is a declared model
(``ttsq.gateway.bodies``) checked by ttsq's one validation point (a field that is wrong is a 400 naming it,
in OpenAI's error shape); a route submits through the gateway's ``Client`` (``ttsq.gateway.state``) and,
where it answers with audio, waits for it asynchronously and sends the stored bytes as they are read from
storage.

Why one file over 400 lines: every route of the API in one place, in the order ``/openapi.json`` lists them.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Coroutine
from functools import partial
from typing import TYPE_CHECKING, Annotated, Any, cast

import anyio
from celery import states
from fastapi import APIRouter, Depends, File, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from fastapi.routing import APIRoute

from ttsq.alignment import parse_words
from ttsq.captions import CAPTION_FORMATS, CONTENT_TYPES, captions
from ttsq.client import unknown_job
from ttsq.errors import InvalidRequest
from ttsq.gateway import openai
from ttsq.gateway.bodies import (
    BatchRequest,
    ErrorBody,
    GenerateRequest,
    JobRequest,
    NamedVoiceRequest,
    SpeechRequest,
    VoiceUpload,
)
from ttsq.gateway.errors import ApiError
from ttsq.gateway.middleware import arrival
from ttsq.gateway.speech import ClientGone, SpeechAudio, final_state_error, result_of
from ttsq.gateway.state import Gateway
from ttsq.records.named_voices import NamedVoice
from ttsq.results import checked_key

if TYPE_CHECKING:
    from ttsq.client import Job
    from ttsq.engines.base import EngineIdentity

_VOICE_NAME = re.compile(r"(?:voices/)?([0-9a-f]{64})(?:\.wav)?")


class KeyedRoute(APIRoute):
    """A route of the API: the caller's key is checked before FastAPI reads the body, so a client without a
    valid key is refused without the gateway reading (or spooling to disk) what it sent."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def keyed(request: Request) -> Response:
            request.state.key_id = await gateway_of(request).authorize(request)
            return await handler(request)

        return keyed


def gateway_of(request: Request) -> Gateway:
    """The gateway of the application serving the request (``ttsq.gateway.state.install`` put it there)."""
    return cast(Gateway, request.app.state.gateway)


def key_of(request: Request) -> str:
    """The id of the request's API key ("" with ``TTSQ_GATEWAY_AUTH=none``), checked by ``KeyedRoute``."""
    return cast(str, request.state.key_id)


def scheduling_of(request: Request) -> dict[str, str]:
    """The request fields its API key sets: the tenant (the key's id: fair shares are per key) and the
    key's default lane (``ttsq keys add --lane``)."""
    found = {"tenant": cast(str, request.state.key_id), "lane": getattr(request.state, "key_lane", "")}
    return {name: value for name, value in found.items() if value}


GatewayDep = Annotated[Gateway, Depends(gateway_of)]
KeyId = Annotated[str, Depends(key_of)]
Scheduling = Annotated[dict[str, str], Depends(scheduling_of)]

#: Every error is OpenAI's shape (FastAPI would otherwise document its own 422, which the gateway never sends).
_ERRORS: dict[int | str, dict[str, Any]] = {
    "4XX": {"model": ErrorBody, "description": "Refused: `param` names the field at fault."},
    "5XX": {"model": ErrorBody, "description": "Failed, or a service ttsq depends on is unreachable."},
}
router = APIRouter(route_class=KeyedRoute, responses=_ERRORS)


def send(gateway: Gateway, job_fields: dict[str, Any], text: str, scheduling: dict[str, str]) -> Job:
    """One job, or a document when the text is longer than one job may be; ``scheduling`` is what the
    API key sets (``scheduling_of``): its tenant, and its lane unless the body names one."""
    tenant = scheduling.get("tenant")
    if tenant is not None and job_fields.get("tenant") not in (None, "", tenant):
        raise InvalidRequest("tenant", "is your API key's id at the gateway (fair shares are per key); leave it out")
    job_fields = {**job_fields, **({"tenant": tenant} if tenant else {})}
    if "lane" in scheduling and job_fields.get("lane") is None:
        job_fields["lane"] = scheduling["lane"]
    if len(text) > gateway.settings.max_text_chars:
        return gateway.client.submit_document(text, **job_fields)
    return gateway.client.submit(text, **job_fields)


def _submit(gateway: Gateway, fields: dict[str, Any], scheduling: dict[str, str]) -> Job:
    """A job from a checked body's fields, ``text`` among them."""
    job_fields = {name: value for name, value in fields.items() if name != "text"}
    return send(gateway, job_fields, fields["text"], scheduling)


def _submit_request(gateway: Gateway, item: Any, scheduling: dict[str, str]) -> Job:
    """One of a batch's requests, checked on its own: a wrong one is its own answer, not the batch's."""
    return _submit(gateway, JobRequest.model_validate(item).fields(), scheduling)


@router.post("/v1/audio/speech", tags=["OpenAI"], responses={200: {"content": {"audio/mpeg": {}}}})
async def create_speech(
    speech: SpeechRequest, request: Request, gateway: GatewayDep, key_id: KeyId, scheduling: Scheduling
) -> Response:
    """OpenAI's ``audio.speech.create``: the audio of ``input``, in ``response_format``, sent as the worker
    makes it (``stream_format: sse``: in ``speech.audio.delta`` events). ttsq's own request fields
    (``language``, ``seed``, ``mode``, sampling) may be added."""
    arrived = arrival(request)
    body = speech.fields()
    named = gateway.client.redis.named_voices

    def parse() -> tuple[openai.Speech, str | None]:
        fleet = gateway.client.identities()
        speech = openai.parse(body, fleet, named.find)
        return speech, openai.unserved(speech, fleet, gateway.settings.queue, request.headers, gateway.client.limits)

    checked: tuple[openai.Speech, str | None] = await gateway.submit(parse)
    parsed, unserved = checked
    if unserved is not None:  # said at once, not after the request's whole wait (docs/gateway.md)
        raise ApiError(503, unserved, type="server_error", code="no_worker", headers={"Retry-After": "5"})
    streamed = parsed.streamed
    fields = {name: value for name, value in parsed.fields.items() if name != "stream"}
    if streamed:
        fields["stream"] = True
    job = await gateway.submit(partial(send, gateway, fields, parsed.text, scheduling))
    document = len(parsed.text) > gateway.settings.max_text_chars
    audio = SpeechAudio(gateway, job, parsed, streamed=streamed, document=document, arrived=arrived)
    try:
        await audio.first(request.is_disconnected)
    except ClientGone:
        await audio.aclose()
        return Response(status_code=499)  # nobody reads it
    except BaseException:
        with anyio.CancelScope(shield=True):
            await audio.aclose()
        raise
    headers = {**audio.headers(), **parsed.headers()}

    async def charged(body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            async for chunk in body:
                yield chunk
        finally:
            with anyio.CancelScope(shield=True):  # a client gone still pays for what it was sent
                await audio.aclose()
                await gateway.charge(key_id, audio.duration_s)

    if parsed.stream_format == "sse":
        return StreamingResponse(charged(audio.sse()), media_type="text/event-stream", headers=headers)
    return StreamingResponse(charged(audio.raw()), media_type=parsed.content_type, headers=headers)


@router.post("/v1/jobs", tags=["jobs"], status_code=202)
async def create_job(job: JobRequest, gateway: GatewayDep, scheduling: Scheduling) -> Response:
    """Submit one job (any text length: a long text becomes a document). 202 with its id and
    ``Location``; 200 with the result when it is already in the cache."""
    submitted = await gateway.submit(partial(_submit, gateway, job.fields(), scheduling))
    return _job_response(submitted)


@router.post("/v1/jobs/batch", tags=["jobs"])
async def create_jobs(batch: BatchRequest, gateway: GatewayDep, scheduling: Scheduling) -> Response:
    """Submit up to 100 jobs: ``{"requests": [...]}``; each is answered (or refused) on its own."""
    answers: list[dict[str, Any]] = []
    for index, item in enumerate(batch.requests):
        try:
            answers.append(_job_body(await gateway.submit(partial(_submit_request, gateway, item, scheduling))))
        except ApiError as exc:
            param = f"requests[{index}].{exc.param}" if exc.param else f"requests[{index}]"
            answers.append({"error": {"message": exc.message, "type": exc.type, "param": param, "code": exc.code}})
    return JSONResponse({"jobs": answers})


async def owned(gateway: Gateway, key_id: str, job_id: str) -> None:
    """Refuse a job that is not the caller's key's with the answer for an id ttsq never issued, byte for
    byte (``unknown_job``): a key cannot tell another's job from no job. With ``TTSQ_GATEWAY_AUTH=none``
    there are no keys, and every job is everyone's."""
    if gateway.settings.gateway_auth == "none":
        return
    if await gateway.submit(partial(gateway.client.owner, job_id)) != key_id:
        raise unknown_job(job_id)


def _job_body(job: Job) -> dict[str, Any]:
    if job.result is not None:
        return {"id": job.id, "state": states.SUCCESS, "key": job.key, "result": job.result}
    return {"id": job.id, "state": states.PENDING, "key": job.key, "joined": job.joined, "chunks": job.chunks}


def _job_response(job: Job) -> Response:
    if job.result is not None:
        return JSONResponse(_job_body(job))
    return JSONResponse(_job_body(job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})


@router.get("/v1/jobs/{job_id}", tags=["jobs"])
async def get_job(job_id: str, gateway: GatewayDep, key_id: KeyId) -> Response:
    """A job's state; for a document its progress; when done its result, with a URL signed now."""
    await owned(gateway, key_id, job_id)
    status = await gateway.submit(partial(gateway.client.status, job_id))
    if status.get("state") == states.SUCCESS and isinstance(status.get("result"), dict):
        await gateway.charge_once(key_id, job_id, float(status["result"].get("duration_s", 0.0)))
    return JSONResponse(status)


@router.get("/v1/jobs/{job_id}/audio", tags=["jobs"])
async def get_audio(job_id: str, gateway: GatewayDep, key_id: KeyId, redirect: bool = False) -> Response:
    """A finished job's audio, read from storage (``?redirect=true``: a redirect to its signed URL)."""
    result = await _finished(gateway, key_id, job_id)
    if redirect:
        return RedirectResponse(result["url"], status_code=307)
    object_key = checked_key(result["object_key"])
    stream = await anyio.to_thread.run_sync(lambda: gateway.client.storage.stream(object_key))
    return StreamingResponse(stream, media_type=str(result.get("content_type", "application/octet-stream")))


@router.get(
    "/v1/jobs/{job_id}/captions.{caption_format}",
    tags=["jobs"],
    responses={200: {"content": {"application/x-subrip": {}, "text/vtt": {}}}},
)
async def get_captions(job_id: str, caption_format: str, gateway: GatewayDep, key_id: KeyId) -> Response:
    """A finished job's captions, SubRip (``captions.srt``) or WebVTT (``captions.vtt``), from the word
    timestamps it asked for (``"timestamps": "word"``; docs/timestamps.md)."""
    if caption_format not in CAPTION_FORMATS:
        raise ApiError(
            404, f"no captions.{caption_format[:20]}: ask for captions.srt or captions.vtt", code="not_found"
        )
    result = await _finished(gateway, key_id, job_id)
    if "words" not in result:
        raise ApiError(
            409,
            f'job {job_id} has no word timestamps: submit it with "timestamps": "word"',
            param="timestamps",
            code="no_timestamps",
        )
    words = parse_words(result["words"])
    body = captions(words, caption_format, duration_s=float(result.get("duration_s", 0.0)) or None)
    return Response(body, media_type=f"{CONTENT_TYPES[caption_format]}; charset=utf-8")


async def _finished(gateway: Gateway, key_id: str, job_id: str) -> dict[str, Any]:
    """The result of a finished job of the caller's key (charged once); 409 while it runs, the job's error
    once it failed."""
    await owned(gateway, key_id, job_id)
    status = await gateway.submit(partial(gateway.client.status, job_id))
    result = status.get("result")
    if status.get("state") in (states.REVOKED, states.FAILURE):
        error = status.get("error")
        raise final_state_error(
            status.get("state"), job_id, error.get("message", "") if isinstance(error, dict) else ""
        )
    if status.get("state") != states.SUCCESS or not isinstance(result, dict):
        raise ApiError(
            409, f"job {job_id} is {status.get('state')}, not done", code="not_ready", headers={"Retry-After": "1"}
        )
    await gateway.charge_once(key_id, job_id, float(result.get("duration_s", 0.0)))
    return result


@router.delete("/v1/jobs/{job_id}", tags=["jobs"])
async def cancel_job(job_id: str, gateway: GatewayDep, key_id: KeyId) -> Response:
    """Cancel a job; the answer is the state it ends in. 200 REVOKED unless its worker settled it first:
    a queued job never reaches a worker (a document's queued chunks neither), one in its engine call
    runs to the end of that call, its audio cached, and ends REVOKED. 409 for a job already settled or
    finished, naming its state. A job that follows another key's identical job is cancelled alone:
    their job goes on."""
    await owned(gateway, key_id, job_id)
    state = await gateway.submit(partial(gateway.client.cancel, job_id))
    if state != states.REVOKED:
        raise ApiError(409, f"job {job_id} already finished ({state})", code="finished")
    return JSONResponse({"id": job_id, "state": state})


@router.post("/v1/voices", tags=["voices"], status_code=201)
async def add_voice(upload: Annotated[VoiceUpload, File()], gateway: GatewayDep) -> Response:
    """Store a reference recording (multipart: ``file``, and ``text``, its transcript) for voice_clone."""
    data = await upload.file.read()
    reference = await gateway.submit(partial(gateway.client.add_voice, data, upload.text))
    return JSONResponse({"reference": reference}, status_code=201)


@router.get("/v1/voices", tags=["voices"])
async def list_voices(gateway: GatewayDep) -> Response:
    """The stored reference voices."""
    from ttsq.voices import list_voices

    voices = await gateway.submit(partial(list_voices, gateway.client.storage))
    return JSONResponse({"voices": [voice.summary() for voice in voices]})


@router.delete("/v1/voices/{name:path}", tags=["voices"])
async def delete_voice(name: str, gateway: GatewayDep) -> Response:
    """Remove a stored reference (``voices/<sha256>.wav``, or its 64 hex digits)."""
    from ttsq.voices import delete_voice

    match = _VOICE_NAME.fullmatch(name)
    if match is None:
        raise ApiError(
            400,
            "expected a voice key like voices/<64 hex digits>.wav",
            param="voice",
            code="invalid_value",
            cause="invalid",
        )
    reference = f"voices/{match.group(1)}.wav"
    if not await gateway.submit(partial(delete_voice, gateway.client.storage, reference)):
        raise ApiError(404, f"no voice {reference}", code="not_found", cause="not_found")
    return JSONResponse({"reference": reference, "deleted": True})


@router.post("/generate", tags=["design documents"])
async def generate(body: GenerateRequest, gateway: GatewayDep, key_id: KeyId, scheduling: Scheduling) -> Response:
    """``{"text", "language" (default korean), "instruction"}``: synthesize and return the result JSON."""
    job = await gateway.submit(partial(_submit, gateway, body.job_fields(), scheduling))
    result = await result_of(gateway, job)
    await gateway.charge(key_id, float(result["duration_s"]))
    return JSONResponse(result)


@router.get("/v1/models", tags=["OpenAI"])
async def list_models(gateway: GatewayDep) -> Response:
    """OpenAI's model list: the models the running workers announced, then the names the speech route
    also takes (the modes, OpenAI's own model names), each saying what it means here."""
    fleet: dict[str, EngineIdentity] = await gateway.submit(gateway.client.identities)
    return JSONResponse({"object": "list", "data": models(fleet)})


@router.get("/v1/models/{model:path}", tags=["OpenAI"])
async def get_model(model: str, gateway: GatewayDep) -> Response:
    """One model of ``GET /v1/models``; 404 for a name the speech route would refuse."""
    fleet: dict[str, EngineIdentity] = await gateway.submit(gateway.client.identities)
    for entry in models(fleet):
        if entry["id"] == model:
            return JSONResponse(entry)
    raise ApiError(
        404, f"no model {model[:80]!r} here; GET /v1/models lists them", param="model", code="model_not_found"
    )


def models(fleet: dict[str, EngineIdentity]) -> list[dict[str, Any]]:
    """The entries of ``GET /v1/models``, in OpenAI's shape plus a ``ttsq`` object saying what each is."""
    entries: dict[str, dict[str, Any]] = {}
    for identity in fleet.values():
        entry = entries.setdefault(
            identity.model,
            {
                "id": identity.model,
                "object": "model",
                "created": 0,
                "owned_by": identity.engine,
                "ttsq": {"kind": "model", "engine": identity.engine, "revision": identity.revision, "modes": []},
            },
        )
        entry["ttsq"]["modes"] = sorted({*entry["ttsq"]["modes"], *identity.modes} & set(fleet))
    for mode in sorted(fleet):
        meaning: dict[str, Any] = {"kind": "mode", "mode": mode, "model": fleet[mode].model}
        entries.setdefault(mode, {"id": mode, "object": "model", "created": 0, "owned_by": "ttsq", "ttsq": meaning})
    default = openai.default_mode(fleet)
    for name in openai.OPENAI_MODELS:
        meaning = {"kind": "alias", "mode": default, "model": fleet[default].model if default in fleet else None}
        entries.setdefault(name, {"id": name, "object": "model", "created": 0, "owned_by": "ttsq", "ttsq": meaning})
    return list(entries.values())


@router.get("/v1/audio/voices", tags=["OpenAI"])
async def list_speech_voices(gateway: GatewayDep) -> Response:
    """Every ``voice`` the speech route takes, in the order it looks them up: the named voices
    (``POST /v1/audio/voices``; a corrupt record is listed with its ``error``), the speakers the fleet's models
    announced (mode custom_voice), then the stored reference voices (mode voice_clone, ``POST /v1/voices``)."""
    from ttsq.voices import list_voices

    fleet: dict[str, EngineIdentity] = await gateway.submit(gateway.client.identities)
    named = await gateway.submit(gateway.client.redis.named_voices.list)
    data: list[dict[str, Any]] = [
        voice.summary()
        if isinstance(voice, NamedVoice)
        else {"id": name, "object": "audio.voice", "name": name, "type": "named", "error": str(voice)}
        for name, voice in named.items()
    ]
    seen: set[str] = set()
    for identity in fleet.values():
        for speaker in identity.speakers:
            if speaker not in seen:
                seen.add(speaker)
                data.append(
                    {
                        "id": speaker,
                        "object": "audio.voice",
                        "name": speaker,
                        "type": "speaker",
                        "mode": "custom_voice",
                        "model": identity.model,
                    }
                )
    references = await gateway.submit(partial(list_voices, gateway.client.storage))
    for voice in references:
        data.append(
            {
                "id": voice.reference,
                "object": "audio.voice",
                "name": voice.reference,
                "type": "reference",
                "mode": "voice_clone",
                "duration_s": voice.duration_s,
            }
        )
    return JSONResponse({"object": "list", "data": data})


@router.post("/v1/audio/voices", tags=["OpenAI"], status_code=201)
async def create_named_voice(body: NamedVoiceRequest, gateway: GatewayDep) -> Response:
    """Keep a voice under a name: ``voice: NAME`` on the speech route then fills in its fields (those the request
    leaves out). 201 with the voice; 409 if the name is taken (delete it first: a name is never overwritten)."""
    store = gateway.client.redis.named_voices

    def add() -> tuple[NamedVoice, bool]:
        voice = NamedVoice.create(body.fields(), limits=gateway.client.limits)
        return voice, store.add(voice)

    voice, added = await gateway.submit(add)
    if not added:
        raise ApiError(409, f"a voice named {voice.name!r} exists; delete it first", param="name", code="voice_exists")
    return JSONResponse(voice.summary(), status_code=201)


@router.get("/v1/audio/voices/{name}", tags=["OpenAI"])
async def get_named_voice(name: str, gateway: GatewayDep) -> Response:
    """One named voice (a speaker or a reference is not one: 404)."""
    voice = await gateway.submit(partial(gateway.client.redis.named_voices.get, name))
    if voice is None:
        raise _no_named_voice(name)
    return JSONResponse(voice.summary())


@router.delete("/v1/audio/voices/{name}", tags=["OpenAI"])
async def delete_named_voice(name: str, gateway: GatewayDep) -> Response:
    """Remove a named voice. Audio made with it stays cached: its key is the fields', not the name's."""
    if not await gateway.submit(partial(gateway.client.redis.named_voices.delete, name)):
        raise _no_named_voice(name)
    return JSONResponse({"id": name.strip().lower(), "object": "audio.voice.deleted", "deleted": True})


def _no_named_voice(name: str) -> ApiError:
    return ApiError(404, f"no named voice {name[:60]!r}", param="name", code="voice_not_found", cause="not_found")
