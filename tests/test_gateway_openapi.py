"""The gateway's declared request bodies (``ttsq.gateway.bodies``), against a real ``ttsq serve``:
``/openapi.json`` documents each body, and a wrong body is still a 400 in OpenAI's error shape naming
the field, whichever layer refuses it (FastAPI's decoding, a body model, or the submit behind it)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from support import GatewayProcess, api_key

from ttsq.config import Settings
from ttsq.gateway.bodies import JobRequest, SpeechRequest
from ttsq.gateway.openai import PEER_FIELDS
from ttsq.job import SynthesisRequest
from ttsq.voices import MAX_REFERENCE_BYTES

StartGateway = Callable[..., GatewayProcess]
OPENAI_FIELDS = {"model", "input", "voice", "instructions", "response_format", "speed", "stream_format"}
#: ttsq's own fields, and other Qwen3-TTS servers' extension fields (vLLM-Omni, SGLang-Omni), beside OpenAI's.
SPEECH_FIELDS = OPENAI_FIELDS | set(PEER_FIELDS)
# cache_scope is the gateway's to set (TTSQ_CACHE_SCOPE), never a body's: a key must not pick another tenant's cache.
TTSQ_FIELDS = {field.name for field in dataclasses.fields(SynthesisRequest)} - {"cache_scope"}


@pytest.fixture
def gateway(settings: Settings, start_gateway: StartGateway) -> tuple[GatewayProcess, str]:
    """A gateway with no worker: everything here is refused (or queued) before a worker is needed."""
    return start_gateway(settings), api_key(settings)


def body_schema(spec: dict[str, Any], path: str, content_type: str = "application/json") -> dict[str, Any]:
    body = spec["paths"][path]["post"]["requestBody"]
    assert body["required"] is True, path
    ref = body["content"][content_type]["schema"]["$ref"]
    return dict(spec["components"]["schemas"][ref.rsplit("/", 1)[-1]])


def test_openapi_declares_every_request_body(gateway: tuple[GatewayProcess, str]) -> None:
    process, _ = gateway
    spec = httpx.get(f"{process.url}/openapi.json").json()  # open: no key needed
    posts = sorted(path for path, operations in spec["paths"].items() if "post" in operations)
    assert posts == ["/generate", "/v1/audio/speech", "/v1/audio/voices", "/v1/jobs", "/v1/jobs/batch", "/v1/voices"]

    speech = body_schema(spec, "/v1/audio/speech")
    assert SPEECH_FIELDS | (TTSQ_FIELDS - {"text", "format"}) | {"options"} == set(speech["properties"])
    assert speech["required"] == ["input"]  # model may be left out when mode is given
    assert speech["properties"]["response_format"]["enum"] == ["mp3", "opus", "flac", "wav", "pcm"]
    job = body_schema(spec, "/v1/jobs")
    assert set(job["properties"]) == TTSQ_FIELDS | {"options"} and job["required"] == ["text"]
    assert job["additionalProperties"] is False
    batch = body_schema(spec, "/v1/jobs/batch")
    assert batch["properties"]["requests"]["items"] == {"$ref": "#/components/schemas/JobRequest"}
    generate = body_schema(spec, "/generate")
    assert {"text", "language", "instruction"} <= set(generate["properties"])
    assert generate["properties"]["language"]["default"] == "korean"
    named = body_schema(spec, "/v1/audio/voices")
    assert set(named["properties"]) == {"name", "mode", "instruct", "language", "seed", "speaker", "reference"}
    assert named["required"] == ["name"] and named["additionalProperties"] is False
    voice = body_schema(spec, "/v1/voices", "multipart/form-data")
    assert voice["required"] == ["file"] and voice["properties"]["file"]["type"] == "string"
    assert set(voice["properties"]) == {"file", "text"}
    # Errors are documented in OpenAI's shape, not as FastAPI's 422 (which the gateway never sends).
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    assert spec["paths"]["/v1/jobs"]["post"]["responses"]["4XX"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ErrorBody"
    }


def test_the_declared_fields_are_the_validation_points_fields() -> None:
    """A field ``SynthesisRequest`` gains and the bodies do not declare would be refused as unknown."""
    assert set(JobRequest.model_fields) == TTSQ_FIELDS | {"options"}
    assert set(SpeechRequest.model_fields) == SPEECH_FIELDS | (TTSQ_FIELDS - {"text", "format"}) | {"options"}


def refused(response: httpx.Response) -> tuple[int, str | None, str | None]:
    """(status, param, code) of an error in OpenAI's shape."""
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], response.text
    assert error["type"] == "invalid_request_error", response.text
    return response.status_code, error["param"], error["code"]


