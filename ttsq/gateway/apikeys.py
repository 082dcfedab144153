"""API keys of the HTTP gateway: bearer tokens stored hashed in Redis, with a rate limit and a quota.

``ttsq keys add NAME`` prints a token once (``ttsq_`` and 43 random characters); Redis keeps only its
SHA-256, with the key's name, short id, limits and revocation time, so a copy of Redis holds no usable
token. Every gateway replica checks a request in one Lua call (``ttsq/records/lua/authorize.lua``), so
the limits hold across all of them:

- a **rate limit** in requests per minute (a fixed window per key and minute; refused with the seconds
  to the next minute as ``Retry-After``);
- a **quota** in seconds of audio per UTC day, charged when audio is served (``charge.lua``; refused
  once used up, until midnight UTC).

A revoked key is refused (403), an unknown one unauthenticated (401).
"""

from __future__ import annotations

import hashlib
import math
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ttsq.constants import APIKEY_IDS_KEY, APIKEY_PREFIX, QUOTA_PREFIX, RATE_PREFIX
from ttsq.errors import InvalidRequest
from ttsq.job import LANES

if TYPE_CHECKING:
    import redis

#: The prefix of every token: a secret scanner (and a person) can tell it is a ttsq key.
TOKEN_PREFIX = "ttsq_"
#: How long a day's quota counter lives (seconds): the day, and one more for clocks that differ.
QUOTA_TTL_S = 2 * 86_400


def token_hash(token: str) -> str:
    """What Redis keeps of a token: its SHA-256, hex."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def windows(now: float) -> tuple[int, int, int, int]:
    """(minute, day, seconds to the next minute, seconds to midnight UTC) of a Unix time."""
    minute, day = int(now // 60), int(now // 86_400)
    return minute, day, max(1, int((minute + 1) * 60 - now)), max(1, int((day + 1) * 86_400 - now))


def authorize_args(now: float) -> list[Any]:
    """The ARGV of the ``authorize`` script at ``now``."""
    minute, day, to_minute, to_midnight = windows(now)
    return [RATE_PREFIX, QUOTA_PREFIX, minute, day, to_minute, to_midnight]


def quota_key(key_id: str, now: float) -> str:
    """The counter of a key's audio (milliseconds) on the UTC day of ``now``."""
    return f"{QUOTA_PREFIX}{key_id}:{int(now // 86_400)}"


def audio_ms(audio_s: float) -> int:
    """What a charge of ``audio_s`` seconds adds to a quota counter: milliseconds, rounded up."""
    return max(1, math.ceil(audio_s * 1000))


def charged_key(key_id: str, job_id: str) -> str:
    """The mark that a key was charged for a job's audio."""
    return f"{QUOTA_PREFIX}{key_id}:charged:{job_id}"


@dataclass(frozen=True)
class ApiKey:
    """A key as ``ttsq keys list`` shows it: never its token."""

    id: str
    name: str
    created_at: float
    revoked_at: float | None
    #: Requests per minute (0: no limit).
    rate_per_min: int
    #: Seconds of audio per UTC day (0: no quota).
    quota_audio_s: float
    #: The lane of this key's jobs that name none ("": each kind of request's own default).
    lane: str = ""

    def summary(self, used_today_s: float = 0.0) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "created_at": self.created_at,
            "revoked_at": self.revoked_at,
            "rate_per_min": self.rate_per_min,
            "quota_audio_s": self.quota_audio_s,
            "lane": self.lane or None,
            "used_today_s": round(used_today_s, 3),
        }


class ApiKeys:
    """Adding, listing and revoking keys (the command line; the gateway only authorizes)."""

    def __init__(self, client: redis.Redis) -> None:
        self._redis = client

    def add(
        self, name: str, *, rate_per_min: int = 0, quota_audio_s: float = 0.0, lane: str = ""
    ) -> tuple[str, ApiKey]:
        """A new key; return its token (shown once, never stored) and its record."""
        if not name or len(name) > 64 or not name.isprintable():
            raise InvalidRequest("name", "must be 1-64 printable characters")
        if rate_per_min < 0 or quota_audio_s < 0:
            raise InvalidRequest("limits", "must be 0 (none) or more")
        if lane and lane not in LANES:
            raise InvalidRequest("lane", f"expected one of {', '.join(LANES)}")
        if any(key.name == name and key.revoked_at is None for key in self.list()):
            raise InvalidRequest("name", f"a key named {name!r} exists; revoke it first or choose another name")
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        digest = token_hash(token)
        key = ApiKey(
            id=digest[:12],
            name=name,
            created_at=time.time(),
            revoked_at=None,
            rate_per_min=rate_per_min,
            quota_audio_s=float(quota_audio_s),
            lane=lane,
        )
        with self._redis.pipeline() as pipe:
            pipe.hset(
                APIKEY_PREFIX + digest,
                mapping={
                    "id": key.id,
                    "name": name,
                    "created_at": key.created_at,
                    "rate_per_min": rate_per_min,
                    "quota_audio_s": quota_audio_s,
                    "lane": lane,
                },
            )
            pipe.hset(APIKEY_IDS_KEY, key.id, digest)
            pipe.execute()
        return token, key

    def list(self) -> list[ApiKey]:
        """Every key, oldest first."""
        digests = self._redis.hgetall(APIKEY_IDS_KEY)
        keys = [key for digest in digests.values() if (key := self._get(_text(digest))) is not None]
        return sorted(keys, key=lambda key: key.created_at)

    def revoke(self, name_or_id: str) -> ApiKey:
        """Revoke the live key with this name or id; ``InvalidRequest`` if there is none."""
        for key in self.list():
            if key.revoked_at is None and name_or_id in (key.name, key.id):
                digest = _text(self._redis.hget(APIKEY_IDS_KEY, key.id))
                now = time.time()
                self._redis.hset(APIKEY_PREFIX + digest, "revoked_at", now)
                return ApiKey(**{**key.__dict__, "revoked_at": now})
        raise InvalidRequest("key", f"no live key named {name_or_id!r} (see `ttsq keys list`)")

    def used_today(self, key: ApiKey, now: float | None = None) -> float:
        """Audio seconds the key was served today (UTC)."""
        return int(self._redis.get(quota_key(key.id, time.time() if now is None else now)) or 0) / 1000

    def _get(self, digest: str) -> ApiKey | None:
        raw = {_text(k): _text(v) for k, v in self._redis.hgetall(APIKEY_PREFIX + digest).items()}
        if "id" not in raw:
            return None
        return ApiKey(
            id=raw["id"],
            name=raw.get("name", ""),
            created_at=float(raw.get("created_at", 0)),
            revoked_at=float(raw["revoked_at"]) if raw.get("revoked_at") else None,
            rate_per_min=int(float(raw.get("rate_per_min", 0))),
            quota_audio_s=float(raw.get("quota_audio_s", 0)),
            lane=raw.get("lane", ""),
        )


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
