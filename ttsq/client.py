"""The producer side: validate, short-circuit from the cache, single flight, enqueue, wait.

``submit`` validates at the edge (including what the fleet can serve), predicts the content key from
the model the workers of that mode announced, answers a cache hit at once, claims the key so that a
concurrent identical submit from any host gets the running job, and sends the task to its mode's queue.
The steps: README.md, "How one job flows"; before any worker has announced itself: docs/guarantees.md,
"Design notes and limits", and docs/qwen.md, "Modes and queues".

Why one file over 400 lines: every producer call (submit, documents, wait, status, cancel) shares
the same claim, ledger and result-reading steps, and splitting them would scatter one protocol.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from celery import states

import ttsq.tracing as tracing
from ttsq.app import lane_for, make_app, queue_for, queues_for, stored_result
from ttsq.constants import (
    CLAIM_HEADER,
    DOCUMENT_TASK_NAME,
    IDENTITY_TTL_S,
    SENT_AT_HEADER,
    TASK_NAME,
    WORKER_REDIS_PATIENCE_S,
)
from ttsq.delivery.broker import message_held
from ttsq.document import Document, DocumentJoin, Options
from ttsq.engines.base import EngineIdentity
from ttsq.errors import (
    BrokerError,
    CorruptRecord,
    InvalidRequest,
    JobFailed,
    JobTimeout,
    StreamBroken,
    TTSQError,
    UnknownJob,
)
from ttsq.job import JobResult, Limits, RequestFields, SynthesisRequest, turn_of
from ttsq.keys import content_key
from ttsq.records.attempts import ParkedJob
from ttsq.records.connection import patiently
from ttsq.records.owner import RedisOwner
from ttsq.records.plans import chunk_task_ids
from ttsq.records.playback import (
    STALL_S,
    STATE_CHECK_S,
    Broken,
    CheckState,
    Done,
    Failed,
    FromStored,
    Play,
    Playback,
    WordFeed,
    Words,
    result_words,
)
from ttsq.results import Results
from ttsq.sending import WITHDRAW_PATIENCE_S, Outgoing, send_job, sending
from ttsq.storage import Storage, open_storage

if TYPE_CHECKING:
    from celery import Celery
    from celery.result import AsyncResult
    from typing_extensions import Unpack

    from ttsq.alignment import Word
    from ttsq.config import Settings
    from ttsq.results import StoredResult

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class Job:
    """A submitted job: a cache hit (``result`` already set) or a task to wait for."""

    id: str | None
    key: str | None
    client: Client = field(repr=False)
    result: JobResult | None = None
    #: True when this submit joined a job another producer had already started.
    joined: bool = False
    #: A document job: how many chunk jobs it fans out into (0 for an ordinary job).
    chunks: int = 0
    #: The job whose synthesis this one follows, when it joined another tenant's identical job: that
    #: job's stream and result carry the audio, while ``id`` stays this tenant's own (docs/security.md,
    #: "Tenants"). None for a job that is its own synthesis.
    source: str | None = None

    @property
    def source_id(self) -> str | None:
        """The id whose stream and stored result carry this job's audio (``source``, else ``id``)."""
        return self.source or self.id

    @property
    def cached(self) -> bool:
        """Whether the result came from the cache without a new job."""
        return self.result is not None and self.result["cached"]

    def wait(self, timeout: float | None = None) -> JobResult:
        """Block until the job is done; raise ``JobTimeout`` or the job's own error."""
        if self.result is None:
            if self.id is None:
                raise JobFailed("a job with neither a result nor a task id")
            self.result = self.client.wait(self.id, timeout=timeout)
        return self.result


@dataclass(frozen=True)
class AudioPiece:
    """A piece of a streamed job's audio: 16-bit mono PCM, little-endian, at ``sample_rate``; for a job
    that asked for timestamps, ``words``: the words this piece completes (seconds of the whole clip or
    document). A piece may carry words and no audio: words known only after their audio was read."""

    pcm: bytes
    sample_rate: int
    words: tuple[Word, ...] = ()


#: Seconds of audio per piece when a stream is read from a stored file (a cache hit).
STORED_PIECE_S = 0.5
#: How long a started stream may go without a new piece before its reader gives up on it (seconds):
#: the worker stalled or died; the job itself comes back by redelivery and completes.
STREAM_STALL_S = STALL_S
#: While a streaming job plays nothing (not started, or its reader waits for the stored file), its
#: reader looks at the job's state this often, so a job cancelled or failed before it started ends the
#: stream.
STREAM_STATE_CHECK_S = STATE_CHECK_S


