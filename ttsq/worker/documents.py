"""The worker side of long documents: fan out into chunk jobs, count progress, stitch one file.

What a document is (validation, key, seed, result shape) is ``ttsq.document``; this module runs it as
one Celery chord: the ``ttsq.document`` task replaces itself with ordinary ``ttsq.synthesize`` chunk
jobs, each accepted and sent (or deferred under the release window) through ``ttsq.sending`` as a part
of the chord, and a ``ttsq.stitch`` body that carries the document's id; each chunk
that succeeds counts towards the document's ``PROGRESS``; the stitch joins the stored chunks and
stores the file through the job pipeline's ``store_audio``. How and why, resume after a crash
included: docs/documents.md, "How a worker runs a document".

Why one file over 400 lines: fan-out, progress and stitch are the three steps of one chord and share
its keys and records.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict
from typing import IO, TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

import ttsq.tracing as tracing
from ttsq.app import default_lane, queue_for
from ttsq.audio import EncodedFile, Joiner, StreamEncoder, decode, join, resample
from ttsq.constants import (
    CHORD_HEADER,
    DOCUMENT_HEADER,
    DOCUMENT_PREFIX,
    DOCUMENT_TASK_NAME,
    PROGRESS_PREFIX,
    PROGRESS_STATE,
    SENT_AT_HEADER,
    STITCH_TASK_NAME,
    TASK_NAME,
)
from ttsq.delivery.fanout import Read, choose, drive
from ttsq.document import (
    ChunkSpan,
    Document,
    DocumentInfo,
    DocumentResult,
    Options,
    Progress,
    SentenceSpan,
    check_plan,
    joins,
    read_document,
)
from ttsq.engines.base import reading_seconds
from ttsq.errors import CorruptRecord, InvalidRequest, JobFailed, JobParked
from ttsq.job import StoredAudio, turn_of
from ttsq.keys import canonical_json, content_key
from ttsq.records.attempts import ParkedJob
from ttsq.records.plans import SENDING, chord_group_id, chunk_task_ids
from ttsq.records.scripts import register
from ttsq.results import checked_key
from ttsq.sending import Outgoing, sending
from ttsq.worker.pipeline import store_file

if TYPE_CHECKING:
    from celery import Celery

    from ttsq.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

#: How long a stitched document's progress hash stays, for chunk counts that arrive after the stitch.
STITCHED_PROGRESS_TTL_S = 600
#: The field of a document's progress hash that says its stitch has begun (beside one per chunk job).
_STITCHING = "stitching"
#: The field of a document's progress hash that counts its chunks with nothing to speak (no job: done
#: from the start, so that ``chunks_total`` is every chunk of the document from the first count on).
_SILENT = "silent"


class Documents:
    """The worker side of documents: fan out, count progress, stitch. One per worker app."""

    def __init__(self, app: Celery, runtime: WorkerRuntime) -> None:
        self.app = app
        self.runtime = runtime
        self.settings = runtime.settings
        self._redis = runtime.documents_redis
        # Runs on the result backend's client (Celery's), by SHA: registered here once, loaded there on
        # first use and again after a flushed script cache.
        self._progress_unless_done = register(self._redis, "progress_unless_done")

    # --- 1. the document task -------------------------------------------------------------------

    def fan_out(self, task: Any, kwargs: dict[str, Any]) -> Any:
        """Run the ``ttsq.document`` task: answer from the cache, or replace it with the chord: its chunk
        jobs, each sent through ``ttsq.sending`` as a part of the chord whose body is the stitch.

        The plan goes to Redis once (``ttsq.records.plans``); each chunk message carries its own chunk
        and the stitch body only the plan's reference. A redelivered document task whose chord is sent,
        or being sent, sends nothing and ends ``IGNORED``, as ``Task.replace`` does: the chord's stitch
        carries the document's id and stores its result."""
        from celery.exceptions import Ignore

        runtime = self.runtime
        started = time.perf_counter()
        identity = runtime.engine.identity
        document = Document.parse(
            kwargs,
            limits=runtime.limits,
            max_document_chars=self.settings.max_document_chars,
            identity=identity,
            default_options=Options.from_settings(self.settings),
        )
        key = document.key(identity)
        task_id = task.request.id
        stored = self.stored(key)
        if stored is not None:
            runtime.cache.release(key, task_id)
            logger.info("document %s: cached %s", task_id, key[:12])
            return runtime.results.document(stored, cached=True)
        plans = runtime.redis.plans
        state = plans.fan_out_state(task_id)
        resuming = state == SENDING and bool((task.request.delivery_info or {}).get("redelivered"))
        if resuming:
            # Given back while its fan-out was under way: the worker sending it died half way (a live
            # one keeps its message). The fan-out resumes below, sending only the chunks it never sent.
            plans.forget_fan_out(task_id)
        elif state is not None:  # before the work below: a redelivery costs nothing
            logger.info("document %s: redelivered; its chunks are sent already", task_id)
            raise Ignore()
        seed = document.seed(identity)
        requests = document.requests(seed=seed, limits=runtime.limits)
        # A chunk with nothing to speak has no job and no key: the stitch keeps its pause alone.
        keys = [content_key(request, identity) if request is not None else "" for request in requests]
        # A chunk that repeats (a refrain, a stock phrase) is one job; the stitch places it every time.
        unique = list({k: r for k, r in zip(keys, requests, strict=True) if r is not None}.values())
        jobs = len(unique)
        # Progress counts every chunk, as the submit's answer and the result do: a job counts done the
        # chunks it stands for (its weight), a chunk with nothing to speak is done from the start.
        total = len(keys)
        weights = _weights(keys)
        lane = document.lane or default_lane(DOCUMENT_TASK_NAME, stream=document.stream)
        queue = queue_for(self.settings.queue, document.fields["mode"], lane)  # the chunks' queue
        plan = {
            "key": key,
            "format": document.fields["format"],
            "seed": seed,
            # Every chunk carries a seed; a derived one is not the user's, so espeak ignoring it is no news.
            "seed_given": document.fields.get("seed") is not None,
            "characters": len(document.text),
            "queue": queue,
            "options": asdict(document.options),
            "chunks": [
                {
                    "key": chunk_key,
                    "start": chunk.start,
                    "end": chunk.end,
                    "boundary": chunk.boundary,
                    # Sentence offsets and reading weights: enough to place them in time, no text.
                    "sentences": [
                        [s.start, s.end, reading_seconds(document.text[s.start : s.end])] for s in chunk.sentences
                    ],
                }
                for chunk_key, chunk in zip(keys, document.chunks, strict=True)
            ],
        }
        plans.save(task_id, plan, chunks=jobs)
        # The lease outlives any fan-out; one whose worker died is redelivered within seconds and resumes.
        if not plans.begin_fan_out(task_id, lease_s=self.settings.visibility_timeout_s):
            logger.info("document %s: redelivered while its chunks are sent; sending nothing", task_id)
            raise Ignore()
        try:  # from what is counted already: a redelivered document task must not reset its progress to 0
            self._count(task_id, total, silent=keys.count(""))
        except Exception as exc:  # progress is for watching: the document goes on without it
            logger.warning("document %s: could not store progress: %s", task_id, type(exc).__name__)
        # Deterministic: a fan-out sent again (its first try died half way) sends the same chunk ids.
        ids = chunk_task_ids(task_id, jobs)
        sent_at = time.time()
        # The fan-out's trace goes on in every chunk and in the stitch (``ttsq.tracing``).
        traced: dict[str, Any] = {}
        tracing.inject(traced)
        tracing.annotate({"ttsq.content_key": key, "ttsq.chunks": jobs, "ttsq.mode": document.fields["mode"]})
        group_id = chord_group_id(task_id)  # the same for every fan-out: a resumed one joins the first one's count
        body = self.app.signature(
            STITCH_TASK_NAME,
            # A reference, not the plan: every chunk message carries the chord's body.
            kwargs={"plan": task_id, "key": key},
            queue=queue,
            headers=traced,
            # Its argument is the chunk results, signed URLs and all: keep them out
            # of its task-sent event (Flower, `celery events`).
            argsrepr=f"<{jobs} chunk results>",
            kwargsrepr=f"stitch {jobs} chunks into {key[:12]}",
        )
        body.freeze(task_id)  # as ``Task.replace`` freezes a chord: the stitch carries the document's id
        stitch = json.loads(json.dumps(body))  # the body as each chunk's record keeps it, plain JSON
        # A tenant's chunks wait under the release window in a place of their own (``turn_of``).
        tenant = turn_of(document.tenant, chunk=True)
        chunks = [
            Outgoing(
                task_id=ids[index],
                task=TASK_NAME,
                queue=queue,
                kwargs=request.to_dict(),
                headers={
                    **traced,
                    SENT_AT_HEADER: sent_at,
                    DOCUMENT_HEADER: {"id": task_id, "index": index, "total": total, "weight": weight},
                    CHORD_HEADER: {"group": group_id, "index": index, "body": stitch},
                },
                kwargsrepr=f"document chunk {index + 1}/{jobs} {request.describe()}",
                tenant=tenant,
            )
            for index, (request, weight) in enumerate(zip(unique, weights, strict=True))
        ]
        try:
            # Celery sets a chord's size as it sends the last part: set here, before any chunk is sent, it
            # is there for the last chunk to finish, whichever that is and whoever sent it. Its size is the
            # chunk jobs, not the chunks (a repeated chunk is one job, one with nothing to speak none).
            self.app.backend.set_chord_size(group_id, jobs)
            sent = self._send_chunks(chunks)
        except BaseException:
            plans.forget_fan_out(task_id)  # not sent: the next delivery (a Celery retry, the sweeper) tries again
            raise
        plans.fanned_out(task_id)
        if resuming:
            logger.info("document %s: redelivered half sent; %d of %d chunks sent again", task_id, sent, jobs)
        else:
            logger.info(
                "document %s: %d chunks (%d characters) for %s, sent in %.2fs",
                task_id,
                total,
                len(document.text),
                key[:12],
                time.perf_counter() - started,
            )
        # Replaced by its chunks and their stitch, which stores the document's result under its id.
        raise Ignore()

    def _send_chunks(self, chunks: Sequence[Outgoing]) -> int:
        """Send each chunk that no fan-out of the document sent before, through ``ttsq.sending`` (accepted,
        then sent or deferred under the release window); return how many were sent.

        A chunk is sent once, by ``ttsq.delivery.fanout.unsent``: only if it has neither an accepted record
        (written before its message) nor a result, the records read first (why the order matters, and
        why the broker is not asked: its docstring)."""
        ids = [chunk.task_id for chunk in chunks]
        accepted = self.runtime.accepted
        backend = self.app.backend

        def read(what: Read) -> Collection[str]:  # in the order the rule asks (``ttsq.delivery.fanout``)
            if what is Read.RECORDS:
                return accepted.tasks(ids)
            results = backend.client.mget([backend.get_key_for_task(task_id) for task_id in ids])
            return {task_id for task_id, result in zip(ids, results, strict=True) if result is not None}

        todo = set(drive(choose(ids), read))
        window = self.settings.release_window
        sent = 0
        for chunk in chunks:
            if chunk.task_id not in todo:
                continue
            # No cap: the document counts against its tenant's, and waits for these (docs/scheduling.md).
            with sending(self.app, accepted, chunk, window=window, scope=self.settings.queue, traced=False) as send:
                send()
            sent += 1
        return sent

    # --- 2. progress, from each chunk job ------------------------------------------------------

    def chunk_succeeded(self, sender: Any = None, result: Any = None, **_: Any) -> None:
        """Celery's ``task_success`` for ``ttsq.synthesize``: if the job was a document's chunk, count it
        and publish the document's progress. Other jobs pass by untouched."""
        header = sender.request.get(DOCUMENT_HEADER) if sender is not None and sender.request is not None else None
        if header is None or not isinstance(result, Mapping):
            return
        if not (
            isinstance(header, Mapping)
            and isinstance(header.get("id"), str)
            and isinstance(header.get("index"), int)
            and isinstance(header.get("total"), int)
        ):
            return  # not ours to trust; the chunk itself is done
        weight = header.get("weight", 1)  # absent from a chunk sent before progress counted every chunk
        if not isinstance(weight, int) or isinstance(weight, bool) or not 1 <= weight <= header["total"]:
            return
        try:
            self._chunk_done(header["id"], header["total"], header["index"], float(result["duration_s"]), weight)
        except Exception as exc:  # progress is for watching: the chunk itself is done and stored
            logger.warning("document %s: could not record progress: %s", header["id"], type(exc).__name__)

    def _chunk_done(self, doc_id: str, total: int, index: int, duration_s: float, weight: int) -> None:
        node = self.runtime.node
        self.runtime.accepted.touch(doc_id)  # the document is making progress (``ttsq.worker.sweeper``)
        progress = self._count(doc_id, total, done={index: (duration_s, weight)})
        if progress["phase"] == "stitching":
            # The last chunk's own count runs after the chord join has sent the stitch, which counts
            # every chunk itself and may have finished already: an event now would reach Flower after
            # the document's task-succeeded and replace its result with this count.
            return
        summary = f"{progress['chunks_done']}/{total} chunks, {progress['audio_s']:.1f} s of audio"
        try:
            with self.app.events.default_dispatcher(hostname=node) as dispatcher:
                # Flower takes an unknown event type as the task's state (PROGRESS) and shows the
                # ``result`` field, one of the few it keeps, on its task pages and API.
                dispatcher.send("task-progress", uuid=doc_id, **progress, result=summary)
        except Exception as exc:  # events are for watching; the state above is the record
            logger.debug("could not send a progress event: %s", type(exc).__name__)

    def _count(
        self,
        doc_id: str,
        total: int,
        *,
        done: Mapping[int, tuple[float, int]] | None = None,
        silent: int = 0,
        stitching: bool = False,
    ) -> Progress:
        """Record chunk jobs as done (``done``: job index -> its audio seconds and the chunks it stands
        for), ``silent`` chunks (nothing to speak) and the stitch as started if so, then store the
        document's progress from the count: ``chunks_total`` is every chunk of the document.

        Chunks of one batch finish together on several task threads (and workers): counting and
        storing under one lock per document keeps the stored progress from going backwards (a
        thread that counted 3 storing after one that counted 4, or a redelivered chunk storing
        ``synthesizing`` after the stitch began)."""
        hash_key = PROGRESS_PREFIX + doc_id
        with self._redis.lock(hash_key + ":lock", timeout=10, blocking_timeout=10):
            pipe = self._redis.pipeline()
            # One field per job index: a redelivered chunk overwrites itself instead of counting twice.
            for index, (seconds, weight) in (done or {}).items():
                pipe.hset(hash_key, str(index), f"{seconds} {weight}")
            if silent:
                pipe.hset(hash_key, _SILENT, silent)
            if stitching:
                pipe.hset(hash_key, _STITCHING, 1)
            if done or silent or stitching:
                pipe.expire(hash_key, self.settings.result_ttl_s)
            pipe.hgetall(hash_key)
            fields = pipe.execute()[-1]
            if _STITCHING in fields and not stitching:
                self._redis.expire(hash_key, STITCHED_PROGRESS_TTL_S)  # a late chunk: the stitch's TTL holds
            jobs = [_counted(value) for name, value in fields.items() if name not in (_STITCHING, _SILENT)]
            progress = Progress(
                chunks_done=min(total, sum(weight for _, weight in jobs) + int(fields.get(_SILENT, 0))),
                chunks_total=total,
                audio_s=round(sum(seconds * weight for seconds, weight in jobs), 3),
                phase="stitching" if _STITCHING in fields else "synthesizing",
            )
            self._store_progress(doc_id, progress)
        return progress

    def _store_progress(self, doc_id: str, progress: Progress) -> None:
        """Store ``PROGRESS`` as the document's state unless it has finished: one Lua call, so a chunk
        redelivered after the stitch (or a stitch finishing meanwhile) never turns its result back
        into progress. The record has the shape Celery's Redis backend writes and publishes."""
        backend = self.app.backend
        meta: dict[str, Any] = {
            "status": PROGRESS_STATE,
            "result": dict(progress),
            "traceback": None,
            "children": [],
            "date_done": None,
            "task_id": doc_id,
        }
        expires = int(backend.expires or 0)
        key = backend.get_key_for_task(doc_id)
        self._progress_unless_done(keys=[key], args=[backend.encode(meta), expires], client=backend.client)

    # --- 3. the stitch task --------------------------------------------------------------------

    def stitch(self, task: Any, results: Any, plan_ref: Any, key_ref: Any = None) -> DocumentResult:
        """Join the chunks of the document's plan into its file; store and index it; return its result.

        Streams: chunks are read, joined, resampled and encoded one at a time into a temporary file that
        goes up in parts, so what it holds is a few chunks whatever the document's length. A stitch
        that killed or hung its worker ``max_attempts`` times is parked, as an engine job is."""
        runtime = self.runtime
        task_id = task.request.id
        plan = self._plan(plan_ref, key_ref)
        key = plan["key"]
        tracing.annotate({"ttsq.content_key": key, "ttsq.chunks": len(plan["chunks"])})
        stored = self.stored(key)
        if stored is not None:  # a redelivered stitch, or a twin document that finished first
            runtime.cache.release(key, task_id)
            return runtime.results.document(stored, cached=True)
        attempts = runtime.ledger.attempts(task_id)
        if attempts >= self.settings.max_attempts:
            self._park(task, plan, attempts)
        cached_keys = (
            {r["key"] for r in results if isinstance(r, Mapping) and r.get("cached")}
            if isinstance(results, list)
            else set()
        )
        keys = [chunk["key"] for chunk in plan["chunks"]]
        weights = _weights(keys)
        # The chord fired: every chunk has returned, though the last one's own count (``task_success``
        # comes after the chord join) may not be in yet. Count them all from the results here.
        done = {
            index: (float(r["duration_s"]), weights[index])
            for index, r in enumerate(results if isinstance(results, list) else [])
            if index < len(weights) and isinstance(r, Mapping) and isinstance(r.get("duration_s"), (int, float))
        }
        try:  # the document's state keeps its progress while it is stitched: never back to STARTED
            self._count(task_id, len(keys), done=done, silent=keys.count(""), stitching=True)
        except Exception as exc:  # progress is for watching: the stitch goes on without it
            logger.warning("document %s: could not store progress: %s", task_id, type(exc).__name__)
        started = time.perf_counter()
        entries: list[StoredAudio | None] = []
        for chunk in plan["chunks"]:
            entry = runtime.cache.get(chunk["key"]) if chunk["key"] else None  # no key: nothing to speak
            if chunk["key"] and entry is None:
                # The chord fired without this chunk stored (a duplicate counted for it): not yet. Its
                # own job is still queued or running, so wait as long as one job may take.
                raise task.retry(
                    countdown=2,
                    max_retries=max(30, self.settings.job_timeout_s // 2 + 1),
                    exc=JobFailed(f"chunk {chunk['key'][:12]} of document {key[:12]} is not stored"),
                    # Celery drops these on retry; the arguments hold signed URLs.
                    argsrepr=f"<{len(plan['chunks'])} chunk results>",
                    kwargsrepr=f"stitch into {key[:12]}",
                )
            entries.append(entry)
        present = [entry for entry in entries if entry is not None]
        rate = _entry_rate(present[0]) if present else 0
        options = Options(**plan["options"])
        joiner = Joiner(rate)
        # Charged while it runs, refunded when it returns or raises: what stays charged counts the
        # stitches that died with their worker.
        runtime.ledger.charge(task_id)
        try:
            saved = store_file(
                runtime.storage,
                lambda handle: self._write(handle, plan, entries, joiner, options, rate),
                key=key,
                audio_format=plan["format"],
                identity=runtime.engine.identity,
                truncated=any(entry["truncated"] for entry in present),
                ignored=sorted(
                    {
                        name
                        for entry in present
                        for name in entry["ignored"]
                        if name != "seed" or plan.get("seed_given", True)
                    }
                ),
                index=lambda entry: self._index(
                    key, self._words(key, entry, entries, joiner, rate), plan, joiner, rate, cached_keys
                ),
            )
        finally:
            runtime.ledger.refund(task_id)
        runtime.cache.release(key, task_id)
        # Not deleted: a chunk whose count comes after the stitch must still find the stitching mark
        # (``_chunk_done``); the hash goes once nothing late can come.
        self._redis.expire(PROGRESS_PREFIX + task_id, STITCHED_PROGRESS_TTL_S)
        logger.info(
            "document %s: stitched %d chunks into %s (%.2fs audio) in %.2fs",
            task_id,
            len(plan["chunks"]),
            key[:12],
            saved.audio["duration_s"],
            time.perf_counter() - started,
        )
        return runtime.results.document(saved.record, cached=False)

    def _plan(self, plan_ref: Any, key_ref: Any) -> dict[str, Any]:
        """The stitch's plan: read by reference (a document's task id) and checked against the document
        key its message names; a plan inside the message (sent before plans were stored) is checked alike."""
        if isinstance(plan_ref, Mapping):
            plan: Any = plan_ref
        elif isinstance(plan_ref, str) and 0 < len(plan_ref) <= 200:
            plan = self.runtime.redis.plans.load(plan_ref)
            if plan is None:
                raise JobFailed(f"document {plan_ref[:64]}: its plan is gone (expired after TTSQ_RESULT_TTL_S)")
        else:
            raise InvalidRequest("plan", "expected the reference of a stored plan (the document's task id)")
        check_plan(plan)
        if key_ref is not None and key_ref != plan["key"]:
            raise InvalidRequest("key", "is not the document key of the plan it names")
        return cast("dict[str, Any]", plan)

    def _write(
        self,
        handle: IO[bytes],
        plan: Mapping[str, Any],
        entries: Sequence[StoredAudio | None],
        joiner: Joiner,
        options: Options,
        rate: int,
    ) -> EncodedFile:
        """Encode the joined chunks into ``handle``, one chunk at a time."""
        chunks = plan["chunks"]
        crossfades, pauses = joins(chunks, options)
        encoder = StreamEncoder(handle, rate, plan["format"])
        # No time bound: the worker renews its held messages' delivery time while it lives
        # (``ttsq.worker.recovery``), so however long the stitch, no redelivery starts a second one.
        for index, entry in enumerate(entries):
            if entry is None:
                samples = np.zeros(0, dtype=np.float32)
            else:
                stored_key = checked_key(entry.get("object_key"))  # an index entry read back: data, not a path
                samples, chunk_rate = decode(self.runtime.storage.get(stored_key))
                samples = resample(samples, chunk_rate, rate)
            pause = pauses[index] if index < len(chunks) - 1 else 0
            for block in joiner.add(samples, crossfade_ms=crossfades[index], pause_ms=pause):
                encoder.write(block)
        for block in joiner.finish():
            encoder.write(block)
        return encoder.close()

    def _index(
        self,
        key: str,
        entry: StoredAudio,
        plan: Mapping[str, Any],
        joiner: Joiner,
        rate: int,
        cached_keys: set[str],
    ) -> dict[str, Any]:
        """Write the document's index record (after its file is stored) and return it."""
        spans = chunk_spans(plan["chunks"], joiner.spans, rate)
        for span in spans:
            span["cached"] = span["key"] in cached_keys
        info = DocumentInfo(
            chunks=len(spans),
            cached_chunks=sum(span["cached"] for span in spans),
            characters=plan["characters"],
            seed=plan["seed"],
        )
        record = {"key": key, "audio": entry, "chunks": spans, "document": info}
        ttl_s = self.settings.cache_ttl_s or None
        self._redis.set(DOCUMENT_PREFIX + key, canonical_json(record).decode(), ex=ttl_s)
        return record

    def _words(
        self, key: str, entry: StoredAudio, entries: Sequence[StoredAudio | None], joiner: Joiner, rate: int
    ) -> StoredAudio:
        """The document's index entry, naming its words once they are stored (if its chunks have them)."""
        target = self.runtime.pipeline.word_times.document(key, entries, joiner.spans, rate)
        return entry if target is None else {**entry, "words_key": target}

    def _park(self, task: Any, plan: Mapping[str, Any], attempts: int) -> None:
        task_id = task.request.id
        error = (
            f"the stitch of document {task_id} died with its worker {attempts} times (it crashed or hung "
            "it each time); parked: `ttsq failed` lists it"
        )
        queue = str(plan.get("queue") or self.settings.queue)
        self.runtime.ledger.park(
            ParkedJob(
                id=task_id,
                queue=queue,
                kwargs={"plan": task_id, "key": plan["key"]},
                attempts=attempts,
                error=error,
                parked_at=time.time(),
                task=STITCH_TASK_NAME,  # `ttsq retry` sends the stitch again, not a job
            )
        )
        self.runtime.observer.job_parked(task_id)
        logger.error("document %s: stitch parked after %d unfinished attempts", task_id, attempts)
        raise JobParked(error)

    def stored(self, key: str) -> dict[str, Any] | None:
        """The index record of a stitched document, if there is one."""
        return read_document(self._redis, key)


def _entry_rate(entry: Mapping[str, Any]) -> int:
    """The sample rate of a chunk's index entry, read back: a positive count."""
    rate = entry.get("sample_rate")
    if isinstance(rate, bool) or not isinstance(rate, int) or not 0 < rate <= 384_000:
        raise CorruptRecord("a chunk's index entry: sample_rate", "is not a sample rate")
    return rate


def chunk_spans(chunks: Sequence[Mapping[str, Any]], edges: Sequence[tuple[int, int]], rate: int) -> list[ChunkSpan]:
    """Each chunk's span in the stitched audio, from its (start, end) sample there."""
    return [
        ChunkSpan(
            index=index,
            key=str(chunk["key"]),
            start_char=int(chunk["start"]),
            end_char=int(chunk["end"]),
            start_s=round(start / rate, 4),
            end_s=round(end / rate, 4),
            boundary=str(chunk["boundary"]),
            cached=False,
            sentences=_sentence_spans(chunk["sentences"], start / rate, end / rate),
        )
        for index, (chunk, (start, end)) in enumerate(zip(chunks, edges, strict=True))
    ]


def join_chunks(
    pieces: Sequence[npt.NDArray[np.float32]], rate: int, chunks: Sequence[Mapping[str, Any]], options: Options
) -> tuple[npt.NDArray[np.float32], list[ChunkSpan]]:
    """Concatenate chunk audio: crossfade after a ``split`` chunk, silence after a sentence or paragraph.
    The stitch's own join (which runs it a chunk at a time), whole, for the fidelity tests' faulted
    stitches."""
    crossfades, pauses = joins(chunks, options)
    audio, edges = join(pieces, rate, crossfades_ms=crossfades, pauses_ms=pauses)
    return audio, chunk_spans(chunks, edges, rate)


def _sentence_spans(sentences: Sequence[Sequence[float]], start_s: float, end_s: float) -> list[SentenceSpan]:
    """Sentence times inside one chunk, shared out by reading length (the model does not report them)."""
    weights = [max(float(weight), 1e-6) for _, _, weight in sentences]
    total = sum(weights) or 1.0
    spans: list[SentenceSpan] = []
    at = start_s
    for (s_start, s_end, _), weight in zip(sentences, weights, strict=True):
        until = at + (end_s - start_s) * weight / total
        spans.append(
            SentenceSpan(start_char=int(s_start), end_char=int(s_end), start_s=round(at, 4), end_s=round(until, 4))
        )
        at = until
    if spans:
        spans[-1]["end_s"] = round(end_s, 4)
    return spans


def _weights(keys: list[str]) -> list[int]:
    """How many chunks each chunk job stands for, in job order (the order of first appearance of each
    non-empty key, as the fan-out sends them)."""
    return list(Counter(key for key in keys if key).values())


def _counted(value: str) -> tuple[float, int]:
    """A job's field of the progress hash: ``"<seconds> <weight>"``, or the bare seconds a worker wrote
    before progress counted every chunk (weight 1)."""
    seconds, _, weight = value.partition(" ")
    return float(seconds), int(weight or 1)
