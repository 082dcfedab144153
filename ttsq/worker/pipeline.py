"""What a worker does with one job: re-check, batch, store, index, result.

Task threads call ``Pipeline.run``; the batcher thread is the only one that touches the engine. The
order of the stages is the delivery guarantee:

1. validate the kwargs again (a raw ``send_task`` never met the producer's checks);
2. re-check the cache: the message may be a redelivery of a job that already finished;
   then drop a job past its deadline, and park a job whose engine call has failed to return
   ``max_attempts`` times (it kills or hangs workers; see ``ttsq.records.attempts``);
3. synthesize in a batch (a job with an engine call that never returned runs alone);
4. ``store_audio``: encode (on the worker's encoder pool, ``Encoders``) and ``put`` the object
   (idempotent: same key, same audio), then write the index entry last, so the index never points at a
   missing object;
5. settle the outcome against a cancel (``AcceptedJobs.settle``: a job cancelled first ends REVOKED,
   its audio stored and cached all the same), release the single-flight claim and return; Celery acks
   after the return.

A worker killed anywhere in 3-5 has its message redelivered, and the rerun is harmless. The document
stitch (``ttsq.worker.documents``) stores its file the same way, piece by piece (``store_file``).

Why one file over 400 lines: the stages above are one path, read top to bottom in their order.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Generic, TypeVar

import ttsq.tracing as tracing
from ttsq.app import queue_for
from ttsq.audio import EncodedAudio, EncodedFile, as_int16, encode, probe, probe_file
from ttsq.errors import DeadlineExceeded, InvalidRequest, JobCancelled, JobParked, JobTimeout
from ttsq.job import JobResult, StoredAudio, SynthesisRequest, Timings, no_timings
from ttsq.keys import audio_key, content_key, object_key
from ttsq.observer import JobReport
from ttsq.records.attempts import ParkedJob
from ttsq.results import SUCCESS
from ttsq.worker.encoding import Encoders, Turn
from ttsq.worker.streaming import StreamWriter
from ttsq.worker.timestamps import WordTimes

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from ttsq.batching.batcher import Batcher
    from ttsq.batching.jobs import Expected
    from ttsq.config import Settings
    from ttsq.engines.base import Engine, EngineIdentity
    from ttsq.job import Limits
    from ttsq.observer import Observer
    from ttsq.records.accepted import AcceptedJobs
    from ttsq.records.attempts import Ledger
    from ttsq.records.cache import CacheIndex
    from ttsq.records.streams import AudioStreams
    from ttsq.results import Results
    from ttsq.storage import Storage

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Encodes mono samples at a rate into a format (``ttsq.audio.encode``, or ``Encoders.encode``).
Encode = Callable[["npt.NDArray[Any]", int, str], EncodedAudio]


@dataclass(frozen=True)
class Stored(Generic[T]):
    """What ``store_audio`` stored: the index entry's audio facts, what indexing returned, the timings."""

    audio: StoredAudio
    #: What the ``index`` callback returned (the document stitch: the record it wrote).
    record: T
    #: Whether this run wrote the object (an earlier run of the same key may have).
    written: bool
    encode_s: float
    upload_s: float
    index_s: float


def store_audio(
    storage: Storage,
    samples: npt.NDArray[np.floating[Any]] | npt.NDArray[np.int16],
    sample_rate: int,
    *,
    key: str,
    audio_format: str,
    identity: EngineIdentity,
    truncated: bool,
    ignored: Sequence[str],
    index: Callable[[StoredAudio], T],
    encoder: Encode = encode,
) -> Stored[T]:
    """Encode ``samples`` (with ``encoder``: ``Encoders.encode`` in a worker), put them under ``key``'s
    object (idempotent), then index them with ``index``.

    The index entry is written last, so it never points at an object that is not there; a worker
    killed before it leaves an object that the rerun finds and indexes. Only the encoding goes to the
    pool: the upload and the index are waits on the network, which the task thread does as well as any.
    """
    started = time.perf_counter()
    with tracing.span("ttsq.encode", {"ttsq.format": audio_format}):
        audio = encoder(samples, sample_rate, audio_format)
    encoded = time.perf_counter()
    target = object_key(key, audio_format)
    with tracing.span("ttsq.upload", {"ttsq.object_key": target, "ttsq.bytes": len(audio.data)}) as upload:
        written = storage.put(target, audio.data, audio.content_type)
        upload.set({"ttsq.written": written})
        if not written:
            # An earlier run of this key stored its object first (a redelivery, or a claim that expired).
            # A sampling model does not repeat itself byte for byte: index what is stored, not this run.
            audio = probe(storage.get(target), audio_format)
    uploaded = time.perf_counter()
    facts = EncodedFile(audio.content_type, audio.sample_rate, audio.duration_s, len(audio.data))
    entry = _entry(target, audio_format, facts, identity=identity, truncated=truncated, ignored=ignored)
    with tracing.span("ttsq.index", {"ttsq.content_key": key}):
        record = index(entry)
    indexed = time.perf_counter()
    return Stored(
        audio=entry,
        record=record,
        written=written,
        encode_s=encoded - started,
        upload_s=uploaded - encoded,
        index_s=indexed - uploaded,
    )


