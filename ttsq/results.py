"""The public results: the one place that builds a result from what is stored and signs its URL.

A result is plain JSON (``JobResult``, ``DocumentResult``): the stored audio's facts, the key, and a
URL presigned when the result is made, never stored, so a stale URL can always be refreshed from the
object key. Workers build results after storing; producers build them on a cache hit and when they
read a result back.

Whatever is read back from Redis (a result, a cache index entry) is data, not a path: its
``object_key`` must be one ``ttsq.keys.object_key`` makes before storage or a download touches it,
and its URL is made here again, never taken from the record. A forged record is a ``CorruptRecord``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from ttsq.errors import CorruptRecord
from ttsq.job import JobResult, no_timings
from ttsq.keys import is_object_key

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.document import DocumentResult
    from ttsq.job import StoredAudio, Timings
    from ttsq.storage import Storage

logger = logging.getLogger(__name__)


class Results:
    """Builds results for one deployment: its storage signs the URLs, its settings give their lifetime.

    ``storage`` is called when a URL is first needed (a producer that never signs never opens boto3).
    ``worker`` is the node name results made here carry ("" on a producer).
    """

    def __init__(self, settings: Settings, storage: Callable[[], Storage], *, worker: str = "") -> None:
        self.expires_s = settings.url_expiry_s
        self._storage = storage
        self.worker = worker

    def sign(self, object_key: str) -> str:
        """A URL for a stored object, valid for ``TTSQ_URL_EXPIRY_S``."""
        return self._storage().url(checked_key(object_key), self.expires_s)

    def download(self, result: JobResult) -> bytes:
        """The audio bytes of a result, read through ttsq's storage (never through the result's URL)."""
        return self._storage().get(checked_key(result.get("object_key")))

    def job(
        self, key: str, stored: StoredAudio, *, cached: bool, batch_size: int = 0, timings: Timings | None = None
    ) -> JobResult:
        """The result of ``ttsq.synthesize`` for stored audio."""
        return JobResult(
            key=key,
            url=self.sign(stored["object_key"]),
            url_expires_s=self.expires_s,
            cached=cached,
            **stored,
            batch_size=batch_size,
            timings=timings or no_timings(),
            worker=self.worker,
        )

    def document(self, record: dict[str, Any], *, cached: bool) -> DocumentResult:
        """The result of ``ttsq.document`` for a stitched document's index record."""
        base: dict[str, Any] = dict(record["audio"])
        base.update(
            key=record["key"],
            url=self.sign(record["audio"]["object_key"]),
            url_expires_s=self.expires_s,
            cached=cached,
            batch_size=0,
            timings=no_timings(),
            worker=self.worker,
            document=record["document"],
            chunks=record["chunks"],
        )
        return cast("DocumentResult", base)

    def refresh(self, result: JobResult) -> JobResult:
        """The same result with a URL presigned now (the stored one may have expired)."""
        if not isinstance(result, dict):
            raise CorruptRecord("result", f"is a {type(result).__name__}, not a JSON object")
        key = checked_key(result.get("object_key"))
        try:
            url = self.sign(key)
        except Exception:  # no credentials on this producer: the worker's URL is the best we have
            logger.debug("could not presign a fresh URL; keeping the worker's")
            kept = result.get("url")
            if not (isinstance(kept, str) and kept.startswith(("https://", "http://"))):
                raise CorruptRecord("url", "is not an http(s) URL, and no fresh one could be signed") from None
            return result
        return {**result, "url": url, "url_expires_s": self.expires_s}


def checked_key(value: object) -> str:
    """``value`` if it is an object key ttsq makes (``audio/<2 hex>/<64 hex>.<format>``); else ``CorruptRecord``."""
    if not is_object_key(value):
        raise CorruptRecord("object_key", f"{str(value)[:100]!r} is not a key ttsq stores audio under")
    return str(value)
