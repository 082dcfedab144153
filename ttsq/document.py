"""Long documents: one job that fans out into chunk jobs and a stitch job, resumable, with progress.

The path of a document (``Client.submit_document``, or ``send_task("ttsq.document", kwargs=...)``):

1. **Validate** at the edge: the text (any length up to ``TTSQ_MAX_DOCUMENT_CHARS``) is normalized
   and split (``ttsq.splitter``); every chunk must be a valid ordinary request. Nothing is queued
   otherwise.
2. **Key.** The document key is a SHA-256 over the normalized text, every request field, the model
   that serves the mode, and the chunking and stitching options: the same document with other
   chunk sizes or pauses is another file. A cached document returns at once.
3. **Seed.** Every chunk gets the same voice inputs and the same seed: the request's, or one derived
   from the document key (so a re-submit gets the same seed, and so the same chunk keys).
4. **Fan out.** The ``ttsq.document`` task, on a worker, replaces itself (``Task.replace``) with a
   Celery chord: a group of ordinary ``ttsq.synthesize`` jobs, one per chunk, each with its normal
   content key (cached and shared with ordinary submits), and the ``ttsq.stitch`` job as its body.
   The body inherits the document task's id, so the id the user holds ends up carrying the stitched
   result.
5. **Progress.** Each chunk job, when done, records its audio seconds in a Redis hash for the
   document and stores the custom state ``PROGRESS`` (chunks done / total, audio seconds) on the
   document's id; ``ttsq status`` and ``AsyncResult.info`` read it, and a ``task-progress`` event
   shows it in Flower.
6. **Stitch.** The stitch job reads each chunk's audio through the cache index (never trusting the
   chord's result list: a redelivered chunk may report twice), joins them with a crossfade inside a
   cut sentence, a short pause between sentences and a longer one between paragraphs, encodes the
   requested format, stores it under the document key and returns its URL with the time span of
   every chunk and every sentence.

**Resume.** A worker that dies mid-document loses nothing: its chunk messages are redelivered
(late acks), finished chunks are acked and stored. A document re-submitted after a crash joins the
running document (single flight on the document key) or, if that one failed, starts again, and
every chunk already stored is answered from the cache by the worker: only missing chunks are
synthesized.

**What the seed does and does not guarantee (VoiceDesign).** Each chunk is sampled with the same
voice description and the same seed, so a re-submitted document has the same chunk keys and is
answered with the audio first made, and a chunk shared with another document is the same audio in
both. A chunk synthesized again (its cache entry expired) may differ: a sampled row depends on its
batch neighbours (README, "Reproducibility"). It does not make the voice identical from chunk
to chunk: VoiceDesign invents a voice from the description for each generation, conditioned on
that chunk's text, so timbre may drift between chunks. For one voice across a long document use
CustomVoice (a fixed speaker) or voice_clone (a reference recording).
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict, cast

import numpy as np
import numpy.typing as npt

from ttsq.audio import decode, encode, probe, resample
from ttsq.cache import connect
from ttsq.constants import (
    DOCUMENT_HEADER,
    DOCUMENT_PREFIX,
    DOCUMENT_SCHEMA_VERSION,
    PROGRESS_PREFIX,
    PROGRESS_STATE,
    SENT_AT_HEADER,
    STITCH_TASK_NAME,
    TASK_NAME,
)
from ttsq.engines.base import FRAMES_PER_SECOND, reading_seconds
from ttsq.errors import InvalidRequest, JobFailed
from ttsq.keys import EngineIdentity, canonical_json, content_key, object_key
from ttsq.request import JobResult, Limits, StoredAudio, SynthesisRequest, check_characters, no_timings
from ttsq.splitter import SPLITTER_VERSION, Chunk, normalize, split
from ttsq.tasks import queue_for

if TYPE_CHECKING:
    from celery import Celery

    from ttsq.config import Settings
    from ttsq.worker import WorkerRuntime

logger = logging.getLogger(__name__)

#: The slowest reading ``reading_seconds`` assumes, seconds per character (a Han character).
_SLOWEST_S_PER_CHAR = 0.3


@dataclass(frozen=True, kw_only=True)
class Options:
    """How a document is cut and joined. Part of the document key."""

    target_chars: int = 200
    max_chars: int = 400
    sentence_pause_ms: int = 250
    paragraph_pause_ms: int = 700
    crossfade_ms: int = 40

    @classmethod
    def from_settings(cls, settings: Settings) -> Options:
        """The options a producer sends (``TTSQ_DOC_*``)."""
        return cls(target_chars=settings.doc_target_chars, max_chars=settings.doc_max_chars,
                   sentence_pause_ms=settings.doc_sentence_pause_ms,
                   paragraph_pause_ms=settings.doc_paragraph_pause_ms, crossfade_ms=settings.doc_crossfade_ms)

    @classmethod
    def from_dict(cls, data: Any) -> Options:
        """Validate options from a message (``InvalidRequest`` names the field)."""
        if not isinstance(data, Mapping):
            raise InvalidRequest("options", f"expected a JSON object, got {type(data).__name__}")
        known = set(cls.__dataclass_fields__)
        values: dict[str, int] = {}
        for name, value in data.items():
            if name not in known:
                raise InvalidRequest(f"options.{str(name)[:40]}", f"unknown option; expected one of {sorted(known)}")
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100_000:
                raise InvalidRequest(f"options.{name}", "expected an integer 0..100000")
            if name.endswith("_ms") and value > 10_000:  # as TTSQ_DOC_*: silence the stitch holds per chunk
                raise InvalidRequest(f"options.{name}", "expected 0..10000 milliseconds")
            values[name] = value
        options = cls(**values)
        if options.max_chars < 20:
            raise InvalidRequest("options.max_chars", "must be at least 20")
        if not 1 <= options.target_chars <= options.max_chars:
            raise InvalidRequest("options.target_chars", f"must be 1..max_chars ({options.max_chars})")
        return options

    def chunk_max(self, limits: Limits, identity: EngineIdentity | None, instruct: str = "") -> int:
        """The longest chunk: the option, within the job text limit, what the model's frame cap
        accepts (``EngineIdentity.check`` refuses text whose fast reading exceeds the cap), and what
        fits the engine's prompt area beside the instruct (qwen-fast counts UTF-8 bytes)."""
        most = min(self.max_chars, limits.max_text_chars)
        if identity is not None and identity.max_frames:
            cap_s = identity.max_frames / FRAMES_PER_SECOND
            # check() refuses reading_seconds / 2 > cap_s; the slowest character costs 0.3 s.
            most = min(most, int(cap_s * 2 / _SLOWEST_S_PER_CHAR * 0.9))
        if identity is not None and identity.max_prompt_bytes:
            # A character is at most 4 bytes of UTF-8: chunks of this many characters always fit.
            most = min(most, (identity.max_prompt_bytes - len(instruct.encode())) // 4)
        return max(1, most)


@dataclass(frozen=True)
class Document:
    """A validated document: normalized text, request fields, options, chunks."""

    text: str
    #: Validated request fields for every chunk, except text (the seed as given: maybe None).
    fields: dict[str, Any]
    options: Options
    chunks: list[Chunk]

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, limits: Limits, max_document_chars: int,
              identity: EngineIdentity | None = None, default_options: Options | None = None) -> Document:
        """Validate a ``ttsq.document`` message or a producer's call; raise ``InvalidRequest``."""
        if not isinstance(data, Mapping):
            raise InvalidRequest("request", f"expected a JSON object, got {type(data).__name__}")
        if "text" not in data:
            raise InvalidRequest("text", "is required")
        if data.get("deadline") is not None:
            raise InvalidRequest("deadline", "is not supported for documents (a document is many jobs)")
        raw = data["text"]
        check_characters("text", raw)
        text = normalize(raw)
        if not text:
            raise InvalidRequest("text", "is empty")
        if len(text) > max_document_chars:
            raise InvalidRequest("text", f"is {len(text)} characters; the document limit is {max_document_chars} "
                                         "(TTSQ_MAX_DOCUMENT_CHARS)")
        options = Options.from_dict(data["options"]) if "options" in data else (default_options or Options())
        other = {name: value for name, value in data.items() if name not in ("text", "options", "deadline")}
        # The fields are checked once, with a stand-in text; each chunk is checked again below.
        template = SynthesisRequest.from_dict({**other, "text": "-"}, limits)
        fields = {name: value for name, value in template.to_dict().items() if name not in ("text", "deadline")}
        most = options.chunk_max(limits, identity, str(fields.get("instruct") or ""))
        chunks = split(text, target_chars=min(options.target_chars, most), max_chars=most)
        document = cls(text=text, fields=fields, options=options, chunks=chunks)
        for number, request in enumerate(document.requests(seed=0, limits=limits)):
            try:
                if identity is not None:
                    identity.check(request)
            except InvalidRequest as exc:
                raise InvalidRequest(f"text (chunk {number + 1} of {len(chunks)})", exc.reason) from None
        return document

    def key(self, identity: EngineIdentity) -> str:
        """The document key: everything that shapes the stitched file."""
        return hashlib.sha256(canonical_json(self._material(identity))).hexdigest()

    def seed(self, identity: EngineIdentity) -> int:
        """The seed of every chunk: the request's, or one derived from the document's text, voice and
        chunking. Not from its output format or pauses: the same chunks then serve every format."""
        given = self.fields.get("seed")
        if given is not None:
            return int(given)
        material = self._material(identity)
        material["fields"] = {name: value for name, value in self.fields.items() if name != "format"}
        material["options"] = {"target_chars": self.options.target_chars, "max_chars": self.options.max_chars}
        return int(hashlib.sha256(canonical_json(material)).hexdigest()[:8], 16)

    def _material(self, identity: EngineIdentity) -> dict[str, Any]:
        return {
            "kind": "document",
            "schema": DOCUMENT_SCHEMA_VERSION,
            "splitter": SPLITTER_VERSION,
            "engine": identity.engine,
            "model": identity.model,
            "revision": identity.revision,
            "sample_rate": identity.sample_rate,
            "fields": self.fields,
            "options": asdict(self.options),
            "text": self.text,
        }

    def requests(self, *, seed: int, limits: Limits) -> list[SynthesisRequest]:
        """One ordinary request per chunk. Chunks are WAV (lossless, and the default format, so shared
        with ordinary submits); the document's own format applies to the stitched file."""
        return [SynthesisRequest.from_dict({**self.fields, "text": chunk.text, "format": "wav", "seed": seed}, limits)
                for chunk in self.chunks]