#: How much of an encoded file ``store_file`` keeps in memory before it spills to a temporary file.
SPOOL_BYTES = 8 * 1024 * 1024


def store_file(
    storage: Storage,
    write: Callable[[IO[bytes]], EncodedFile],
    *,
    key: str,
    audio_format: str,
    identity: EngineIdentity,
    truncated: bool,
    ignored: Sequence[str],
    index: Callable[[StoredAudio], T],
) -> Stored[T]:
    """``store_audio`` for audio too long to hold: ``write`` encodes it piece by piece into a temporary
    file (spooled: in memory while small), which goes up with ``put_file`` (in parts, when large).
    The same order: the object first (idempotent), the index entry last."""
    started = time.perf_counter()
    target = object_key(key, audio_format)
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, prefix="ttsq-stitch-") as handle:
        with tracing.span("ttsq.encode", {"ttsq.format": audio_format}):
            facts = write(handle)
        encoded = time.perf_counter()
        with tracing.span("ttsq.upload", {"ttsq.object_key": target, "ttsq.bytes": facts.bytes}) as upload:
            written = storage.put_file(target, handle, facts.content_type)
            upload.set({"ttsq.written": written})
    if not written:
        # An earlier run stored its object first: index what is stored (read through a spooled file too).
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES, prefix="ttsq-stitch-") as stored:
            for piece in storage.stream(target):
                stored.write(piece)
            facts = probe_file(stored, audio_format)
    uploaded = time.perf_counter()
    entry = _entry(target, audio_format, facts, identity=identity, truncated=truncated, ignored=ignored)
    with tracing.span("ttsq.index", {"ttsq.content_key": key}):
        record = index(entry)
    indexed = time.perf_counter()
    return Stored(
        audio=entry,
        record=record,
        written=written,
        encode_s=encoded - started,
        upload_s=uploaded - encoded,
        index_s=indexed - uploaded,
    )


def _entry(
    target: str,
    audio_format: str,
    facts: EncodedFile,
    *,
    identity: EngineIdentity,
    truncated: bool,
    ignored: Sequence[str],
) -> StoredAudio:
    return StoredAudio(
        object_key=target,
        format=audio_format,
        content_type=facts.content_type,
        sample_rate=facts.sample_rate,
        duration_s=facts.duration_s,
        bytes=facts.bytes,
        engine=identity.engine,
        model=identity.model,
        model_revision=identity.revision,
        truncated=truncated,
        ignored=list(ignored),
    )