class AudioStream:
    """A streaming job: iterate it for ``AudioPiece``s as the worker makes them; ``result`` is the job's
    result once the last piece has been read (``Client.stream``).

    A cache hit, or a job that joined an identical one that is not streaming, plays the stored file.
    A reader that comes late, falls behind the stream's window (``TTSQ_STREAM_WINDOW_S``) or comes back
    after it expired continues from the stored file at the sample it had reached, once the job is done:
    the same samples. A stream that breaks (its worker died after pieces were read, or stalled for
    ``STREAM_STALL_S``) raises ``StreamBroken``: never a short clip that looks complete. The job still
    completes; ``wait`` on ``job.id`` for its result. The rules are ``ttsq.records.playback``'s, shared
    with the gateway; this drives them with blocking reads."""

    def __init__(self, client: Client, job: Job, *, timeout: float | None) -> None:
        self.client = client
        self.job = job
        self.timeout = timeout
        self.result: JobResult | None = job.result

    def __iter__(self) -> Generator[AudioPiece, None, None]:
        if self.job.result is not None:
            yield from self._stored(self.job.result)
            return
        assert self.job.source_id is not None
        task_id, streams = self.job.source_id, self.client.redis.streams
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        playback = Playback(
            task_id, now=time.monotonic(), first_audio_by=deadline, stall_s=STREAM_STALL_S, check_s=STREAM_STATE_CHECK_S
        )
        after = "0-0"
        while True:
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeout(f"job {task_id} not streamed within {self.timeout}s")
            entries = streams.read(task_id, after=after, block_s=1.0)
            if entries:
                after = entries[-1].id
            actions = playback.entries(entries, time.monotonic())
            if actions and isinstance(actions[-1], CheckState):
                if self.client._state(task_id) not in states.READY_STATES:
                    continue
                # Over: what the stream still holds comes first; nothing more, and the stored file has it.
                entries = streams.read(task_id, after=after, block_s=0.001)
                if entries:
                    after = entries[-1].id
                    actions = playback.entries(entries, time.monotonic())
                else:
                    actions = playback.job_over()
            for action in actions:
                if isinstance(action, Play):
                    yield AudioPiece(action.pcm, action.sample_rate, action.words)
                elif isinstance(action, Words):
                    yield AudioPiece(b"", playback.sample_rate, action.words)
                elif isinstance(action, FromStored):
                    result = self.client.wait(task_id, timeout=self.timeout)
                    yield from self._stored(result, action.offset, playback.words)
                    return
                elif isinstance(action, Done | Failed):
                    # The job's own stored result says how it ended, read the one way results are.
                    self.result = self.client.wait(task_id, timeout=self.timeout)
                    return
                elif isinstance(action, Broken):
                    if action.code == "timeout":
                        raise JobTimeout(f"job {task_id} not streamed within {self.timeout}s")
                    if action.code == "corrupt_record":
                        raise CorruptRecord(f"job {task_id}'s stream", action.message)
                    raise StreamBroken(action.message)

    def _stored(self, result: JobResult, offset: int = 0, words: WordFeed | None = None) -> Iterator[AudioPiece]:
        """The stored file's samples from ``offset`` on, with the words of the result that ``words`` (what
        the stream handed out) has not said yet."""
        from ttsq.audio import decode, pcm_pieces

        self.result = result
        feed = words or WordFeed()
        feed.learn(result_words(result))
        samples, rate = decode(self.client.download(result))
        played = offset
        for pcm in pcm_pieces(samples[offset:], rate, STORED_PIECE_S):
            played += len(pcm) // 2
            yield AudioPiece(pcm, rate, feed.due(played / rate))
        if rest := feed.rest():
            yield AudioPiece(b"", rate, rest)


