from __future__ import annotations

import time

import redis

from ttsq.config import Settings
from ttsq.errors import BrokerError
from ttsq.job import StoredAudio
from ttsq.ops.redis_server import free_port
from ttsq.records.owner import RedisOwner

ENTRY = StoredAudio(
    object_key="audio/ab/ab.wav",
    format="wav",
    content_type="audio/wav",
    sample_rate=22050,
    duration_s=1.5,
    bytes=100,
    engine="espeak",
    model="espeak-ng",
    model_revision="1.52.0",
    truncated=False,
)


def test_index_round_trip_with_ttl(settings: Settings, redis_client: redis.Redis) -> None:
    index = RedisOwner(settings.replace(cache_ttl_s=100), role="test").cache_index
    assert index.get("ab") is None
    index.put("ab", ENTRY)
    assert index.get("ab") == ENTRY
    ttl = redis.Redis.from_url(settings.cache_url).ttl("ttsq:cache:ab")
    assert 90 < ttl <= 100


def test_claim_is_single_flight_and_release_is_owner_only(settings: Settings) -> None:
    index = RedisOwner(settings, role="test").cache_index
    assert index.claim("k", "task-1", 60) is None
    assert index.claim("k", "task-2", 60) == "task-1"
    index.release("k", "task-2")  # not the owner: no effect
    assert index.claim("k", "task-3", 60) == "task-1"
    index.release("k", "task-1")
    assert index.claim("k", "task-3", 60) is None


def test_identities_of_live_workers(settings: Settings) -> None:
    identities = RedisOwner(settings, role="test").identities
    identities.publish("q", {"engine": "espeak", "revision": "1", "modes": ["voice_design"]})
    identities.publish("q", {"engine": "qwen", "revision": "2", "modes": ["voice_clone"]})
    assert identities.read("q") == {
        "voice_design": {"engine": "espeak", "revision": "1", "modes": ["voice_design"]},
        "voice_clone": {"engine": "qwen", "revision": "2", "modes": ["voice_clone"]},
    }
    # A worker that stopped re-announcing is gone: its modes are no longer served.
    time.sleep(1.1)
    identities.publish("q", {"engine": "qwen", "revision": "2", "modes": ["voice_clone"]})
    assert set(identities.read("q", max_age_s=1.0)) == {"voice_clone"}
    assert identities.read("another-deployment") == {}


def test_unreachable_redis_is_a_broker_error_without_the_password(settings: Settings) -> None:
    index = RedisOwner(
        settings.replace(cache_url=f"redis://:hunter2@127.0.0.1:{free_port()}/0"), role="test"
    ).cache_index
    try:
        index.get("x")
    except BrokerError as exc:
        assert "hunter2" not in str(exc) and "***" in str(exc)
    else:
        raise AssertionError("expected BrokerError")