class SentenceSpan(TypedDict):
    """Where a sentence is in the text (normalized, character offsets) and in the stitched audio. Times
    inside a chunk of several sentences are estimated from reading lengths; chunk edges are exact."""

    start_char: int
    end_char: int
    start_s: float
    end_s: float


class ChunkSpan(TypedDict):
    """One chunk of the stitched document."""

    index: int
    key: str
    start_char: int
    end_char: int
    start_s: float
    end_s: float
    boundary: str
    cached: bool
    sentences: list[SentenceSpan]


class DocumentInfo(TypedDict):
    """Facts about a document result."""

    chunks: int
    cached_chunks: int
    characters: int
    seed: int


class DocumentResult(JobResult):
    """The result of a document job: an ordinary result for the stitched file, plus where every chunk
    and sentence lies in it. Still no input text."""

    document: DocumentInfo
    chunks: list[ChunkSpan]


class Progress(TypedDict):
    """The ``PROGRESS`` state's meta: what ``ttsq status`` shows while a document runs."""

    chunks_done: int
    chunks_total: int
    audio_s: float


class Documents:
    """The worker side of documents: fan out, count progress, stitch. One per worker process."""

    def __init__(self, app: Celery, runtime: WorkerRuntime) -> None:
        self.app = app
        self.runtime = runtime
        self.settings = runtime.settings
        self._redis = connect(runtime.settings.cache_url)

    # --- 1. the document task -------------------------------------------------------------------

    def fan_out(self, task: Any, kwargs: dict[str, Any]) -> Any:
        """Run the ``ttsq.document`` task: answer from the cache, or replace it with the chord."""
        from celery import chord

        runtime = self.runtime
        identity = runtime.engine.identity
        document = Document.parse(kwargs, limits=runtime.limits, max_document_chars=self.settings.max_document_chars,
                                  identity=identity, default_options=Options.from_settings(self.settings))
        key = document.key(identity)
        task_id = task.request.id
        stored = self.stored(key)
        if stored is not None:
            runtime.cache.release(key, task_id)
            logger.info("document %s: cached %s", task_id, key[:12])
            return self.result(stored, cached=True)
        seed = document.seed(identity)
        requests = document.requests(seed=seed, limits=runtime.limits)
        keys = [content_key(request, identity) for request in requests]
        # A chunk that repeats (a refrain, a stock phrase) is one job; the stitch places it every time.
        unique = list({chunk_key: request for chunk_key, request in zip(keys, requests, strict=True)}.values())
        total = len(unique)
        queue = queue_for(self.settings.queue, document.fields["mode"])
        try:  # from what is counted already: a redelivered document task must not reset its progress to 0
            self._count(task_id, total)
        except Exception as exc:  # progress is for watching: the document goes on without it
            logger.warning("document %s: could not store progress: %s", task_id, type(exc).__name__)
        ids = [str(uuid.uuid4()) for _ in unique]
        header = [
            self.app.signature(TASK_NAME, kwargs=request.to_dict(), queue=queue, task_id=ids[index],
                               headers={SENT_AT_HEADER: time.time(),
                                        DOCUMENT_HEADER: {"id": task_id, "index": index, "total": total}},
                               kwargsrepr=f"document chunk {index + 1}/{total} {request.describe()}")
            for index, request in enumerate(unique)
        ]
        plan = {
            "key": key,
            "format": document.fields["format"],
            "seed": seed,
            "characters": len(document.text),
            "options": asdict(document.options),
            "chunks": [{"key": chunk_key, "start": chunk.start, "end": chunk.end, "boundary": chunk.boundary,
                        # Sentence offsets and reading weights: enough to place them in time, no text.
                        "sentences": [[s.start, s.end, reading_seconds(document.text[s.start:s.end])]
                                      for s in chunk.sentences]}
                       for chunk_key, chunk in zip(keys, document.chunks, strict=True)],
        }
        body = self.app.signature(STITCH_TASK_NAME, kwargs={"plan": plan}, queue=queue,
                                  # Its argument is the chunk results, signed URLs and all: keep them out
                                  # of its task-sent event (Flower, `celery events`).
                                  argsrepr=f"<{total} chunk results>",
                                  kwargsrepr=f"stitch {total} chunks into {key[:12]}")
        logger.info("document %s: %d chunks (%d characters) for %s", task_id, total, len(document.text), key[:12])
        try:
            return task.replace(chord(header, body))
        finally:
            # Nobody here waits for these results; Celery would listen for them forever otherwise.
            stop_listening(self.app.backend, ids)
            stop_listening(self.app.backend, [task_id], unless_waited=True)

    # --- 2. progress, from each chunk job ------------------------------------------------------

    def chunk_done(self, header: Any, result: JobResult, *, node: str) -> None:
        """A chunk of a document finished: count it and publish the document's progress."""
        if not (isinstance(header, Mapping) and isinstance(header.get("id"), str)
                and isinstance(header.get("index"), int) and isinstance(header.get("total"), int)):
            return  # not ours to trust; the chunk itself is done
        doc_id, total = header["id"], header["total"]
        progress = self._count(doc_id, total, index=header["index"], duration_s=result["duration_s"])
        summary = f"{progress['chunks_done']}/{total} chunks, {progress['audio_s']:.1f} s of audio"
        try:
            with self.app.events.default_dispatcher(hostname=node) as dispatcher:
                # Flower takes an unknown event type as the task's state (PROGRESS) and shows the
                # ``result`` field, one of the few it keeps, on its task pages and API.
                dispatcher.send("task-progress", uuid=doc_id, **progress, result=summary)
        except Exception as exc:  # events are for watching; the state above is the record
            logger.debug("could not send a progress event: %s", type(exc).__name__)

    def _count(self, doc_id: str, total: int, *, index: int | None = None, duration_s: float = 0.0) -> Progress:
        """Record chunk ``index`` as done (if given) and store the document's progress from the count.

        Chunks of one batch finish together on several task threads (and workers): counting and
        storing under one lock per document keeps the stored progress from going backwards (a
        thread that counted 3 storing after one that counted 4)."""
        hash_key = PROGRESS_PREFIX + doc_id
        with self._redis.lock(hash_key + ":lock", timeout=10, blocking_timeout=10):
            pipe = self._redis.pipeline()
            if index is not None:
                # One field per chunk index: a redelivered chunk overwrites itself instead of counting twice.
                pipe.hset(hash_key, str(index), duration_s)
                pipe.expire(hash_key, self.settings.result_ttl_s)
            pipe.hvals(hash_key)
            values = pipe.execute()[-1]
            progress = Progress(chunks_done=len(values), chunks_total=total,
                                audio_s=round(sum(float(v) for v in values), 3))
            self._store_progress(doc_id, progress)
        return progress

    def _store_progress(self, doc_id: str, progress: Progress) -> None:
        from celery import states

        backend = self.app.backend
        # A chunk redelivered after the document finished must not turn its result back into progress.
        if backend.get_state(doc_id) in states.READY_STATES:
            return
        backend.store_result(doc_id, dict(progress), PROGRESS_STATE)

    # --- 3. the stitch task --------------------------------------------------------------------

    def stitch(self, task: Any, results: Any, plan: dict[str, Any]) -> DocumentResult:
        """Join the chunks of ``plan`` into the document's file; store and index it; return its result."""
        runtime = self.runtime
        key = plan["key"]
        task_id = task.request.id
        stored = self.stored(key)
        if stored is not None:  # a redelivered stitch, or a twin document that finished first
            runtime.cache.release(key, task_id)
            return self.result(stored, cached=True)
        cached_keys = {r["key"] for r in results if isinstance(r, Mapping) and r.get("cached")} \
            if isinstance(results, list) else set()
        options = Options(**plan["options"])
        started = time.perf_counter()
        pieces: list[npt.NDArray[np.float32]] = []
        rate = 0
        entries: list[StoredAudio] = []
        decoded: dict[str, tuple[npt.NDArray[np.float32], int]] = {}
        for chunk in plan["chunks"]:
            entry = runtime.cache.get(chunk["key"])
            if entry is None:
                # The chord fired without this chunk stored (a duplicate counted for it): not yet. Its
                # own job is still queued or running, so wait as long as one job may take.
                raise task.retry(countdown=2, max_retries=max(30, self.settings.job_timeout_s // 2 + 1),
                                 exc=JobFailed(f"chunk {chunk['key'][:12]} of document {key[:12]} is not stored"),
                                 # Celery drops these on retry; the arguments hold signed URLs.
                                 argsrepr=f"<{len(plan['chunks'])} chunk results>",
                                 kwargsrepr=f"stitch into {key[:12]}")
            if entry["object_key"] not in decoded:  # a repeated chunk is read once
                decoded[entry["object_key"]] = decode(runtime.storage.get(entry["object_key"]))
            samples, chunk_rate = decoded[entry["object_key"]]
            rate = rate or chunk_rate
            pieces.append(resample(samples, chunk_rate, rate))
            entries.append(entry)
        audio, spans = _join(pieces, rate, plan["chunks"], options)
        for span, chunk in zip(spans, plan["chunks"], strict=True):
            span["cached"] = chunk["key"] in cached_keys
        encoded = encode(audio, rate, plan["format"])
        target = object_key(key, plan["format"])
        if not runtime.storage.put(target, encoded.data, encoded.content_type):
            encoded = probe(runtime.storage.get(target), plan["format"])
        identity = runtime.engine.identity
        ignored = sorted({name for entry in entries for name in entry["ignored"]})
        audio_entry = StoredAudio(object_key=target, format=plan["format"], content_type=encoded.content_type,
                                  sample_rate=encoded.sample_rate, duration_s=encoded.duration_s,
                                  bytes=len(encoded.data), engine=identity.engine, model=identity.model,
                                  model_revision=identity.revision,
                                  truncated=any(entry["truncated"] for entry in entries), ignored=ignored)
        record = {"key": key, "audio": audio_entry, "chunks": spans,
                  "document": DocumentInfo(chunks=len(spans), cached_chunks=sum(span["cached"] for span in spans),
                                           characters=plan["characters"], seed=plan["seed"])}
        # Last: the index never points at an object that is not there.
        self._redis.set(DOCUMENT_PREFIX + key, canonical_json(record).decode(), ex=self.settings.cache_ttl_s or None)
        runtime.cache.release(key, task_id)
        self._redis.delete(PROGRESS_PREFIX + task_id)
        logger.info("document %s: stitched %d chunks into %s (%.2fs audio) in %.2fs", task_id, len(spans), key[:12],
                    encoded.duration_s, time.perf_counter() - started)
        return self.result(record, cached=False)

    def stored(self, key: str) -> dict[str, Any] | None:
        """The index record of a stitched document, if there is one."""
        return read_document(self._redis, key)

    def result(self, record: dict[str, Any], *, cached: bool) -> DocumentResult:
        """The public result for a stored document, with a URL signed now."""
        return document_result(record, url=self.runtime.storage.url(record["audio"]["object_key"],
                                                                    self.settings.url_expiry_s),
                               url_expires_s=self.settings.url_expiry_s, cached=cached, worker=self.runtime.node)

    def close(self) -> None:
        """Release the Redis connection."""
        self._redis.close()


def stop_listening(backend: Any, task_ids: Sequence[str], *, unless_waited: bool = False) -> None:
    """Stop this process listening for the results of tasks it sent but never waits for.

    Celery's Redis backend subscribes to the result channel of every task a process sends, and the
    group result of a chord keeps each header task waited on until its result is read; a worker
    never reads them, so every document would leave its chunk ids subscribed and referenced for
    the life of the process (celery/celery#3812, #4824). ``unless_waited`` keeps an id someone in
    this process does wait for (the embedded mode's client waits on its document in-process).
    """
    # Private Celery internals: a release that reshapes them must cost a subscription, never the job
    # (this runs after the chord is sent: raising here would fail a document that is running).
    try:
        consumer = getattr(backend, "result_consumer", None)
        pending = getattr(backend, "_pending_results", None)  # Celery 5.7: (concrete, weak) waiters by task id
        known = isinstance(pending, tuple) and all(isinstance(m, MutableMapping) for m in pending)
        mappings = list(cast("tuple[MutableMapping[str, Any], ...]", pending)) if known else []
    except Exception as exc:
        logger.debug("cannot read Celery's pending results: %s", type(exc).__name__)
        return
    for task_id in task_ids:
        try:
            if unless_waited and (not known or any(task_id in mapping for mapping in mappings)):
                continue  # someone here may wait for it: keep listening
            for mapping in mappings:
                mapping.pop(task_id, None)
            if consumer is not None:
                consumer.cancel_for(task_id)
        except Exception as exc:  # a lost subscription is harmless; failing the job is not
            logger.debug("could not unsubscribe from a result: %s", type(exc).__name__)


def read_document(client: Any, key: str) -> dict[str, Any] | None:
    """The index record of a stitched document (``client``: a Redis client of the cache database)."""
    import json

    raw = client.get(DOCUMENT_PREFIX + key)
    return None if raw is None else cast("dict[str, Any]", json.loads(raw))


def document_result(record: dict[str, Any], *, url: str, url_expires_s: int, cached: bool,
                    worker: str = "") -> DocumentResult:
    """The public result of a stored document."""
    base: dict[str, Any] = dict(record["audio"])
    base.update(key=record["key"], url=url, url_expires_s=url_expires_s, cached=cached, batch_size=0,
                timings=no_timings(), worker=worker, document=record["document"], chunks=record["chunks"])
    return cast(DocumentResult, base)


def _join(pieces: Sequence[npt.NDArray[np.float32]], rate: int, chunks: Sequence[Mapping[str, Any]],
          options: Options) -> tuple[npt.NDArray[np.float32], list[ChunkSpan]]:
    """Concatenate chunk audio: crossfade after a ``split`` chunk, silence after a sentence or paragraph.

    The length is exactly the sum of the chunks, minus each crossfade, plus each pause.
    """
    out: list[npt.NDArray[np.float32]] = []
    length = 0
    spans: list[ChunkSpan] = []
    fade = round(options.crossfade_ms * rate / 1000)
    for index, (samples, chunk) in enumerate(zip(pieces, chunks, strict=True)):
        start = length
        overlap = min(fade, out[-1].size, samples.size) if index and chunks[index - 1]["boundary"] == "split" else 0
        if overlap:
            # Equal-gain linear crossfade: a cut inside a sentence should not click or gap.
            ramp = np.linspace(0.0, 1.0, overlap, dtype=np.float32)
            out[-1] = np.concatenate([out[-1][:-overlap], out[-1][-overlap:] * (1.0 - ramp) + samples[:overlap] * ramp])
            samples = samples[overlap:]
            start -= overlap
        out.append(samples)
        length += samples.size
        end = length
        spans.append(ChunkSpan(index=index, key=str(chunk["key"]), start_char=int(chunk["start"]),
                               end_char=int(chunk["end"]), start_s=round(start / rate, 4), end_s=round(end / rate, 4),
                               boundary=str(chunk["boundary"]), cached=False,
                               sentences=_sentence_spans(chunk["sentences"], start / rate, end / rate)))
        pause_ms = {"sentence": options.sentence_pause_ms,
                    "paragraph": options.paragraph_pause_ms}.get(str(chunk["boundary"]), 0)
        if pause_ms and index < len(pieces) - 1:
            silence = np.zeros(round(pause_ms * rate / 1000), dtype=np.float32)
            out.append(silence)
            length += silence.size
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32), spans


def _sentence_spans(sentences: Sequence[Sequence[float]], start_s: float, end_s: float) -> list[SentenceSpan]:
    """Sentence times inside one chunk, shared out by reading length (the model does not report them)."""
    weights = [max(float(weight), 1e-6) for _, _, weight in sentences]
    total = sum(weights) or 1.0
    spans: list[SentenceSpan] = []
    at = start_s
    for (s_start, s_end, _), weight in zip(sentences, weights, strict=True):
        until = at + (end_s - start_s) * weight / total
        spans.append(SentenceSpan(start_char=int(s_start), end_char=int(s_end), start_s=round(at, 4),
                                  end_s=round(until, 4)))
        at = until
    if spans:
        spans[-1]["end_s"] = round(end_s, 4)
    return spans