class DocumentStream(AudioStream):
    """A streaming document: iterate it for the stitched file's audio, chunk by chunk in reading order,
    while later chunks are still being made (``Client.stream_document``); ``result`` is the document's
    result once the last piece has been read.

    Each chunk is played once it is complete (from its chunk job's stream, or the cache), joined to
    the one before with the stitch's own crossfade or pause: a WAV document plays the samples of the
    stored file, byte for byte. A chunk whose job is run again (its worker died) is simply read again:
    nothing of it was played yet. A cache hit plays the stored file at once."""

    def __iter__(self) -> Generator[AudioPiece, None, None]:
        if self.job.result is not None:
            yield from self._stored(self.job.result)
            return
        assert self.job.source_id is not None
        doc_id = self.job.source_id
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        plan = self._plan(doc_id, deadline)
        if plan is None:  # the document ended before its plan could be read: its result says how
            yield from self._stored(self.client.wait(doc_id, timeout=self.timeout))
            return
        import numpy as np

        joined = DocumentJoin(plan)
        ids = dict(zip(joined.unique_keys(), chunk_task_ids(doc_id, len(joined.unique_keys())), strict=True))
        feed, played = WordFeed(), 0  # the document's words so far, each chunk's moved to where it starts
        for index, chunk in enumerate(joined.chunks):
            words: list[Word] = []
            if chunk["key"]:
                samples, rate, words = self._chunk(chunk["key"], ids[chunk["key"]], doc_id, deadline)
            else:
                samples, rate = np.zeros(0, dtype=np.float32), joined.rate
            pieces = joined.add(index, samples, rate)
            if words:
                start_s = joined.start_s(index)
                feed.learn([word.shifted(start_s) for word in words], len(feed.known))
            for pcm in pieces:
                played += len(pcm) // 2
                yield AudioPiece(pcm, joined.rate, feed.due(played / joined.rate))
        for pcm in joined.finish():
            played += len(pcm) // 2
            yield AudioPiece(pcm, joined.rate, feed.due(played / joined.rate))
        if rest := feed.rest():
            yield AudioPiece(b"", joined.rate, rest)
        self.result = self.client.wait(doc_id, timeout=self._left(deadline))

    def _plan(self, doc_id: str, deadline: float | None) -> Any:
        """The document's plan once its fan-out has stored it; None if the document ended first."""
        last_check = time.monotonic()
        while (plan := self.client.redis.plans.load(doc_id)) is None:
            self._check_deadline(deadline, doc_id)
            time.sleep(0.05)
            if time.monotonic() - last_check > STREAM_STATE_CHECK_S:
                last_check = time.monotonic()
                if self.client._state(doc_id) in states.READY_STATES:
                    return None
        return plan

    def _chunk(self, key: str, task_id: str, doc_id: str, deadline: float | None) -> tuple[Any, int, list[Word]]:
        """One chunk's audio (float samples, rate) and words (in seconds of the chunk; none unless the
        document asked for timestamps), once complete: from its job's stream as it finishes, or from the
        cache (a chunk made before, or by a document that does not stream)."""
        import numpy as np

        from ttsq.audio import decode
        from ttsq.results import checked_key

        def cached(entry: Any) -> tuple[Any, int, list[Word]]:
            samples, rate = decode(self.client.storage.get(checked_key(entry.get("object_key"))))
            words = {"words": self.client.results.words(entry["words_key"])} if "words_key" in entry else {}
            return samples, rate, result_words(words)

        streams, after, rate = self.client.redis.streams, "0-0", 0
        pieces: list[bytes] = []
        whole = False  # every piece of the run so far was read (the stream keeps a window, not the clip)
        last_check = time.monotonic()
        while True:
            entry = self.client.cache.get(key)
            if entry is not None:
                return cached(entry)
            for item in streams.read(task_id, after=after, block_s=0.5):
                after = item.id
                if item.kind == "start":  # a first take, or a rerun: nothing of this chunk was played
                    pieces, rate, whole = [], item.sample_rate, True
                elif item.kind == "audio":
                    # A piece out of order: the ones before it were trimmed; the cache has the chunk
                    # once it is done (its end comes after the index entry).
                    whole = whole and item.seq == len(pieces)
                    pieces.append(item.pcm)
                elif item.kind == "end" and pieces and rate and whole:
                    pcm = np.frombuffer(b"".join(pieces), dtype="<i2")
                    words = result_words(item.payload, f"chunk {key[:12]}'s words")
                    return pcm.astype(np.float32) / np.float32(32768.0), rate, words
                elif item.kind == "error":  # the chunk failed: so does the document; its error says why
                    self.client.wait(doc_id, timeout=self._left(deadline))
                    raise JobFailed(f"document {doc_id}: a chunk failed")
                # an end with no audio: a cache hit at the worker; the index has it now
            self._check_deadline(deadline, doc_id)
            if time.monotonic() - last_check > STREAM_STATE_CHECK_S:
                last_check = time.monotonic()
                if self.client._state(doc_id) in states.READY_STATES:
                    self.client.wait(doc_id, timeout=self._left(deadline))  # raises the document's error
                    if (entry := self.client.cache.get(key)) is not None:
                        return cached(entry)
                    raise JobFailed(f"document {doc_id} ended without chunk {key[:12]}")

    def _check_deadline(self, deadline: float | None, doc_id: str) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise JobTimeout(f"document {doc_id} not streamed within {self.timeout}s")

    @staticmethod
    def _left(deadline: float | None) -> float | None:
        return None if deadline is None else max(1.0, deadline - time.monotonic())


#: A waiter reads a job's stored result again this often, besides listening for its publish.
WAIT_RECHECK_S = 2.0
#: How long a wait keeps trying while Redis cannot be reached (seconds, counted from the first failed
#: call in a row): as long as a worker rides out a Redis restart in its own calls, so the waiter
#: outlasts any outage the job it waits for outlasts.
WAIT_PATIENCE_S = WORKER_REDIS_PATIENCE_S
#: While Redis cannot be reached, a wait tries again this often (seconds).
WAIT_RETRY_S = 0.5


