"""What a long document is: its validation, its key, its seed, and the shape of its result.

Producers and workers share this module, so both compute the same document key; the worker side (the
fan-out into chunk jobs, progress, the stitch) is ``ttsq.worker.documents``. The steps, and what the
shared seed does and does not promise for VoiceDesign: docs/documents.md.

Why one file over 400 lines: a reader's joins (``DocumentJoin``, where each chunk and its words start)
are the stitch's arithmetic on the plan defined here; kept apart, the two could drift.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, TypedDict, cast

from ttsq.constants import DOCUMENT_PREFIX, DOCUMENT_SCHEMA_VERSION
from ttsq.engines.base import FRAMES_PER_SECOND
from ttsq.errors import InvalidRequest
from ttsq.job import (
    FORMATS,
    SCHEDULING_FIELDS,
    JobResult,
    Lane,
    Limits,
    SynthesisRequest,
    check_characters,
    speakable,
)
from ttsq.keys import canonical_json
from ttsq.splitter import SPLITTER_VERSION, Chunk, normalize, split

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

    from ttsq.config import Settings
    from ttsq.engines.base import EngineIdentity

logger = logging.getLogger(__name__)

#: A content key as a plan holds it.
_HEX64 = re.compile(r"[0-9a-f]{64}")
#: How a chunk ends (``ttsq.splitter``): what the join after it is.
_BOUNDARIES = ("sentence", "paragraph", "split", "end")

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
        return cls(
            target_chars=settings.doc_target_chars,
            max_chars=settings.doc_max_chars,
            sentence_pause_ms=settings.doc_sentence_pause_ms,
            paragraph_pause_ms=settings.doc_paragraph_pause_ms,
            crossfade_ms=settings.doc_crossfade_ms,
        )

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
    #: Whether its chunks stream (``SynthesisRequest.stream``): not one of ``fields``, so not in its key.
    stream: bool = False
    #: The lane and tenant its chunks are sent with (``SynthesisRequest``): not in its key either.
    lane: Lane | None = None
    tenant: str = ""

    @classmethod
    def parse(
        cls,
        data: Mapping[str, Any],
        *,
        limits: Limits,
        max_document_chars: int,
        identity: EngineIdentity | None = None,
        default_options: Options | None = None,
    ) -> Document:
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
            raise InvalidRequest(
                "text",
                f"is {len(text)} characters; the document limit is {max_document_chars} (TTSQ_MAX_DOCUMENT_CHARS)",
            )
        options = Options.from_dict(data["options"]) if "options" in data else (default_options or Options())
        other = {name: value for name, value in data.items() if name not in ("text", "options", "deadline")}
        # The fields are checked once, with a stand-in text; each chunk is checked again below.
        template = SynthesisRequest.from_dict({**other, "text": "x"}, limits)
        fields = {
            name: value
            for name, value in template.to_dict().items()
            if name != "text" and name not in SCHEDULING_FIELDS
        }
        most = options.chunk_max(limits, identity, str(fields.get("instruct") or ""))
        chunks = split(text, target_chars=min(options.target_chars, most), max_chars=most)
        document = cls(
            text=text,
            fields=fields,
            options=options,
            chunks=chunks,
            stream=template.stream,
            lane=template.lane,
            tenant=template.tenant,
        )
        requests = document.requests(seed=0, limits=limits)
        if all(request is None for request in requests):
            raise InvalidRequest("text", "has nothing to speak (no letter, digit or ideograph)")
        for number, request in enumerate(requests):
            try:
                if identity is not None and request is not None:
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

    def requests(self, *, seed: int, limits: Limits) -> list[SynthesisRequest | None]:
        """One ordinary request per chunk. Chunks are WAV (lossless, and the default format, so shared
        with ordinary submits); the document's own format applies to the stitched file. A chunk with
        nothing to speak (a paragraph of dashes or asterisks) has None: the stitch keeps only its pause."""
        scheduling = {"stream": self.stream, "lane": self.lane, "tenant": self.tenant}
        return [
            SynthesisRequest.from_dict(
                {**self.fields, "text": chunk.text, "format": "wav", "seed": seed, **scheduling}, limits
            )
            if speakable(chunk.text)
            else None
            for chunk in self.chunks
        ]


def check_plan(plan: Any) -> None:
    """A stitch plan as ``fan_out`` writes it, read back from Redis or a message: untrusted, every field
    the stitch uses checked, ``InvalidRequest`` naming the first that is wrong."""

    def need(ok: bool, field: str, reason: str) -> None:
        if not ok:
            raise InvalidRequest(field, reason)

    need(isinstance(plan, Mapping), "plan", "is not a stitch plan ttsq made (expected a JSON object)")
    need(isinstance(plan.get("key"), str) and bool(_HEX64.fullmatch(plan["key"])), "plan.key", "is not a content key")
    need(plan.get("format") in FORMATS, "plan.format", f"expected one of {sorted(FORMATS)}")
    for name in ("seed", "characters"):
        value = plan.get(name)
        need(isinstance(value, int) and not isinstance(value, bool) and value >= 0, f"plan.{name}", "expected a count")
    need(isinstance(plan.get("seed_given", False), bool), "plan.seed_given", "expected true or false")
    need(isinstance(plan.get("queue", ""), str), "plan.queue", "expected a queue name")
    need(isinstance(plan.get("options"), Mapping), "plan.options", "expected a JSON object")
    Options.from_dict(plan["options"])
    chunks = plan.get("chunks")
    need(isinstance(chunks, list) and len(chunks) > 0, "plan.chunks", "expected a non-empty list")
    for number, chunk in enumerate(chunks):
        field = f"plan.chunks[{number}]"
        need(isinstance(chunk, Mapping), field, "expected a JSON object")
        need(
            isinstance(chunk.get("key"), str) and (chunk["key"] == "" or bool(_HEX64.fullmatch(chunk["key"]))),
            f"{field}.key",
            "is not a content key",
        )
        start, end = chunk.get("start"), chunk.get("end")
        need(
            all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)) and 0 <= start <= end,
            f"{field}.start",
            "expected character offsets 0 <= start <= end",
        )
        need(chunk.get("boundary") in _BOUNDARIES, f"{field}.boundary", f"expected one of {list(_BOUNDARIES)}")
        sentences = chunk.get("sentences")
        need(
            isinstance(sentences, list)
            and all(
                isinstance(s, list)
                and len(s) == 3
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in s)
                for s in sentences
            ),
            f"{field}.sentences",
            "expected [start, end, weight] triples",
        )


def joins(chunks: Sequence[Mapping[str, Any]], options: Options) -> tuple[list[int], list[int]]:
    """Per chunk, the crossfade with the one before (after a ``split``) and the pause after it."""
    boundaries = [str(chunk["boundary"]) for chunk in chunks]
    crossfades = [
        options.crossfade_ms if index and boundaries[index - 1] == "split" else 0 for index in range(len(chunks))
    ]
    pauses = [
        {"sentence": options.sentence_pause_ms, "paragraph": options.paragraph_pause_ms}.get(boundary, 0)
        for boundary in boundaries
    ]
    return crossfades, pauses


class DocumentJoin:
    """The stitch's joins, for a reader that plays a document while its chunks are made: feed it each
    chunk's audio in reading order (``add``), get back the stitched file's samples as 16-bit PCM as
    soon as no later chunk can change them. The same crossfades and pauses, the same arithmetic, as
    the stitch (``ttsq.worker.documents``): what a reader plays of a WAV document is the stored
    file's samples, byte for byte."""

    def __init__(self, plan: Any) -> None:
        check_plan(plan)
        #: The plan's chunks, in reading order (``key`` "" for a chunk with nothing to speak).
        self.chunks: list[Mapping[str, Any]] = list(plan["chunks"])
        self.crossfades, self.pauses = joins(self.chunks, Options(**plan["options"]))
        self.rate = 0
        self._joiner: Any = None
        self._next = 0
        self._deferred: list[int] = []  # chunks with nothing to speak before the first with audio

    def unique_keys(self) -> list[str]:
        """The chunk keys in the order the fan-out numbers its chunk jobs (each distinct key once)."""
        return list(dict.fromkeys(chunk["key"] for chunk in self.chunks if chunk["key"]))

    def add(self, index: int, samples: npt.NDArray[np.float32], rate: int) -> list[bytes]:
        """Chunk ``index``'s audio (float samples at ``rate``; empty for a chunk with nothing to speak)."""
        from ttsq.audio import Joiner, resample

        if index != self._next:
            raise ValueError(f"chunk {index} added out of order (expected {self._next})")
        self._next += 1
        if self._joiner is None:
            if samples.size == 0:  # its pause needs a rate: the first chunk with audio sets it
                self._deferred.append(index)
                return []
            self.rate = rate
            self._joiner = Joiner(rate)
            out = [piece for early in self._deferred for piece in self._join(early, samples[:0])]
            return out + self._join(index, samples)
        samples = resample(samples, rate, self.rate) if samples.size and rate != self.rate else samples
        return self._join(index, samples)

    def _join(self, index: int, samples: npt.NDArray[np.float32]) -> list[bytes]:
        from ttsq.audio import pcm16

        pause = self.pauses[index] if index < len(self.chunks) - 1 else 0
        blocks = self._joiner.add(samples, crossfade_ms=self.crossfades[index], pause_ms=pause)
        return [pcm16(block) for block in blocks if block.size]

    def start_s(self, index: int) -> float:
        """Where chunk ``index`` (added already) starts in the stitched file, in seconds: its words move by it."""
        return float(self._joiner.spans[index][0]) / self.rate if self._joiner is not None else 0.0

    def finish(self) -> list[bytes]:
        """What the last chunk left held."""
        from ttsq.audio import pcm16

        if self._joiner is None:
            return []
        return [pcm16(block) for block in self._joiner.finish() if block.size]


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
    """The ``PROGRESS`` state's meta: what ``ttsq status`` shows while a document runs, from its fan-out
    until its result: ``phase`` is ``synthesizing`` while chunks run, then ``stitching``."""

    chunks_done: int
    chunks_total: int
    audio_s: float
    phase: str


def read_document(client: Any, key: str) -> dict[str, Any] | None:
    """The index record of a stitched document (``client``: a Redis client of the cache database)."""
    raw = client.get(DOCUMENT_PREFIX + key)
    return None if raw is None else cast("dict[str, Any]", json.loads(raw))