JSON = {"content-type": "application/json"}
NESTED = b"[" * 100_000 + b"]" * 100_000  # past Python's recursion limit: the gateway once answered a 500


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def speech(**fields: Any) -> bytes:
    return body(model="tts-1", input="Hello.", **fields)


#: (path, body, headers, (param, code)) of bodies refused with a 400: by FastAPI's JSON decoding, a body
#: model, ``openai.check``, or ``SynthesisRequest.from_dict`` at submit.
WRONG_BODIES: list[tuple[str, bytes, dict[str, str], tuple[str, str]]] = [
    ("/v1/jobs", b"{not json", {}, ("body", "invalid_json")),
    ("/v1/jobs", b"{not json", JSON, ("body", "invalid_json")),
    ("/v1/jobs", b'{"text": "caf\xe9"}', JSON, ("body", "invalid_json")),  # Latin-1, not UTF-8
    ("/v1/jobs", NESTED, {}, ("body", "invalid_json")),
    ("/v1/audio/speech", NESTED, JSON, ("body", "invalid_json")),
    ("/v1/jobs", b"", JSON, ("body", "invalid_value")),
    ("/v1/jobs", b"null", JSON, ("body", "invalid_value")),
    ("/v1/jobs", b"[1, 2]", JSON, ("body", "invalid_value")),
    ("/v1/jobs", body(text=5), JSON, ("text", "invalid_value")),
    ("/v1/jobs", body(text="Hello.", voice="alloy"), JSON, ("voice", "invalid_value")),
    ("/v1/jobs", body(text="Hello.", top_k=True), JSON, ("top_k", "invalid_value")),
    ("/v1/jobs", body(text="Hello.", seed="7"), {}, ("seed", "invalid_value")),
    ("/v1/jobs", body(text="Hello.", options={"max_chars": 500}), JSON, ("options", "invalid_value")),  # a job's
    ("/v1/jobs", body(text="Hello.", instruct=5), JSON, ("instruct", "invalid_value")),
    ("/v1/jobs/batch", body(requests="Hello."), JSON, ("requests", "invalid_value")),
    ("/v1/jobs/batch", b'[{"text": "Hello."}]', JSON, ("requests", "invalid_value")),
    ("/v1/jobs/batch", body(requests=[{"text": "Hello."}] * 101), JSON, ("requests", "invalid_value")),
    ("/generate", body(text="Hello.", language="klingon"), JSON, ("language", "invalid_value")),
    ("/generate", body(text="Hello.", instruction=5), JSON, ("instruct", "invalid_value")),
    ("/v1/audio/speech", body(model="tts-1", voice="alloy"), JSON, ("input", "invalid_value")),
    ("/v1/audio/speech", speech(text="Hi."), JSON, ("text", "invalid_value")),  # once a 500
    ("/v1/audio/speech", speech(format="wav"), {}, ("format", "invalid_value")),
    ("/v1/audio/speech", speech(colour="red"), JSON, ("colour", "invalid_value")),
    ("/v1/audio/speech", speech(voice={"id": 7}), JSON, ("voice", "invalid_value")),
    ("/v1/audio/speech", speech(speed=1.5), JSON, ("speed", "invalid_value")),
    ("/v1/audio/speech", speech(language="klingon"), JSON, ("language", "invalid_value")),
    ("/v1/audio/voices", NESTED, JSON, ("body", "invalid_json")),
    ("/v1/audio/voices", body(name="kim", instruct=5), JSON, ("instruct", "invalid_value")),
    ("/v1/audio/voices", body(name="kim/../x", instruct="A voice."), {}, ("name", "invalid_value")),
]


