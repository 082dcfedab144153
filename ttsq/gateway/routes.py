"""The gateway's API: OpenAI's speech endpoint, the jobs API, voices, and the design documents' ``/generate``.

Every route takes its body as untrusted JSON (a field that is wrong is a 400 naming it, in OpenAI's
error shape), submits through the gateway's ``Client`` (``ttsq.gateway.state``) and, where it answers with
audio, waits for it asynchronously and sends the stored bytes as they are read from storage.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import anyio
from celery import states
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response, StreamingResponse

from ttsq.errors import InvalidRequest
from ttsq.gateway import openai
from ttsq.gateway.errors import ApiError
from ttsq.results import checked_key

if TYPE_CHECKING:
    from ttsq.client import Job
    from ttsq.gateway.state import Gateway
    from ttsq.job import JobResult

#: Most requests one batch submit takes.
MAX_BATCH_REQUESTS = 100
_VOICE_NAME = re.compile(r"(?:voices/)?([0-9a-f]{64})(?:\.wav)?")


def add_routes(app: FastAPI, gateway: Gateway) -> None:
    """Register the API on the gateway application."""
    settings = gateway.settings
    key = Depends(gateway.authorize)

    async def body_of(request: Request) -> Any:
        try:
            return json.loads(await request.body() or b"null")
        except (ValueError, UnicodeDecodeError):
            raise ApiError(400, "the body is not JSON", param="body", code="invalid_json", cause="invalid") from None

    def send(job_fields: dict[str, Any], text: str) -> Job:
        """One job, or a document when the text is longer than one job may be."""
        if len(text) > settings.max_text_chars:
            return gateway.client.submit_document(text, **job_fields)
        return gateway.client.submit(text, **job_fields)

    async def result_of(job: Job) -> JobResult:
        """The job's result, waiting for it without a thread; failures as HTTP errors."""
        if job.result is not None:
            return job.result
        meta = await gateway.waiter.wait(job.id or "", settings.gateway_wait_s)
        return failed_or_result(meta)

    def failed_or_result(meta: dict[str, Any]) -> JobResult:
        status = meta.get("status")
        if status == states.SUCCESS and isinstance(meta.get("result"), dict):
            return gateway.client.refresh_url(cast("JobResult", meta["result"]))
        error = meta.get("result") if isinstance(meta.get("result"), dict) else {}
        kind = str(error.get("exc_type", "")) if error else ""
        args = error.get("exc_message") if error else None
        detail = args[-1] if isinstance(args, list) and args else args
        if status == states.REVOKED:
            raise ApiError(409, "the job was cancelled", code="cancelled")
        if kind == "InvalidRequest" and isinstance(args, list) and len(args) == 2:
            raise ApiError(400, f"invalid {args[0]}: {args[1]}", param=str(args[0]), code="invalid_value")
        raise ApiError(
            500, f"the job failed: {kind or 'error'}: {str(detail)[:200]}", type="server_error", code="job_failed"
        )

    def audio_headers(job: Job, result: JobResult, ignored: tuple[str, ...] = ()) -> dict[str, str]:
        headers = {"X-TTSQ-Key": result["key"], "X-TTSQ-Cached": str(bool(result["cached"])).lower()}
        if job.id:
            headers["X-TTSQ-Job-Id"] = job.id
        reported = [*ignored, *result.get("ignored", [])]
        if reported:
            headers["X-TTSQ-Ignored"] = ",".join(dict.fromkeys(reported))
        return headers

    @app.post("/v1/audio/speech", tags=["OpenAI"], responses={200: {"content": {"audio/mpeg": {}}}})
    async def create_speech(request: Request, key_id: str = key) -> Response:
        """OpenAI's ``audio.speech.create``: the audio of ``input``, in ``response_format``, sent as it is read
        from storage. ttsq's own request fields (``language``, ``seed``, ``mode``, sampling) may be added."""
        body = await body_of(request)
        parsed: openai.Speech = await gateway.submit(lambda: openai.parse(body, gateway.client.identities()))
        job = await gateway.submit(partial(send, parsed.fields, parsed.text))
        result = await result_of(job)
        await gateway.charge(key_id, float(result["duration_s"]))
        headers = audio_headers(job, result, parsed.ignored)
        object_key = checked_key(result["object_key"])
        if parsed.response_format == "pcm":
            data = await anyio.to_thread.run_sync(lambda: openai.pcm(gateway.client.storage.get(object_key)))
            stream: Iterator[bytes] = iter([data])
        else:
            stream = await anyio.to_thread.run_sync(lambda: gateway.client.storage.stream(object_key))
        if parsed.stream_format == "sse":
            return StreamingResponse(_sse(stream, result), media_type="text/event-stream", headers=headers)
        return StreamingResponse(stream, media_type=parsed.content_type, headers=headers)

    @app.post("/v1/jobs", tags=["jobs"], status_code=202)
    async def create_job(request: Request, key_id: str = key) -> Response:
        """Submit one job (any text length: a long text becomes a document). 202 with its id and
        ``Location``; 200 with the result when it is already in the cache."""
        body = await body_of(request)
        job = await gateway.submit(partial(_submit_fields, send, body))
        return job_response(job)

    @app.post("/v1/jobs/batch", tags=["jobs"])
    async def create_jobs(request: Request, key_id: str = key) -> Response:
        """Submit up to 100 jobs: ``{"requests": [...]}``; each is answered (or refused) on its own."""
        body = await body_of(request)
        requests = body.get("requests") if isinstance(body, dict) else None
        if not isinstance(requests, list) or not 1 <= len(requests) <= MAX_BATCH_REQUESTS:
            raise ApiError(
                400,
                f"requests must be a list of 1..{MAX_BATCH_REQUESTS} job requests",
                param="requests",
                code="invalid_value",
                cause="invalid",
            )
        answers: list[dict[str, Any]] = []
        for index, item in enumerate(requests):
            try:
                answers.append(job_body(await gateway.submit(partial(_submit_fields, send, item))))
            except ApiError as exc:
                param = f"requests[{index}].{exc.param}" if exc.param else f"requests[{index}]"
                answers.append({"error": {"message": exc.message, "type": exc.type, "param": param, "code": exc.code}})
        return JSONResponse({"jobs": answers})

    def job_body(job: Job) -> dict[str, Any]:
        if job.result is not None:
            return {"id": job.id, "state": states.SUCCESS, "key": job.key, "result": job.result}
        return {"id": job.id, "state": states.PENDING, "key": job.key, "joined": job.joined, "chunks": job.chunks}

    def job_response(job: Job) -> Response:
        if job.result is not None:
            return JSONResponse(job_body(job))
        return JSONResponse(job_body(job), status_code=202, headers={"Location": f"/v1/jobs/{job.id}"})

    @app.get("/v1/jobs/{job_id}", tags=["jobs"])
    async def get_job(job_id: str, key_id: str = key) -> Response:
        """A job's state; for a document its progress; when done its result, with a URL signed now."""
        status = await gateway.submit(partial(gateway.client.status, job_id))
        if status.get("state") == states.SUCCESS and isinstance(status.get("result"), dict):
            await gateway.charge_once(key_id, job_id, float(status["result"].get("duration_s", 0.0)))
        return JSONResponse(status)

    @app.get("/v1/jobs/{job_id}/audio", tags=["jobs"])
    async def get_audio(job_id: str, redirect: bool = False, key_id: str = key) -> Response:
        """A finished job's audio, read from storage (``?redirect=true``: a redirect to its signed URL)."""
        status = await gateway.submit(partial(gateway.client.status, job_id))
        result = status.get("result")
        if status.get("state") != states.SUCCESS or not isinstance(result, dict):
            raise ApiError(
                409, f"job {job_id} is {status.get('state')}, not done", code="not_ready", headers={"Retry-After": "1"}
            )
        await gateway.charge_once(key_id, job_id, float(result.get("duration_s", 0.0)))
        if redirect:
            return RedirectResponse(result["url"], status_code=307)
        object_key = checked_key(result["object_key"])
        stream = await anyio.to_thread.run_sync(lambda: gateway.client.storage.stream(object_key))
        return StreamingResponse(stream, media_type=str(result.get("content_type", "application/octet-stream")))

    @app.delete("/v1/jobs/{job_id}", tags=["jobs"])
    async def cancel_job(job_id: str, key_id: str = key) -> Response:
        """Cancel a job that has not run: a queued job never reaches a worker (a document's queued chunks
        neither). 409 for a job that already finished."""
        state = await gateway.submit(partial(gateway.client.cancel, job_id))
        if state != states.REVOKED:
            raise ApiError(409, f"job {job_id} already finished ({state})", code="finished")
        return JSONResponse({"id": job_id, "state": state})

    @app.post("/v1/voices", tags=["voices"], status_code=201)
    async def add_voice(request: Request, key_id: str = key) -> Response:
        """Store a reference recording (multipart: ``file``, and ``text``, its transcript) for voice_clone."""
        try:
            form = await request.form()
        except Exception:
            raise ApiError(
                400, "expected a multipart form with a file", param="file", code="invalid_value", cause="invalid"
            ) from None
        upload, text = form.get("file"), form.get("text") or ""
        if upload is None or isinstance(upload, str):
            raise ApiError(400, "file is required: the recording", param="file", code="invalid_value", cause="invalid")
        if not isinstance(text, str):
            raise ApiError(400, "text must be a string", param="text", code="invalid_value", cause="invalid")
        data = await upload.read()
        reference = await gateway.submit(partial(gateway.client.add_voice, data, text))
        return JSONResponse({"reference": reference}, status_code=201)

    @app.get("/v1/voices", tags=["voices"])
    async def list_voices(key_id: str = key) -> Response:
        """The stored reference voices."""
        from ttsq.voices import list_voices

        voices = await gateway.submit(partial(list_voices, gateway.client.storage))
        return JSONResponse({"voices": [voice.summary() for voice in voices]})

    @app.delete("/v1/voices/{name:path}", tags=["voices"])
    async def delete_voice(name: str, key_id: str = key) -> Response:
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

    @app.post("/generate", tags=["design documents"])
    async def generate(request: Request, key_id: str = key) -> Response:
        """``{"text", "language" (default korean), "instruction"}``: synthesize and return the result JSON."""
        body = await body_of(request)
        if not isinstance(body, dict):
            raise ApiError(400, "expected a JSON object", param="body", code="invalid_value", cause="invalid")
        fields = {name: value for name, value in body.items() if name not in ("text", "instruction")}
        fields.setdefault("language", "korean")
        if "instruction" in body:
            fields["instruct"] = body["instruction"]
        job = await gateway.submit(partial(_submit_fields, send, {**fields, "text": body.get("text")}))
        result = await result_of(job)
        await gateway.charge(key_id, float(result["duration_s"]))
        return JSONResponse(result)


def _submit_fields(send: Any, body: Any) -> Job:
    """A job from a JSON body of request fields (``text`` and the rest)."""
    if not isinstance(body, dict):
        raise InvalidRequest("body", "expected a JSON object of request fields")
    text = body.get("text")
    if not isinstance(text, str):
        raise InvalidRequest("text", "is required" if text is None else f"expected a string, got {type(text).__name__}")
    return cast("Job", send({name: value for name, value in body.items() if name != "text"}, text))


def _sse(stream: Iterator[bytes], result: JobResult) -> Iterator[bytes]:
    """OpenAI's ``stream_format: sse``: the audio in ``speech.audio.delta`` events, then ``speech.audio.done``."""
    for piece in stream:
        event = {"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode("ascii")}
        yield f"data: {json.dumps(event)}\n\n".encode()
    done = {
        "type": "speech.audio.done",
        "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0},
        "duration_s": result["duration_s"],
    }
    yield f"data: {json.dumps(done)}\n\n".encode()