class Client:
    """A producer bound to one settings object. Cheap to keep, safe to share between threads."""

    def __init__(
        self,
        settings: Settings | None = None,
        *,
        app: Celery | None = None,
        admit: Callable[[str], None] | None = None,
        redis: RedisOwner | None = None,
    ) -> None:
        """``admit`` (the HTTP gateway's admission control) is called with a job's queue before it is
        accepted, after the cache has been asked: it raises to refuse the job, and nothing is queued.
        ``redis`` is the process's Redis owner where it has one (the gateway's); by default the client
        owns its own. Without ``settings`` the client reads ``TTSQ_*`` from the environment, as the
        command line does (``Settings.from_env()``)."""
        if settings is None:
            from ttsq.config import Settings

            settings = Settings.from_env()
        self.settings = settings
        self.admit = admit
        tracing.setup("ttsq-client")  # OTEL_* decides, once per process (docs/observability.md, "Traces")
        self.app = app or make_app(settings)
        self.redis = redis or RedisOwner(settings, role="client")
        self._owns_redis = redis is None
        self.cache = self.redis.cache_index
        self.stats = self.redis.stats
        self.limits = Limits.from_settings(settings)
        self.results = Results(settings, lambda: self.storage)
        self.accepted = self.redis.accepted
        self._storage: Storage | None = None
        self._identities: tuple[float, dict[str, EngineIdentity]] = (0.0, {})

    @property
    def storage(self) -> Storage:
        """The storage, opened on first use (boto3 clients are not free)."""
        if self._storage is None:
            self._storage = open_storage(self.settings)
        return self._storage

    def submit(self, text: str | None = None, **fields: Unpack[RequestFields]) -> Job:
        """Validate and enqueue one request (or answer it from the cache).

        ``fields`` are the request fields (``language="korean"``, ``instruct="..."``, ...); they are
        validated like untrusted input, so a wrong name or value is an ``InvalidRequest``.
        """
        data = self._scoped({"text": text, **fields} if text is not None else dict(fields))
        return self.submit_request(SynthesisRequest.from_dict(data, self.limits))

    def _scoped(self, data: dict[str, Any]) -> dict[str, Any]:
        """The request with its cache scope: its tenant's own with ``TTSQ_CACHE_SCOPE=tenant``."""
        tenant = data.get("tenant")
        if self.settings.cache_scope == "tenant" and tenant and not data.get("cache_scope"):
            return {**data, "cache_scope": tenant}
        return data

    def submit_request(self, request: SynthesisRequest) -> Job:
        """Enqueue an already validated request (design steps 2-5)."""
        if request.expired():
            raise InvalidRequest("deadline", f"{request.deadline} is already in the past")
        identity = self._serving(request.mode)
        if identity is not None:
            identity.check(request)
        self._check_reference(request.reference)
        key = content_key(request, identity) if identity is not None else None
        return self._enqueue(
            TASK_NAME,
            request.to_dict(),
            mode=request.mode,
            key=key,
            # What logs and Flower show instead of the kwargs: never the text.
            kwargsrepr=request.describe(),
            cached=self._cached,
        )

    def stream(self, text: str, *, timeout: float | None = None, **fields: Unpack[RequestFields]) -> AudioStream:
        """Submit ``text`` to be streamed: iterate the answer for its audio as the worker makes it.

        The job is an ordinary one (stored, cached, single flight) whose worker also writes its audio
        to a stream as soon as the engine has it, before encoding and storing the file. A cache hit
        plays the stored file at once.
        """
        request = SynthesisRequest.from_dict(self._scoped({"text": text, **fields, "stream": True}), self.limits)
        return AudioStream(self, self.submit_request(request), timeout=timeout)

    def stream_document(self, text: str, *, timeout: float | None = None, **fields: Any) -> DocumentStream:
        """Submit a document to be streamed: iterate the answer for the stitched file's audio, chunk by
        chunk in reading order, while later chunks are still being made (``DocumentStream``)."""
        return DocumentStream(self, self.submit_document(text, **fields, stream=True), timeout=timeout)

    def submit_document(self, text: str, **fields: Any) -> Job:
        """Validate and enqueue a document of any length (or answer it from the cache): one job that
        splits it, synthesizes each chunk as an ordinary job and stitches one file (``ttsq.document``).

        The job's id carries the stitched result (a ``DocumentResult``); while it runs, ``status``
        shows its progress. ``fields`` are the request fields for every chunk.
        """
        options = Options.from_settings(self.settings)
        data, most = self._scoped({"text": text, **fields}), self.settings.max_document_chars
        document = Document.parse(data, limits=self.limits, max_document_chars=most, default_options=options)
        mode = document.fields["mode"]
        identity = self._serving(mode)
        if identity is not None:  # again, with the limits of the model that will read it
            document = Document.parse(
                data, limits=self.limits, max_document_chars=most, identity=identity, default_options=options
            )
        self._check_reference(document.fields.get("reference") or "")
        kwargs = {
            "text": document.text,
            **{name: value for name, value in document.fields.items() if value is not None and value != ""},
            "options": asdict(document.options),
            **({"stream": True} if document.stream else {}),
            **({"lane": document.lane} if document.lane else {}),
            **({"tenant": document.tenant} if document.tenant else {}),
        }  # what it was validated and keyed with
        job = self._enqueue(
            DOCUMENT_TASK_NAME,
            kwargs,
            mode=mode,
            key=document.key(identity) if identity is not None else None,
            kwargsrepr=f"document of {len(document.text)} chars in {len(document.chunks)} chunks",
            cached=self._cached_document,
        )
        job.chunks = len(document.chunks)
        return job

    def _serving(self, mode: str) -> EngineIdentity | None:
        """The model the fleet serves ``mode`` with; None if no worker has announced one yet. A mode is
        refused only when the fleet is known and none of it serves that mode."""
        fleet = self.identities()
        identity = fleet.get(mode)
        if fleet and identity is None:
            raise InvalidRequest(
                "mode", f"no running worker serves {mode}; the workers online serve {', '.join(sorted(fleet))}"
            )
        return identity

    def _check_reference(self, reference: str) -> None:
        if reference and not self.storage.exists(reference):
            raise InvalidRequest("reference", f"no voice {reference} in storage; upload it with `ttsq voices add`")

    def _enqueue(
        self,
        task: str,
        kwargs: dict[str, Any],
        *,
        mode: str,
        key: str | None,
        kwargsrepr: str,
        cached: Callable[[str], Job | None],
    ) -> Job:
        """The one way a job is sent (design steps 3-5): answered from the cache, joined to the job
        already producing its key (single flight), or claimed and sent; a claim never outlives a send
        that failed. Without a key (no worker announced yet) it is simply sent."""
        serving = self._identities[1].get(mode)  # what ``_serving`` just read
        lane = lane_for(task, kwargs)
        kwargs = {**kwargs, "lane": lane} if lane == "bulk" else kwargs  # the batcher orders rows by it
        attributes = {
            "ttsq.task": task,
            "ttsq.content_key": key,
            "ttsq.mode": mode,
            "ttsq.language": kwargs.get("language"),
            "ttsq.engine": serving.engine if serving is not None else None,
            "ttsq.lane": lane,
        }
        with tracing.span("ttsq.submit", attributes) as traced:
            job = self._send_or_join(task, kwargs, mode=mode, key=key, kwargsrepr=kwargsrepr, cached=cached)
            traced.set({"ttsq.cached": job.result is not None, "ttsq.joined": job.joined, "ttsq.task_id": job.id})
            return job

    def _send_or_join(
        self,
        task: str,
        kwargs: dict[str, Any],
        *,
        mode: str,
        key: str | None,
        kwargsrepr: str,
        cached: Callable[[str], Job | None],
    ) -> Job:
        task_id = str(uuid.uuid4())
        queue = queue_for(self.settings.queue, mode, lane_for(task, kwargs))
        if key is not None:
            with tracing.span("ttsq.cache_check") as checked:
                hit = cached(key)
                checked.set({"ttsq.cached": hit is not None})
            if hit is not None:
                return hit
        if self.admit is not None:
            self.admit(queue)
        headers: dict[str, Any] = {SENT_AT_HEADER: time.time()}
        if key is not None and task == TASK_NAME:
            headers[CLAIM_HEADER] = key
        outgoing = Outgoing(
            task_id=task_id,
            task=task,
            queue=queue,
            kwargs=kwargs,
            headers=headers,
            kwargsrepr=kwargsrepr,
            tenant=turn_of(kwargs.get("tenant")),
        )
        # Recorded before it is claimed and sent: a job that owns a claim always has a record until it
        # finishes, and a message lost on its way to a worker is sent again from it (``ttsq.records.accepted``).
        # Joined, answered from the cache, or not sent (also on Ctrl-C): the record is withdrawn.
        joined: str | None = None
        with sending(
            self.app,
            self.accepted,
            outgoing,
            window=self.settings.release_window,
            cap=self.settings.tenant_max_in_flight,
            scope=self.settings.queue,
        ) as send:
            claimed = False
            try:
                if key is not None:
                    with tracing.span("ttsq.claim") as claiming:
                        owner = self.cache.claim(key, task_id, self.settings.inflight_ttl_s)
                        if owner is not None and self._gone(owner):
                            # The owner ended without releasing its claim (revoked, failed, killed past its
                            # retries), or was never accepted: joining it would wait for nothing. Take the
                            # claim over; for a document, its finished chunks are answered from the cache.
                            self.cache.release(key, owner)
                            owner = self.cache.claim(key, task_id, self.settings.inflight_ttl_s)
                        claiming.set({"ttsq.joined": owner is not None})
                    joined = owner
                    if owner is None:
                        claimed = True
                        # The job that held the claim may have indexed the audio between our look-up and our claim.
                        if (hit := cached(key)) is not None:
                            # An identical submit may have joined this claim meanwhile: it waits on task_id, which
                            # is never sent. Its answer is this one, stored under task_id (and published).
                            self._answer_joiners(task_id, hit)
                            return hit
                if joined is None:
                    # Accepted means replicated, when replicas are required: the record and the claim reach
                    # them before the message goes, so a failover cannot lose a job the caller was told about.
                    self.redis.replicated()
                    try:
                        send()
                    except Exception as exc:  # kombu raises OperationalError, redis-py its own: broker down
                        raise BrokerError(f"cannot reach the broker to enqueue: {type(exc).__name__}: {exc}") from exc
                    claimed = False  # sent: the claim is the job's now, released when it finishes
            finally:
                if claimed and key is not None:
                    self._release(key, task_id)
        if joined is not None:  # the record was withdrawn on the way out: the job is the one joined
            return self._join(joined, task_id, key, str(kwargs.get("tenant") or ""))
        return Job(id=task_id, key=key, client=self)

    def _join(self, source: str, task_id: str, key: str | None, tenant: str) -> Job:
        """This submit joined ``source``, an identical job already under way (single flight). A job of the
        same tenant's is answered with its own id; another tenant's is followed under ``task_id``, an id
        of this tenant's own, with its own status and cancel: one tenant never learns another's job id
        (docs/security.md, "Tenants")."""
        found = self.accepted.owner(source)
        if (found[0] if found else "") == tenant:
            return Job(id=source, key=key, client=self, joined=True)
        ttl_s = self.settings.inflight_ttl_s + self.settings.result_ttl_s  # the source's run, then its result
        self.accepted.follow(task_id, owner=tenant, source=source, ttl_s=ttl_s)
        return Job(id=task_id, key=key, client=self, joined=True, source=source)

    def _answer_joiners(self, task_id: str, hit: Job) -> None:
        """Store a cached answer as the result of a claim's job that will never be sent."""
        if hit.result is None:
            return
        try:
            self.app.backend.store_result(task_id, dict(hit.result), states.SUCCESS)
        except Exception as exc:  # whoever joined waits to its timeout; this submit has its answer
            logger.warning("could not answer the submits that joined job %s: %s", task_id, type(exc).__name__)

    def _release(self, key: str, task_id: str) -> None:
        """Release the claim of a job that was not sent, or identical submits would stall on it. Redis
        is given a few seconds (it may be restarting: that is often why the send failed)."""
        try:
            patiently(lambda: self.cache.release(key, task_id), self.settings.cache_url, WITHDRAW_PATIENCE_S)
        except TTSQError as exc:  # still unreachable: the claim expires with its TTL
            logger.warning("job %s was not sent, and its claim could not be released: %s", task_id, exc)

    def _cached(self, key: str) -> Job | None:
        entry = self.cache.get(key)
        if entry is None:
            return None
        self._count_hit()
        return Job(id=None, key=key, client=self, result=self.results.job(key, entry, cached=True))

    def _cached_document(self, key: str) -> Job | None:
        record = self.cache.document(key)
        if record is None:
            return None
        self._count_hit()
        return Job(
            id=None,
            key=key,
            client=self,
            chunks=len(record["chunks"]),
            result=cast("JobResult", self.results.document(record, cached=True)),
        )

    def _count_hit(self) -> None:
        """A producer-side cache hit, in this minute's fleet statistics."""
        try:
            self.stats.record(cached_producer=1)
        except Exception as exc:  # statistics are best effort; the hit itself is already served
            logger.debug("could not count the cache hit: %s", type(exc).__name__)

    def _gone(self, task_id: str) -> bool:
        """Whether the job behind a claim will never finish: it has a final result already, or ttsq has
        no record of it (accepted jobs keep theirs until they finish) and no worker has started it."""
        state = self._state(task_id)
        if state in states.READY_STATES:
            return True
        return state == states.PENDING and not self.accepted.exists(task_id)

    def _state(self, task_id: str) -> str:
        return stored_result(self.app, task_id).state

    def known(self, task_id: str) -> bool:
        """Whether ttsq knows this job: it has a result or a state, ttsq accepted it, or (sent by a web
        backend without ttsq) its message is in a queue or with a worker."""
        if self._state(task_id) != states.PENDING or self.accepted.owner(task_id) is not None:
            return True
        # A job may finish between those two reads: its worker stores the result, then drops the record.
        if self._state(task_id) != states.PENDING:
            return True
        try:
            queues = queues_for(self.settings.queue)
            return message_held(self.redis.broker, task_id, queues)
        except Exception as exc:
            raise BrokerError(f"cannot reach the broker: {type(exc).__name__}: {exc}") from exc

    def _check_known(self, task_id: str) -> None:
        if not self.known(task_id):
            raise unknown_job(task_id)

    def owner(self, task_id: str) -> str | None:
        """The tenant whose job ``task_id`` is ("" for a job submitted without one), for as long as its
        result lasts; None for an id ttsq keeps no record of."""
        found = self.accepted.owner(task_id)
        return None if found is None else found[0]

    def _source(self, task_id: str) -> str | None:
        """The job whose synthesis ``task_id`` follows (another tenant's identical job); None for a job
        that is its own synthesis."""
        found = self.accepted.owner(task_id)
        return (found[1] or None) if found is not None else None

    def identities(self) -> dict[str, EngineIdentity]:
        """The models the running workers announced, by mode (empty if none is running). Producers need
        no engine setting: whatever serves a mode announced itself under that mode."""
        read_at, identities = self._identities
        if time.monotonic() - read_at > IDENTITY_TTL_S:
            identities = {
                mode: EngineIdentity.from_dict(raw)
                for mode, raw in self.redis.identities.read(self.settings.queue).items()
            }
            self._identities = (time.monotonic(), identities)
        return identities

    def add_voice(self, audio: bytes, transcript: str = "") -> str:
        """Store a reference recording for voice cloning; return its key (the ``reference`` field)."""
        from ttsq.voices import add_voice

        return add_voice(self.storage, audio, transcript)

    def wait(self, task_id: str, *, timeout: float | None = None) -> JobResult:
        """The result of a task, with a URL made now; raise its error if it failed, ``UnknownJob`` at once
        for an id ttsq never accepted. A Redis that cannot be reached (restarting, failing over) is
        waited out for up to ``WAIT_PATIENCE_S`` in a row, within ``timeout``; past that, ``BrokerError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._riding_out(lambda: self._check_known(task_id), WAIT_PATIENCE_S, deadline)
        return self.refresh_url(self._finished(task_id, timeout, deadline).value())

    def _finished(self, task_id: str, timeout: float | None, deadline: float | None) -> StoredResult:
        """The job's stored result once its state is final; ``JobTimeout`` after ``timeout`` seconds
        (at ``deadline``).

        Celery's result consumer listens for the job's publish on one subscription shared by every
        wait of this client (a connection per wait would cost each job a connect and a handshake); the
        stored result is then read and rendered by ``read_meta``, like every other reader's. The wait
        is cut every ``WAIT_RECHECK_S`` to read the stored result again: Redis may take a result's SET
        and PUBLISH before the SUBSCRIBE, and that publish never reaches this waiter."""
        # A job that follows another tenant's synthesis ends with it, unless it was cancelled itself.
        source = self._riding_out(lambda: self._source(task_id), WAIT_PATIENCE_S, deadline)
        async_result = self.async_result(source or task_id)

        def read_or_listen() -> StoredResult | None:
            """The final stored result, or None after listening for it for up to ``WAIT_RECHECK_S``."""
            if source is not None and (own := stored_result(self.app, task_id)).done:
                return own
            stored = stored_result(self.app, source or task_id)
            if stored.done:
                return stored
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise JobTimeout(f"job {task_id} not done after {timeout}s")
            self._listen(async_result, WAIT_RECHECK_S if left is None else min(left, WAIT_RECHECK_S))
            return None

        try:
            while True:
                stored = self._riding_out(read_or_listen, WAIT_PATIENCE_S, deadline)
                if stored is not None:
                    return stored
        finally:
            # Stop listening for it now: left pending, Celery unsubscribes during interpreter shutdown,
            # reconnecting to a Redis that may be gone and printing a traceback.
            with contextlib.suppress(Exception):
                async_result.backend.remove_pending_result(async_result)

    @staticmethod
    def _listen(async_result: AsyncResult, wait_s: float) -> None:
        """Listen for a job's publish for up to ``wait_s``; ``BrokerError`` if Redis cannot be reached."""
        from celery.exceptions import TimeoutError as CeleryTimeout

        try:
            # The embedded mode runs a worker in this process; waiting here is not inside a task.
            async_result.get(timeout=wait_s, disable_sync_subtasks=False, propagate=False)
        except CeleryTimeout:
            pass
        except Exception as exc:
            if _is_connection_error(exc):
                raise BrokerError(f"cannot reach the result backend: {exc}") from exc
            # Celery could not decode what it read (a forged record): the reader says what it is on the
            # next pass; not a busy loop if it is still not final.
            time.sleep(min(wait_s, 0.5))

    @staticmethod
    def _riding_out(call: Callable[[], T], patience_s: float, deadline: float | None) -> T:
        """``call`` (Redis reads), tried again every ``WAIT_RETRY_S`` while Redis cannot be reached, for up
        to ``patience_s`` in a row and never past ``deadline``; then its ``BrokerError``."""
        unreachable_since: float | None = None
        while True:
            try:
                return call()
            except BrokerError as exc:
                if not _is_connection_error(exc):
                    raise
                now = time.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                    if patience_s > 0:
                        logger.warning("Redis unreachable while waiting; trying again for up to %.0f s", patience_s)
                if now - unreachable_since >= patience_s or (deadline is not None and now >= deadline):
                    raise
                time.sleep(WAIT_RETRY_S)

    def status(self, task_id: str, *, patience_s: float = 0.0) -> dict[str, Any]:
        """State of a task: PENDING (queued), STARTED, PROGRESS (a document: ``progress`` holds chunks
        done and total and audio seconds so far), SUCCESS, FAILURE; ``UnknownJob`` for an id ttsq never
        accepted, ``CorruptRecord`` for a result it cannot read. ``patience_s``: how long to keep trying
        while Redis cannot be reached (a waiter's progress display: ``WAIT_PATIENCE_S``); by default
        ``BrokerError`` at once."""
        stored = self._riding_out(lambda: stored_result(self.app, task_id), patience_s, None)
        source = self._riding_out(lambda: self._source(task_id), patience_s, None)
        if source is not None and stored.state != states.REVOKED:  # it is where the job it follows is
            try:
                return {**self.status(source, patience_s=patience_s), "id": task_id}
            except UnknownJob:  # the followed job's result expired: so has this one's
                raise unknown_job(task_id) from None
        if stored.state == states.PENDING:
            self._riding_out(lambda: self._check_known(task_id), patience_s, None)
        out: dict[str, Any] = {"id": task_id, "state": stored.state}
        if stored.state == states.FAILURE and stored.failure is not None:
            out["error"] = str(stored.failure)
        elif stored.progress is not None:
            out["progress"] = stored.progress
        elif stored.note is not None:
            out["note"] = stored.note
        elif stored.result is not None:
            out["result"] = self.refresh_url(stored.result)
        return out

    def cancel(self, task_id: str) -> str:
        """Cancel a job that has not finished; return the state it ends in: REVOKED when the cancel won,
        else the final state its worker had already settled (SUCCESS or FAILURE: nothing was cancelled).

        The cancel wins unless the job's worker settled its outcome first (one Redis transition,
        ``AcceptedJobs.cancel``). A queued job never runs: a worker drops its message (and, for a
        document, the messages of its chunks) when it arrives. A job already in its engine call runs
        to the end of that call, its audio is stored and cached (it was paid for), and it ends REVOKED:
        no result, its stream ends with an error. docs/guarantees.md, "Cancel", has the table."""
        self._check_known(task_id)
        state = self._state(task_id)
        if state in states.READY_STATES:
            return str(state)
        source = self._source(task_id)
        if source is not None:
            # Following another tenant's job: only this tenant's own id is cancelled, never their synthesis.
            if (followed := self._state(source)) in states.READY_STATES:
                return str(followed)
            self._revoke(task_id)
            return str(states.REVOKED)
        settled = self.accepted.cancel(task_id, ttl_s=self.settings.result_ttl_s)
        if settled is not None:
            return settled  # its worker was first: the result it settled is being (or was) stored
        # REVOKED before the record is finished: a canceller that dies in between leaves a record that
        # is sent again (or released) and dropped by the worker that receives it, which stores REVOKED
        # too; finished first, a waiting job had no copy left to end it.
        self._revoke(task_id, broadcast=True)
        self.accepted.finish(task_id)  # nothing to send again
        return str(states.REVOKED)

    def _revoke(self, task_id: str, *, broadcast: bool = False) -> None:
        """Store REVOKED as the job's state; ``broadcast``: and tell the workers, so one that already
        holds its message (prefetched) drops it too."""
        try:
            self.app.backend.mark_as_revoked(task_id, "cancelled")
            if broadcast:
                self.app.control.revoke(task_id)
        except Exception as exc:
            if _is_connection_error(exc):
                raise BrokerError(f"cannot reach the result backend: {exc}") from exc
            raise

    def refresh_url(self, result: JobResult) -> JobResult:
        """The same result with a URL presigned now (the stored one may have expired)."""
        return self.results.refresh(result)

    def parked(self) -> list[ParkedJob]:
        """Jobs failed after too many unfinished attempts (they crashed or hung their workers)."""
        return self.redis.attempts.parked()

    def retry(self, task_id: str) -> str:
        """Send a parked job again, under its own id and with its attempts cleared; return the id. If it
        cannot be sent, it stays parked with its failure, as the operator found it."""
        ledger = self.redis.attempts
        job = ledger.unpark(task_id)
        if job is None:
            raise JobFailed(f"no parked job {task_id} (see `ttsq failed`)")
        backend = self.app.backend
        key = backend.get_key_for_task(task_id)
        failed: bytes | None = None
        try:
            # The old FAILURE result would answer a waiter at once: clear it first.
            failed = backend.get(key)
            backend.forget(task_id)
            self.accepted.unsettle(task_id)  # its FAILURE no longer answers a cancel
            outgoing = Outgoing(
                task_id=task_id,
                task=job.task,  # a job, or a document's parked stitch (it reads its plan from Redis)
                queue=job.queue,
                kwargs=job.kwargs,
                headers={SENT_AT_HEADER: time.time()},
                kwargsrepr="<retried parked job>",
            )
            send_job(self.app, self.accepted, outgoing)
        except Exception as exc:
            ledger.park(job)  # not sent: keep it where the operator found it, its failure too
            if failed is not None:
                with contextlib.suppress(Exception):
                    backend.set(key, failed)
            raise BrokerError(f"cannot re-queue {task_id}: {type(exc).__name__}: {exc}") from exc
        return task_id

    def download(self, result: JobResult) -> bytes:
        """The audio bytes of a result, read through ttsq's storage (never through the result's URL)."""
        return self.results.download(result)

    def async_result(self, task_id: str) -> AsyncResult:
        """Celery's handle for a task id."""
        return self.app.AsyncResult(task_id)

    def close(self) -> None:
        """Release Redis connections (the Redis owner's only if this client made it)."""
        if self._owns_redis:
            self.redis.close()
        self.app.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def submit(text: str, *, settings: Settings | None = None, **fields: Unpack[RequestFields]) -> Job:
    """One-off submit with settings from the environment. Keep a ``Client`` for more than one."""
    from ttsq.config import Settings

    return Client(settings or Settings.from_env()).submit(text, **fields)


def unknown_job(task_id: str) -> UnknownJob:
    """The one answer for an id ttsq does not know, and (at the gateway) for another tenant's id: the two
    must read the same, byte for byte, or the answer itself says the id exists."""
    return UnknownJob(f"unknown job ID {task_id[:80]!r}: ttsq never accepted it, or its result has expired")


def _is_connection_error(exc: BaseException | None) -> bool:
    """Whether an error (or anything in its cause chain) means Redis could not be reached."""
    import kombu.exceptions
    import redis.exceptions

    while exc is not None:
        if isinstance(
            exc,
            (
                redis.exceptions.ConnectionError,
                redis.exceptions.TimeoutError,  # a Redis that stopped answering is as unreachable
                kombu.exceptions.OperationalError,
                ConnectionError,
            ),
        ):
            return True
        # Celery's result consumer gives up reconnecting with a bare RuntimeError.
        if isinstance(exc, RuntimeError) and "reconnect to the Celery result store" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
