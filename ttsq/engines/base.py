"""The engine protocol: batch in, batch out, one thread owns it.

An engine turns a list of requests that can share a forward pass into a list of outputs, one per
request, in order. A failed item comes back as an exception *in its slot*, so it fails only its own
job; an exception raised by ``synthesize_batch`` itself means the whole batch failed, and the batcher
then retries the items one by one to find the culprit.
"""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.keys import EngineIdentity
    from ttsq.request import SynthesisRequest


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


@dataclass(frozen=True)
class EngineOutput:
    """Audio for one request."""

    samples: npt.NDArray[np.float32] | npt.NDArray[np.int16]
    sample_rate: int
    #: Hit the frame cap without an end token.
    truncated: bool = False
    #: Request fields this engine could not honour.
    ignored: tuple[str, ...] = field(default=())


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

    def step(self) -> None:
        """Decode one frame for every active request; finished ones leave and get their ``done``."""
        ...

    def cancel(self, done: Callable[[EngineOutput | Exception], object]) -> bool:
        """Stop the request that ``admit`` was given ``done`` for, if it is still decoding: its slot is
        free at the next frame and ``done`` gets an error. False if it is no longer decoding."""
        ...


def is_continuous(engine: object) -> bool:
    """Whether an engine takes requests one by one between frames (``ContinuousEngine``)."""
    return all(callable(getattr(engine, name, None)) for name in ("free_slots", "admit", "step"))