class Pipeline:
    """Runs ``ttsq.synthesize`` jobs to stored, indexed results; built by ``WorkerRuntime``."""

    def __init__(
        self,
        settings: Settings,
        *,
        limits: Limits,
        engine: Engine,
        batcher: Batcher,
        storage: Storage,
        cache: CacheIndex,
        ledger: Ledger,
        results: Results,
        observer: Observer,
        streams: AudioStreams | None = None,
        accepted: AcceptedJobs | None = None,
        encoders: Encoders | None = None,
    ) -> None:
        """``encoders``: the pool the batcher reads the backlog of (``ttsq.worker.encoding``); by default
        one of ``TTSQ_ENCODE_THREADS`` of the pipeline's own. The pipeline closes it."""
        self.settings = settings
        self.streams = streams
        #: Where a job's outcome is settled against a cancel (None: no cancel is honoured, as in a bare test).
        self.accepted = accepted
        self.limits = limits
        self.engine = engine
        self.batcher = batcher
        self.storage = storage
        self.cache = cache
        self.ledger = ledger
        self.results = results
        self.observer = observer
        self.word_times = WordTimes(settings, storage)
        #: Encodes finished audio off the task threads' lock-holding path (``Encoders``).
        self.encoders = encoders or Encoders(settings.encode_threads)

    def close(self) -> None:
        """End the encoder pool, once the encodes under way have finished."""
        self.encoders.close()

    def run(
        self, kwargs: dict[str, Any], *, task_id: str, queue_wait_s: float | None, claimed_key: str | None = None
    ) -> JobResult:
        """Run one job to a stored, indexed result.

        ``claimed_key`` is the key the producer claimed for this job; it is released however the job
        ends, even if this worker rejects the request or computes another key (another model).
        """
        key = claimed_key
        started = time.perf_counter()
        outcome, result, written = "failed", None, False
        writer: StreamWriter | None = None  # a streaming job's, once it goes to the engine
        request: SynthesisRequest | None = None
        self.observer.job_started(task_id)
        # A batch that is not full may wait for this job while it is checked (cache, ledger).
        expected = self.batcher.expect()
        try:
            request = SynthesisRequest.from_dict(kwargs, self.limits)
            self.engine.identity.check(request)  # a raw send_task may name a mode, speaker or language we lack
            key = content_key(request, self.engine.identity)
            tracing.annotate(
                {
                    "ttsq.content_key": key,
                    "ttsq.engine": self.engine.identity.engine,
                    "ttsq.mode": request.mode,
                    "ttsq.language": request.language,
                }
            )
            stored = self.cache.get(key)
            self.observer.cache_checked(hit=stored is not None)
            if stored is not None:
                logger.info("job %s: cache hit %s", task_id, key[:12])
                timings = no_timings()
                timings["queue_wait_s"] = round(queue_wait_s or 0.0, 4)
                result = self.results.job(key, stored, cached=True, timings=timings)
                outcome = "cached"
            else:
                if request.expired():
                    raise DeadlineExceeded(
                        f"deadline passed {time.time() - (request.deadline or 0):.1f}s before "
                        "synthesis; the job was dropped"
                    )
                if self.accepted is not None and self.accepted.cancelled(task_id):
                    # Cancelled while this worker held it: it ends REVOKED whatever happens, so skip the engine.
                    raise JobCancelled(f"job {task_id} was cancelled before its synthesis")
                attempts = self.ledger.attempts(task_id)
                if attempts >= self.settings.max_attempts:
                    self._park(kwargs, request, task_id, attempts)
                writer = self._writer(request, task_id=task_id, queue_wait_s=queue_wait_s, started=started)
                result, written = self._synthesize(
                    request,
                    key,
                    writer,
                    task_id=task_id,
                    queue_wait_s=queue_wait_s,
                    isolated=attempts > 0,
                    expected=expected,
                )
                outcome = "synthesized"
            # The audio is stored and indexed either way (it was paid for); a cancel that came first wins.
            # The settled outcome answers a cancel only until the result is stored (a cancel reads that
            # first), or for a rerun of the job: so it lives as long as the job can be in flight.
            if self.accepted is not None and not self.accepted.settle(
                task_id, SUCCESS, ttl_s=self.settings.inflight_ttl_s
            ):
                raise JobCancelled(f"job {task_id} was cancelled before it finished; its audio is cached")
            # Signed and ready: what is left (claim release, result store) belongs to the round trip.
            result["timings"]["worker_s"] = round(time.perf_counter() - started, 4)
            if request.stream and self.streams is not None:
                # Its readers learn the result from the stream itself; a cache hit wrote no audio to
                # it, and its readers read the stored file instead.
                done, keep_from = result, writer.end_trim() if writer is not None else None
                self._stream_quietly(
                    lambda: self.streams.end(task_id, dict(done), keep_from=keep_from) if self.streams else None,
                    task_id,
                )
            return result
        except Exception as exc:
            if isinstance(exc, InvalidRequest):
                outcome = "invalid"
            elif isinstance(exc, JobTimeout):
                outcome = "timeout"
            elif isinstance(exc, JobCancelled):
                outcome = "cancelled"
            if kwargs.get("stream") is True:  # its readers end with the error, not a short clip
                failure = exc
                self._stream_quietly(lambda: self.streams.error(task_id, failure) if self.streams else None, task_id)
            raise
        finally:
            expected.done()  # it never reached the batcher (a cache hit, a refusal): nothing to wait for
            self.observer.job_finished(
                JobReport(
                    task_id=task_id,
                    outcome=outcome,
                    queue_wait_s=queue_wait_s,
                    result=result,
                    written=written,
                    lane="bulk" if kwargs.get("lane") == "bulk" else "interactive",
                    tenant=request.tenant if request is not None else "",
                )
            )
            # Success or failure, this job no longer produces the key: let the next submit try.
            for claimed in {k for k in (key, claimed_key) if k is not None}:
                self.cache.release(claimed, task_id)

    @staticmethod
    def _stream_quietly(write: Callable[[], object], task_id: str) -> None:
        """A stream is the early copy: when Redis refuses it, the job still stores its file and result,
        and its readers, seeing no end, wait for that result."""
        try:
            write()
        except Exception as exc:
            logger.warning("job %s: could not write its stream: %s", task_id, type(exc).__name__)

    def _park(self, kwargs: dict[str, Any], request: SynthesisRequest, task_id: str, attempts: int) -> None:
        error = (
            f"job {task_id} was in {attempts} engine calls that never returned (it crashed or hung its "
            f"worker each time); parked: `ttsq failed` lists it, `ttsq retry {task_id}` re-queues it"
        )
        # Where `ttsq retry` sends it back.
        queue = queue_for(self.settings.queue, request.mode, request.lane_or("interactive"))
        self.ledger.park(
            ParkedJob(id=task_id, queue=queue, kwargs=kwargs, attempts=attempts, error=error, parked_at=time.time())
        )
        self.observer.job_parked(task_id)
        logger.error("job %s parked after %d unfinished attempts", task_id, attempts)
        raise JobParked(error)

    def _writer(
        self, request: SynthesisRequest, *, task_id: str, queue_wait_s: float | None, started: float
    ) -> StreamWriter | None:
        """The writer of a streaming job's audio to its stream; None for a job that does not stream."""
        if not request.stream or self.streams is None:
            return None
        sent_at = None if queue_wait_s is None else time.time() - (time.perf_counter() - started) - queue_wait_s
        return StreamWriter(
            self.streams, task_id, sample_rate=self.engine.identity.sample_rate, observer=self.observer, sent_at=sent_at
        )

    def _synthesize(
        self,
        request: SynthesisRequest,
        key: str,
        writer: StreamWriter | None,
        *,
        task_id: str,
        queue_wait_s: float | None,
        isolated: bool = False,
        expected: Expected | None = None,
    ) -> tuple[JobResult, bool]:
        """The job's result, and whether this run wrote its object (an earlier run may have)."""
        queued = time.perf_counter()
        # Its encode counts in the encoders' backlog from the moment its batch returns until it is
        # encoded, or the job leaves: the batcher holds back batches whose audio would only queue there.
        turn = self.encoders.turn(request.format)
        try:
            return self._batched(
                request,
                key,
                turn,
                writer,
                task_id=task_id,
                queue_wait_s=queue_wait_s,
                queued=queued,
                isolated=isolated,
                expected=expected,
            )
        finally:
            turn.close()

    def _batched(
        self,
        request: SynthesisRequest,
        key: str,
        turn: Turn,
        writer: StreamWriter | None,
        *,
        task_id: str,
        queue_wait_s: float | None,
        queued: float,
        isolated: bool,
        expected: Expected | None,
    ) -> tuple[JobResult, bool]:
        # A job that was in an engine call that never returned runs alone: if it is the one that
        # crashes workers, it takes no neighbour down with it this time.
        future = self.batcher.submit(
            request,
            isolated=isolated,
            on_enter=lambda: self.ledger.charge(task_id),
            on_exit=lambda: self.ledger.refund_soon(task_id),
            on_piece=writer,  # a Piece, and where an engine that times words as it speaks puts them
        )
        future.add_done_callback(turn.batched)
        if expected is not None:
            expected.done()  # after the hand-over, so the batcher always sees it on its way or arrived
        try:
            if writer is not None:
                item = writer.wait(future, self.settings.job_timeout_s)
            else:
                item = future.result(timeout=self.settings.job_timeout_s)
        except FutureTimeout:
            self.batcher.abandon(future)  # not waiting any more, nor holding a slot
            raise JobTimeout(f"no batch finished this job within {self.settings.job_timeout_s}s") from None

        # Everything in the batcher that was not the forward pass: filling, and waiting behind a batch.
        batch_wait_s = max(0.0, time.perf_counter() - queued - item.synthesis_s)
        output = item.output
        # A WAV and a stream are the same 16-bit PCM: converted once here, not once by each.
        samples = as_int16(output.samples) if request.format == "wav" else output.samples
        if writer is not None:
            # The audio goes out before it is encoded and stored: that wait is what streaming saves.
            writer.finish(output if samples is output.samples else dataclasses.replace(output, samples=samples))
        stored = store_audio(
            self.storage,
            samples,
            output.sample_rate,
            # A request with timestamps shares the audio of the same request without them.
            key=audio_key(request, self.engine.identity),
            audio_format=request.format,
            identity=self.engine.identity,
            truncated=output.truncated,
            ignored=output.ignored,
            index=lambda entry: self.cache.put(key, self.word_times.attach(request, key, output, entry)),
            encoder=lambda samples, rate, audio_format: self.encoders.encode(samples, rate, audio_format, turn),
        )
        logger.info(
            "job %s: synthesized %s in batch %d of %d (%.2fs audio)",
            task_id,
            key[:12],
            item.batch_id,
            item.batch_size,
            stored.audio["duration_s"],
        )
        timings = Timings(
            queue_wait_s=round(queue_wait_s or 0.0, 4),
            batch_wait_s=round(batch_wait_s, 4),
            synthesis_s=round(item.synthesis_s, 4),
            device_s=round(item.device_s, 4),
            encode_s=round(stored.encode_s, 4),
            upload_s=round(stored.upload_s, 4),
            index_s=round(stored.index_s, 4),
            worker_s=0.0,
        )
        result = self.results.job(key, stored.audio, cached=False, batch_size=item.batch_size, timings=timings)
        return result, stored.written
