"""The public results: the one place that builds a result from what is stored and signs its URL.

A result is plain JSON (``JobResult``, ``DocumentResult``): the stored audio's facts, the key, and a
URL presigned when the result is made, never stored, so a stale URL can always be refreshed from the
object key. Workers build results after storing; producers build them on a cache hit and when they
read a result back.

Whatever is read back from Redis (a result, a cache index entry) is data, not a path: its
``object_key`` must be one ``ttsq.keys.object_key`` makes before storage or a download touches it,
and its URL is made here again, never taken from the record. A forged record is a ``CorruptRecord``.

``read_result`` is the one reader of what Celery's result backend stores for a job (``Client.wait``,
``Client.status``, the gateway's waiter and the sweeper all go through it): a final state becomes the
result or the typed ttsq error the job failed with, rebuilt from ``ttsq.errors`` alone, never from a
module the record names.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from ttsq.alignment import parse_words, words_to_json
from ttsq.constants import REQUEUED_STATE
from ttsq.errors import CorruptRecord, JobError, JobFailed, TTSQError
from ttsq.job import JobResult, no_timings
from ttsq.keys import is_object_key, is_words_key
from ttsq.redaction import printable

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.document import DocumentResult
    from ttsq.job import StoredAudio, Timings
    from ttsq.storage import Storage

logger = logging.getLogger(__name__)

# Celery's state names (``celery.states``), spelled here so the core needs no Celery to read them.
SUCCESS, FAILURE, REVOKED, PENDING = "SUCCESS", "FAILURE", "REVOKED", "PENDING"
#: A job in one of these states has its result or its error; nothing will change it.
FINAL_STATES = frozenset({SUCCESS, FAILURE, REVOKED})


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
        """The result of ``ttsq.synthesize`` for stored audio (with its words, when they are stored)."""
        # A dict, cast: mypy cannot see that ``stored`` may bring ``words_key`` and leaves out ``words``.
        result = cast(
            "JobResult",
            {
                "key": key,
                "url": self.sign(stored["object_key"]),
                "url_expires_s": self.expires_s,
                "cached": cached,
                **stored,
                "batch_size": batch_size,
                "timings": timings or no_timings(),
                "worker": self.worker,
            },
        )
        if "words_key" in stored:
            result["words"] = self.words(stored["words_key"])
        return result

    def words(self, key: object) -> list[dict[str, Any]]:
        """The word times stored under ``key`` (an index entry's ``words_key``, read back: checked)."""
        try:
            value = json.loads(self._storage().get(checked_words_key(key)))
        except ValueError:
            raise CorruptRecord("words", "stored word times are not JSON") from None
        return words_to_json(parse_words(value))

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
        if "words_key" in record["audio"]:
            base["words"] = self.words(record["audio"]["words_key"])
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


def checked_words_key(value: object) -> str:
    """``value`` if it is a key ttsq stores word times under (``ttsq.keys.words_key``); else ``CorruptRecord``."""
    if not is_words_key(value):
        raise CorruptRecord("words_key", f"{str(value)[:100]!r} is not a key ttsq stores word times under")
    return str(value)


@dataclass(frozen=True)
class Failure:
    """A failed job's exception as its worker raised it: its type's name and its arguments."""

    kind: str
    args: tuple[Any, ...]
    #: ``str()`` of the exception.
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"

    @property
    def reason(self) -> str:
        """Its last argument: for an error that names a field first, the reason alone."""
        return str(self.args[-1]) if self.args else ""


@dataclass(frozen=True)
class StoredResult:
    """What the result backend holds for a job, read: its state and, once final, its result or error."""

    task_id: str
    state: str
    #: The stored result, for SUCCESS (its URL as the worker signed it: ``Results.refresh`` signs anew).
    result: JobResult | None = None
    #: The exception stored for FAILURE and REVOKED.
    failure: Failure | None = None
    #: What a waiter raises for FAILURE and REVOKED: the ttsq error the job failed with, else ``JobFailed``.
    error: TTSQError | None = None
    #: A document's progress, for PROGRESS.
    progress: dict[str, Any] | None = None
    #: Why a job waits again, for REQUEUED (its worker died): one printable line.
    note: str | None = None

    @property
    def done(self) -> bool:
        """Whether the state is final."""
        return self.state in FINAL_STATES

    def value(self) -> JobResult:
        """The result; raise the job's error if it failed."""
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise JobError(f"job {self.task_id} is {self.state}, not done")
        return self.result


def read_result(raw: bytes | str | None, task_id: str) -> StoredResult:
    """Read the record Celery's Redis result backend keeps for ``task_id`` (None: nothing stored, so
    PENDING). Untrusted input: anything but what a worker stores is a ``CorruptRecord``."""
    if raw is None:
        return StoredResult(task_id, PENDING)
    try:
        meta = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise CorruptRecord("result", f"of job {task_id[:80]} cannot be read") from None
    return read_meta(meta, task_id)


def read_meta(meta: object, task_id: str) -> StoredResult:
    """``read_result`` for a record already parsed from JSON."""
    if not isinstance(meta, dict):
        raise CorruptRecord("result", f"of job {task_id[:80]} is not a JSON object")
    state, value = meta.get("status"), meta.get("result")
    if not isinstance(state, str) or not state:
        raise CorruptRecord("result", f"of job {task_id[:80]} has no state")
    if state == SUCCESS:
        if not isinstance(value, dict):
            raise CorruptRecord("result", f"of job {task_id[:80]} is a {type(value).__name__}, not a JSON object")
        return StoredResult(task_id, state, result=cast("JobResult", value))
    if state in (FAILURE, REVOKED):
        failure, error = _failure(value, task_id)
        if not isinstance(error, TTSQError) or state == REVOKED:
            error = JobFailed(f"job {task_id} failed: {failure}")
        return StoredResult(task_id, state, failure=failure, error=error)
    if state == "PROGRESS":  # ttsq.constants.PROGRESS_STATE: a document's chunks done so far
        if not isinstance(value, dict):
            raise CorruptRecord("result", f"progress of job {task_id[:80]} is not a JSON object")
        return StoredResult(task_id, state, progress=value)
    if state == REQUEUED_STATE:
        reason = value.get("reason") if isinstance(value, dict) else None
        return StoredResult(task_id, state, note=printable(reason, 200) if isinstance(reason, str) else None)
    return StoredResult(task_id, state)  # PENDING, STARTED, RETRY: not final, nothing to read yet


def _failure(stored: object, task_id: str) -> tuple[Failure, TTSQError | None]:
    """The exception Celery stored (``{"exc_type", "exc_message", "exc_module"}``) and, when it is one
    of ttsq's errors, that error rebuilt."""
    kind = stored.get("exc_type") if isinstance(stored, dict) else None
    if not isinstance(stored, dict) or not isinstance(kind, str) or not kind:
        raise CorruptRecord("result", f"of job {task_id[:80]} holds no exception")
    message = stored.get("exc_message", "")
    # Celery calls the class with the list as its arguments, or with anything else as the one argument.
    args = tuple(message) if isinstance(message, list) else (message,)
    cls = _ttsq_errors().get(kind) if stored.get("exc_module") == TTSQError.__module__ else None
    if cls is None:
        return Failure(kind, args, str(Exception(*args))), None
    try:
        error = cls(*args)
    except TypeError:  # the wrong arguments for that error: not what a worker stored
        raise CorruptRecord("result", f"of job {task_id[:80]} holds a {kind} ttsq cannot rebuild") from None
    return Failure(kind, args, str(error)), error


@functools.cache
def _ttsq_errors() -> dict[str, type[TTSQError]]:
    """Every error class of ``ttsq.errors``, by name: the only classes a stored failure is rebuilt as."""
    found: dict[str, type[TTSQError]] = {}
    todo: list[type[TTSQError]] = [TTSQError]
    while todo:
        cls = todo.pop()
        if cls.__module__ == TTSQError.__module__:
            found[cls.__qualname__] = cls
        todo.extend(cls.__subclasses__())
    return found