def test_a_wrong_body_is_a_400_in_openai_shape_naming_the_field(gateway: tuple[GatewayProcess, str]) -> None:
    process, token = gateway
    with httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as api:
        for path, content, headers, expected in WRONG_BODIES:
            response = api.post(path, content=content, headers=headers)
            assert refused(response) == (400, *expected), (path, content[:80], response.text)
    assert "unexpected" not in process.log(), process.log()[-2000:]


def test_openai_errors_from_every_layer_reach_openais_client(gateway: tuple[GatewayProcess, str]) -> None:
    """The body model (an unknown field), openai.check (speed), the fleet (a voice) and the submit's
    ``SynthesisRequest.from_dict`` (a seed): each is the typed error OpenAI's own client raises."""
    process, token = gateway
    client = openai.OpenAI(base_url=f"{process.url}/v1", api_key=token, max_retries=0)
    for changes, extra, param in [
        ({}, {"colour": "red"}, "colour"),
        ({"speed": 2.0}, {}, "speed"),
        ({"voice": "nobody-of-that-name"}, {}, "voice"),
        ({}, {"seed": "seven"}, "seed"),
        ({}, {"language": "klingon"}, "language"),
    ]:
        arguments: dict[str, Any] = {"model": "tts-1", "voice": "alloy", "input": "Hello.", **changes}
        with pytest.raises(openai.BadRequestError) as info:
            client.audio.speech.create(**arguments, extra_body=extra)
        assert info.value.status_code == 400 and info.value.param == param, (changes, extra)


def form_without_length(size: int) -> Iterator[bytes]:
    yield b'--x\r\nContent-Disposition: form-data; name="file"; filename="me.wav"\r\n\r\n'
    for _ in range(size // 2**20):
        yield b"\0" * 2**20


def test_bodies_the_gateway_always_took_and_keys_checked_before_any_body(
    gateway: tuple[GatewayProcess, str],
) -> None:
    process, token = gateway
    with httpx.Client(base_url=process.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as api:
        # JSON under any content type (curl -d sends a form's), as before the bodies were declared.
        for headers in ({}, {"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}):
            queued = api.post("/v1/jobs", content=b'{"text": "Queued, as any content type."}', headers=headers)
            assert queued.status_code == 202 and queued.json()["state"] == "PENDING", queued.text
        batch = api.post("/v1/jobs/batch", json={"requests": [{"text": "One."}, {"text": "Two.", "seed": -1}]})
        answers = batch.json()["jobs"]
        assert batch.status_code == 200 and answers[0]["state"] == "PENDING", batch.text
        assert answers[1]["error"]["param"] == "requests[1].seed"
        # The form: no file, a file sent as a string field, and a body that is no multipart form.
        assert refused(api.post("/v1/voices", data={"text": "A transcript."}))[:2] == (400, "file")
        assert refused(api.post("/v1/voices", data={"file": "not a file"}))[:2] == (400, "file")
        broken = api.post("/v1/voices", content=b"garbage", headers={"content-type": "multipart/form-data; boundary=x"})
        assert refused(broken)[:2] == (400, "body")
        oversized = api.post(  # streamed, no Content-Length: the form parser meets the body limit
            "/v1/voices",
            content=form_without_length(MAX_REFERENCE_BYTES + 2 * 2**20),
            headers={"content-type": "multipart/form-data; boundary=x"},
        )
        assert oversized.status_code == 413 and oversized.json()["error"]["code"] == "request_too_large"
        assert refused(api.get("/v1/jobs/some-id/audio", params={"redirect": "maybe"}))[:2] == (400, "redirect")
        assert refused(api.get("/v1/no-such-route")) == (404, None, "unknown_url")  # OpenAI's shape, not FastAPI's
    # No key: refused before the body is read, whatever the body is.
    with httpx.Client(base_url=process.url, timeout=30) as anonymous:
        for response in (
            anonymous.post("/v1/jobs", content=b"{not json", headers=JSON),
            anonymous.post("/v1/audio/speech", content=NESTED),
            anonymous.post("/v1/voices", files={"file": ("me.wav", b"RIFF" + b"\0" * 1000, "audio/wav")}),
        ):
            assert response.status_code == 401 and response.json()["error"]["code"] == "missing_api_key"
