"""Named voices (``ttsq.records.named_voices``): kept under a name through ``POST /v1/audio/voices`` and
``ttsq voices named``, used as OpenAI's ``voice``, against real Redis, a real ``ttsq serve`` and a real espeak
worker. espeak follows neither a description nor a seed, but the content key shows what a voice resolved to."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
import redis
from support import GatewayProcess, WorkerProcess, api_key, run_cli

from ttsq.config import Settings
from ttsq.constants import NAMED_VOICES_KEY
from ttsq.errors import CorruptRecord, InvalidRequest
from ttsq.records.named_voices import NamedVoice

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]
KIM = {"name": "Narrator-Kim", "instruct": "A calm, low voice, reading slowly.", "language": "en", "seed": 7}


def http(gateway: GatewayProcess, token: str) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def speak(client: openai.OpenAI, **fields: Any) -> tuple[str, bool]:
    """(content key, cache hit) of a speech request through OpenAI's own client."""
    arguments: dict[str, Any] = {"model": "tts-1", "input": "Hello there.", "response_format": "wav", **fields}
    with client.audio.speech.with_streaming_response.create(**arguments) as response:
        assert len(response.read()) > 1000
        return response.headers["x-ttsq-key"], response.headers["x-ttsq-cached"] == "true"


def test_a_named_voice_is_the_same_voice_every_time(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    start_worker(settings)
    gateway = start_gateway(settings)
    token = api_key(settings)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    with http(gateway, token) as api:
        created = api.post("/v1/audio/voices", json=KIM)
        assert created.status_code == 201, created.text
        assert {"id": "narrator-kim", "type": "named", "mode": "voice_design", "language": "english"}.items() <= (
            created.json().items()
        )
        taken = api.post("/v1/audio/voices", json={**KIM, "seed": 8})  # never overwritten
        assert taken.status_code == 409 and taken.json()["error"]["param"] == "name"
        assert api.get("/v1/audio/voices/narrator-kim").json()["seed"] == 7
        listed = api.get("/v1/audio/voices").json()["data"]
        assert listed[0] == created.json()
        # The same fields under another name: one voice, one content key.
        assert api.post("/v1/audio/voices", json={**KIM, "name": "kim-copy"}).status_code == 201

    key, cached = speak(client, voice="narrator-kim")
    assert not cached
    assert speak(client, voice="NARRATOR-KIM") == (key, True)  # names are case-insensitive
    assert speak(client, voice={"id": "narrator-kim"}) == (key, True)  # OpenAI's custom voice object
    assert speak(client, voice="kim-copy") == (key, True)  # the key is the fields', not the name's
    explicit = {"instructions": KIM["instruct"], "extra_body": {"language": "english", "seed": 7}}
    assert speak(client, voice="alloy", **explicit) == (key, True)
    # A field the request sends wins over the voice's: another seed, another description, another voice.
    other_seed, cached = speak(client, voice="narrator-kim", extra_body={"seed": 8})
    assert other_seed != key and not cached
    assert speak(client, voice="alloy", instructions=KIM["instruct"], extra_body={"language": "english", "seed": 8})[
        0
    ] == (other_seed)
    assert speak(client, voice="narrator-kim", instructions="A bright, fast voice.")[0] not in (key, other_seed)
    with pytest.raises(openai.BadRequestError) as info:  # the voice's mode is the voice
        speak(client, voice="narrator-kim", extra_body={"mode": "custom_voice"})
    assert info.value.param == "mode"

    with http(gateway, token) as api:
        deleted = api.delete("/v1/audio/voices/Narrator-Kim")
        assert deleted.status_code == 200 and deleted.json() == {
            "id": "narrator-kim",
            "object": "audio.voice.deleted",
            "deleted": True,
        }
        assert api.delete("/v1/audio/voices/narrator-kim").status_code == 404
        assert api.get("/v1/audio/voices/narrator-kim").status_code == 404
        assert [voice["id"] for voice in api.get("/v1/audio/voices").json()["data"]] == ["kim-copy"]
    with pytest.raises(openai.BadRequestError) as info:
        speak(client, voice="narrator-kim")
    assert info.value.param == "voice"
    assert speak(client, voice="kim-copy") == (key, True)  # what the deleted name made stays cached


#: (body, the param a 400 names) of named voices the gateway refuses.
BAD_VOICES: list[tuple[Any, str]] = [
    ({"instruct": "A voice."}, "name"),
    ({**KIM, "name": ""}, "name"),
    ({**KIM, "name": "k" * 41}, "name"),
    ({**KIM, "name": "../kim"}, "name"),
    ({**KIM, "name": "kim kim"}, "name"),
    ({**KIM, "name": "-kim"}, "name"),
    ({**KIM, "name": 5}, "name"),
    ({**KIM, "name": "kim\u202e"}, "name"),
    ({"name": "kim"}, "instruct"),
    ({**KIM, "instruct": ""}, "instruct"),
    ({**KIM, "instruct": 5}, "instruct"),
    ({**KIM, "instruct": "x" * 1001}, "instruct"),
    ({**KIM, "instruct": "A voice\x00."}, "instruct"),
    ({**KIM, "language": "klingon"}, "language"),
    ({**KIM, "seed": -1}, "seed"),
    ({**KIM, "seed": 2**32}, "seed"),
    ({**KIM, "seed": "7"}, "seed"),
    ({**KIM, "seed": True}, "seed"),
    ({**KIM, "mode": "whisper"}, "mode"),
    ({**KIM, "mode": "custom_voice"}, "speaker"),
    ({**KIM, "speaker": "ryan"}, "speaker"),
    ({**KIM, "mode": "voice_clone", "reference": "voices/x.wav"}, "reference"),
    ({**KIM, "pitch": 3}, "pitch"),
    ({**KIM, "instructions": "A voice."}, "instructions"),
    ([KIM], "body"),
    ("kim", "body"),
]


def test_bad_names_and_fields_are_a_400_naming_the_field(settings: Settings, start_gateway: StartGateway) -> None:
    gateway = start_gateway(settings)
    with http(gateway, api_key(settings)) as api:
        for body, param in BAD_VOICES:
            refused = api.post("/v1/audio/voices", json=body)
            assert refused.status_code == 400, (body, refused.text)
            error = refused.json()["error"]
            assert (error["param"], error["type"]) == (param, "invalid_request_error"), (body, error)
        not_json = api.post("/v1/audio/voices", content=b"{name", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and not_json.json()["error"]["param"] == "body"
        for method in ("GET", "DELETE"):
            assert api.request(method, "/v1/audio/voices/kim%20kim").json()["error"]["param"] == "name"
            assert api.request(method, "/v1/audio/voices/nobody").status_code == 404
        assert api.get("/v1/audio/voices").json()["data"] == []  # nothing refused was kept


def record(name: str, **changes: Any) -> str:
    """A record as ttsq writes it for ``name``, with ``changes``."""
    return json.dumps({**json.loads(NamedVoice.create({**KIM, "name": "x"}).record()), "name": name, **changes})


#: Records that are not what ttsq writes, as someone with access to Redis could leave them.
CORRUPT = {
    "not-json": "{",
    "a-list": "[]",
    "no-seed": json.dumps({k: v for k, v in json.loads(record("no-seed")).items() if k != "seed"}),
    "odd-field": record("odd-field", pitch=3),
    "text-seed": record("text-seed", seed="7"),
    "klingon": record("klingon", language="klingon"),
    "no-time": record("no-time", created_at="yesterday"),
    "renamed": record("someone-else"),
    "Not A Name": record("Not A Name"),
}


def test_a_corrupt_record_is_a_clear_error_never_a_crash(settings: Settings, start_gateway: StartGateway) -> None:
    cache = redis.Redis.from_url(settings.cache_url, decode_responses=True)
    cache.hset(NAMED_VOICES_KEY, mapping=CORRUPT)
    cache.hset(NAMED_VOICES_KEY, "kim", record("kim"))
    for name, raw in CORRUPT.items():
        with pytest.raises(CorruptRecord, match="named voice"):
            NamedVoice.from_record(name, raw)
    gateway = start_gateway(settings)
    token = api_key(settings)
    with http(gateway, token) as api:
        listed = {voice["id"]: voice for voice in api.get("/v1/audio/voices").json()["data"]}
        assert set(listed) == {*CORRUPT, "kim"} and "error" not in listed["kim"]
        assert all("refused named voice" in listed[name]["error"] for name in CORRUPT)
        assert "seed" in listed["text-seed"]["error"] and "language" in listed["klingon"]["error"]
        used = api.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hello.", "voice": "text-seed"})
        assert used.status_code == 502 and used.json()["error"]["code"] == "corrupt_record"
        assert "text-seed" in used.json()["error"]["message"]
        assert api.get("/v1/audio/voices/klingon").json()["error"]["code"] == "corrupt_record"
        for name in CORRUPT:  # each can be deleted, by the name it is listed under
            assert api.delete(f"/v1/audio/voices/{name}").status_code == 200, name
        assert [voice["id"] for voice in api.get("/v1/audio/voices").json()["data"]] == ["kim"]
    assert "Traceback" not in gateway.log()


def test_a_voice_without_a_seed_gets_one_that_stays() -> None:
    voice = NamedVoice.create({"name": "kim", "instruct": "A calm voice."})
    assert 0 <= voice.seed < 2**31 and NamedVoice.from_record("kim", voice.record()) == voice
    assert voice.fields() == {
        "mode": "voice_design",
        "language": "auto",
        "seed": voice.seed,
        "instruct": "A calm voice.",
    }
    with pytest.raises(InvalidRequest, match="instruct"):
        NamedVoice.create({"name": "kim", "mode": "voice_design"})
    speaker = NamedVoice.create({"name": "ryan-calm", "mode": "custom_voice", "speaker": "Ryan", "seed": 1})
    assert speaker.fields() == {"mode": "custom_voice", "language": "auto", "seed": 1, "speaker": "ryan"}


@pytest.mark.slow
def test_the_command_line_round_trip(settings: Settings, start_gateway: StartGateway) -> None:
    added = run_cli(
        "voices", "named", "add", "narrator-kim", "--instruct", str(KIM["instruct"]), "--language", "ko", "--json",
        settings=settings,
    )  # fmt: skip
    assert added.returncode == 0, added.stderr.decode()
    voice = json.loads(added.stdout)
    assert (voice["id"], voice["language"], voice["mode"]) == ("narrator-kim", "korean", "voice_design")
    assert isinstance(voice["seed"], int)  # drawn, and kept
    again = run_cli("voices", "named", "add", "narrator-kim", "--instruct", "Another.", settings=settings)
    assert again.returncode == 2 and again.stderr.decode().strip() == (
        "ttsq: error: invalid name: a voice named 'narrator-kim' exists; delete it first"
    )
    bad = run_cli("voices", "named", "add", "kim/../x", "--instruct", "A voice.", settings=settings)
    assert bad.returncode == 2 and bad.stderr.decode().startswith("ttsq: error: invalid name:")
    assert len(bad.stderr.decode().splitlines()) == 1

    # What the command line keeps, the gateway serves.
    gateway = start_gateway(settings)
    with http(gateway, api_key(settings)) as api:
        assert api.get("/v1/audio/voices/narrator-kim").json()["seed"] == voice["seed"]
    listed = run_cli("voices", "named", "list", "--json", settings=settings)
    assert [row["id"] for row in json.loads(listed.stdout)] == ["narrator-kim"]
    line = run_cli("voices", "named", "list", settings=settings).stdout.decode()
    assert line.startswith(f"narrator-kim  voice_design  korean  seed {voice['seed']}  A calm")
    deleted = run_cli("voices", "named", "delete", "Narrator-Kim", settings=settings)
    assert deleted.returncode == 0 and deleted.stdout.decode().strip() == "deleted narrator-kim"
    gone = run_cli("voices", "named", "delete", "narrator-kim", settings=settings)
    assert gone.returncode == 2 and "no named voice" in gone.stderr.decode()
    assert run_cli("voices", "named", "list", settings=settings).stdout.decode().startswith("no named voices")
