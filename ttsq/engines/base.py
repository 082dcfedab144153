"""What an engine is: its identity (part of every content key) and its protocol, batch in, batch out.

``EngineIdentity`` names the model that renders the audio and what it can serve (modes, languages,
speakers, frame and prompt limits); workers announce it in Redis, and producers read it to predict
content keys and to refuse at submit time what the fleet cannot serve.

An engine turns a list of requests that can share a forward pass into a list of outputs, one per
request, in order. A failed item comes back as an exception *in its slot*, so it fails only its own
job; an exception raised by ``synthesize_batch`` itself means the whole batch failed, and the batcher
then retries the items one by one to find the culprit. One thread (the batcher's) owns an engine.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from ttsq.errors import InvalidRequest

if TYPE_CHECKING:
    # Types only: producers (the command line, a web backend's Client) import this module for
    # EngineIdentity and never touch samples, so they need not pay numpy's import (0.07 s a process).
    import numpy as np
    import numpy.typing as npt

    from ttsq.alignment import Word
    from ttsq.config import Settings
    from ttsq.job import SynthesisRequest


#: Qwen3-TTS's codec runs at 12.5 frames per second of audio; ``max_new_tokens`` counts these frames.
FRAMES_PER_SECOND = 12.5

# Slow-speaker reading times, in seconds per character. A syllabic or logographic character (Hangul,
# Han, kana) is read in about 0.15-0.25 s, a Latin or Cyrillic letter in about 0.07 s; these take the
# slow end so that no honest sentence hits its cap.
_SECONDS_PER_WIDE_CHAR = 0.3
_SECONDS_PER_CHAR = 0.09
_SECONDS_PER_SPACE_OR_MARK = 0.04
_CAP_MARGIN = 1.5
_CAP_FLOOR_S = 2.0


#: Bump when ``frame_cap`` changes: the cap shapes truncated audio, so it is part of the model revision.
FRAME_CAP_VERSION = 1


def reading_seconds(text: str) -> float:
    """How long a slow, unhurried reading of ``text`` lasts, about."""
    seconds = 0.0
    for ch in text:
        if unicodedata.east_asian_width(ch) in ("W", "F"):
            seconds += _SECONDS_PER_WIDE_CHAR
        elif ch.isalnum():
            seconds += _SECONDS_PER_CHAR
        else:
            seconds += _SECONDS_PER_SPACE_OR_MARK
    return seconds


def frame_cap(text: str, hard_cap: int) -> int:
    """The most codec frames an honest reading of ``text`` needs, with margin, at most ``hard_cap``.

    A model that never samples its end token (the runaway of Qwen3-TTS issues) would otherwise talk
    until ``max_new_tokens``: this bounds every item by its own text.
    """
    frames = math.ceil((reading_seconds(text) * _CAP_MARGIN + _CAP_FLOOR_S) * FRAMES_PER_SECOND)
    return min(frames, hard_cap)


@dataclass(frozen=True, kw_only=True)
class EngineIdentity:
    """What model renders the audio: part of every content key."""

    engine: str
    model: str
    revision: str
    sample_rate: int
    modes: tuple[str, ...] = ("voice_design",)
    languages: tuple[str, ...] = ()
    #: CustomVoice checkpoints: the speakers it knows (lowercase).
    speakers: tuple[str, ...] = ()
    #: Longest item in codec frames (12.5 per second); 0 when the engine has no such limit.
    max_frames: int = 0
    #: Most UTF-8 bytes of text plus instruct that fit the engine's prompt; 0 when it has no such limit.
    #: Bytes, because the producer has no tokenizer, and a byte-level BPE never makes more tokens than bytes.
    max_prompt_bytes: int = 0

    def check(self, request: SynthesisRequest) -> None:
        """Refuse, naming the field, a request this model cannot serve (mode, language, speaker).

        Producers call it at submit time with the identity the workers announced; workers call it
        again on every message, since a raw ``send_task`` never met a producer.
        """
        if request.mode not in self.modes:
            raise InvalidRequest(
                "mode",
                f"{request.mode} is not served by the {self.engine} workers "
                f"(model {self.model} serves {', '.join(self.modes)})",
            )
        if self.languages and request.language not in self.languages:
            raise InvalidRequest(
                "language",
                f"{request.language} is not spoken by model {self.model}; expected one of {', '.join(self.languages)}",
            )
        if request.mode == "custom_voice" and request.speaker.lower() not in self.speakers:
            raise InvalidRequest(
                "speaker",
                f"unknown speaker {request.speaker[:40]!r} for model {self.model}; "
                f"expected one of {', '.join(self.speakers) or '(none)'}",
            )
        if self.max_frames:
            limit_s = self.max_frames / FRAMES_PER_SECOND
            if request.max_new_tokens is not None and request.max_new_tokens > self.max_frames:
                raise InvalidRequest(
                    "max_new_tokens",
                    f"{request.max_new_tokens} is above this model's limit "
                    f"of {self.max_frames} frames ({limit_s:.0f} s)",
                )
            # Refuse what would certainly be cut (even read fast), instead of returning it truncated.
            if reading_seconds(request.text) / 2 > limit_s:
                raise InvalidRequest(
                    "text",
                    f"is about {reading_seconds(request.text) / 2:.0f}-"
                    f"{reading_seconds(request.text):.0f} s of speech; this model's limit "
                    f"is {limit_s:.0f} s per job (TTSQ_QWEN_MAX_FRAMES); split it",
                )

        if self.max_prompt_bytes:
            size = len(request.text.encode()) + len(request.instruct.encode())
            if size > self.max_prompt_bytes:
                raise InvalidRequest(
                    "text",
                    f"with its instruct is {size} bytes of UTF-8; the {self.engine} "
                    f"workers take at most {self.max_prompt_bytes}; split it",
                )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON, as workers publish it in Redis."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineIdentity:
        """The identity a worker published."""
        return cls(
            engine=data["engine"],
            model=data["model"],
            revision=data["revision"],
            sample_rate=int(data["sample_rate"]),
            modes=tuple(data.get("modes", ())),
            languages=tuple(data.get("languages", ())),
            speakers=tuple(data.get("speakers", ())),
            max_frames=int(data.get("max_frames", 0)),
            max_prompt_bytes=int(data.get("max_prompt_bytes", 0)),
        )


@dataclass(frozen=True)
class EngineOutput:
    """Audio for one request."""

    samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]
    sample_rate: int
    #: Hit the frame cap without an end token.
    truncated: bool = False
    #: Request fields this engine could not honour.
    ignored: tuple[str, ...] = field(default=())
    #: When each word of the text is said, for an engine that knows (``timestamps`` asked, espeak's word
    #: events); None: the worker's aligner finds them (``ttsq.alignment``).
    words: tuple[Word, ...] | None = None


#: Receives a streaming row's audio while the engine makes it (``SynthesisRequest.stream``): each call
#: hands over the next samples, in order (mono, float32 in [-1, 1] or int16, at the engine's rate);
#: ``None`` says the row starts over (it is run again, after a failure it shared with others), so
#: what was handed over so far is not part of its audio. Called on the batcher thread or an engine's
#: decode thread: it only hands the samples over and returns, never waits on I/O.
Piece: TypeAlias = "Callable[[npt.NDArray[Any] | None], object]"


def word_sink(piece: Piece | None) -> Callable[[Sequence[Word]], object] | None:
    """Where a streaming row's words go as the engine times them, if anywhere: a ``Piece`` with a
    ``put_words`` method (the worker's stream writer) takes the row's next words, in order (times in
    seconds of the row's audio), never waiting on I/O; each goes out with the piece that completes it,
    so an engine hands a word over as soon as it is timed, before or after those samples. An engine that
    times its words while it speaks (espeak's word events) hands them over this way; any engine's words
    also come with its output."""
    sink = getattr(piece, "put_words", None)
    return sink if callable(sink) else None


def streams_audio(engine: object) -> bool:
    """Whether an engine hands streaming rows their audio while it makes them (a true
    ``streams_audio`` attribute): ``synthesize_batch`` then takes ``pieces`` (one ``Piece`` or None
    per request), a ``ContinuousEngine``'s ``admit`` a ``piece``. Each streaming row's output is then
    exactly the samples it handed over, so the stored file is what its readers heard. Other engines'
    rows are streamed by the worker once their call returns, in one go."""
    return getattr(engine, "streams_audio", False) is True


class Engine(Protocol):
    """A speech model behind the batcher. Every method is called from the batcher thread only."""

    identity: EngineIdentity

    def load(self) -> None:
        """Load weights; called once, before the worker consumes."""
        ...

    def warmup(self) -> None:
        """Run a tiny synthesis so the first real job pays no first-call costs."""
        ...

    def synthesize_batch(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        """One output or exception per request, in order."""
        ...

    def close(self) -> None:
        """Release the model."""
        ...


class EngineFactory(Protocol):
    def __call__(self, settings: Settings) -> Engine: ...


class ContinuousEngine(Engine, Protocol):
    """An engine that decodes a fixed number of slots frame by frame, which requests join and leave
    between frames (continuous batching). The batcher detects it (``is_continuous``) and feeds it
    requests as slots free up, instead of forming batches. Called from the batcher thread only."""

    def free_slots(self) -> int:
        """How many requests ``admit`` can take now."""
        ...

    @property
    def active(self) -> int:
        """How many requests are decoding."""
        ...

    def admit(self, request: SynthesisRequest, done: Callable[[EngineOutput | Exception], object]) -> None:
        """Start one request; it joins at the next ``step``. ``done`` is called exactly once, with its
        output or its failure (from this thread, or from the engine's decode thread)."""
        ...

    def step(self, queued: int = 0) -> None:
        """Decode one frame for every active request; finished ones leave and get their ``done``.
        ``queued``: how many requests wait to be admitted as soon as slots free up, so the engine knows
        whether its loop goes on after the rows that leave now (qwen-fast sizes its codec by it)."""
        ...

    def cancel(self, done: Callable[[EngineOutput | Exception], object]) -> bool:
        """Stop the request that ``admit`` was given ``done`` for, if it is still decoding: its slot is
        free at the next frame and ``done`` gets an error. False if it is no longer decoding."""
        ...


def worst_batch_s(engine: object, rows: int, chars: int) -> float | None:
    """The longest a healthy engine call of ``rows`` texts, the longest of ``chars`` characters, takes,
    for an engine that can say (a ``batch_cost_s(rows, chars)`` method: the stand-in, whose cost is its
    model); None for one that cannot. The worker refuses to start when a full batch of the longest
    texts would outlast its per-batch limit (``ttsq.worker.watchdog``): it would be ended as stuck."""
    cost = getattr(engine, "batch_cost_s", None)
    return float(cost(rows, chars)) if callable(cost) else None


def has_cpu_tensors(engine: object) -> bool:
    """Whether a loaded engine computes with tensors in this process's own heap (torch on the CPU).

    Optional, like the continuous protocol: an engine says so with a true ``tensors_on_cpu``
    attribute once loaded; one that does not say computes elsewhere (a GPU, espeak's library). The
    worker tunes glibc's allocator by it (``workers/celery_worker.py``): every intermediate tensor of
    a CPU engine is a ``malloc``, and a small fixed mmap threshold makes each one a fresh mapping.
    """
    return getattr(engine, "tensors_on_cpu", False) is True


def is_continuous(engine: object) -> bool:
    """Whether an engine takes requests one by one between frames (``ContinuousEngine``)."""
    return all(callable(getattr(engine, name, None)) for name in ("free_slots", "admit", "step"))
