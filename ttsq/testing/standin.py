"""A stand-in for a GPU engine: the time a batch costs on a GPU, and audio of the length speech has,
with nothing computed. ``TTSQ_ENGINE=standin``.

No GPU has run ttsq's machinery at the rate it is built for; this engine lets a CPU box try it. A batch
costs what a batched autoregressive model costs on a device: every decode step serves all rows at
once, so a batch takes ``(a + b * rows)`` seconds per second of its longest row's audio, ``a`` the
fixed cost of a step and ``b`` what each further row adds (``TTSQ_STANDIN_A_US`` and
``TTSQ_STANDIN_B_US``, in microseconds per second of audio). The wait is a ``time.sleep``: the
interpreter lock is free, as it is while a CUDA kernel runs.

The defaults are published Qwen3-TTS 1.7B figures on one H100 80GB (sources and the arithmetic in
docs/scaling.md, "The stand-in engine"):

- one row: 3.98 seconds of audio per second (faster-qwen3-tts 0.1.x, CUDA graphs), so ``a + b`` is
  0.2513 s per second of audio;
- 64 rows: 111.9 seconds of audio per second (vLLM-Omni PR #7781, Seed-TTS English, concurrency 64),
  so ``a + 64 b`` is 0.5720 s per second of audio;

hence ``a`` = 246,200 us and ``b`` = 5,090 us per second of audio.

A row's audio lasts about as long as its text read aloud (``CHARS_PER_SECOND``), in whole codec frames
of 12.5 per second, cut at ``max_new_tokens`` or the frame cap (``truncated`` then); at 24 kHz, a quiet
tone whose loudness moves at syllable rate, with a little noise (what an encoder meets in speech: not
silence, not a pure tone). The samples come from one buffer made at ``load``, so a row costs a copy,
not a synthesis. It follows neither a voice description nor sampling settings, and says so in
``ignored``.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from ttsq.engines.base import FRAMES_PER_SECOND, EngineIdentity, EngineOutput, frame_cap
from ttsq.errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.job import SynthesisRequest

#: The stand-in speaks at 24 kHz, as Qwen3-TTS does.
SAMPLE_RATE = 24_000
#: Characters of text per second of audio: an unhurried English reading.
CHARS_PER_SECOND = 14.0
#: The shortest clip, in codec frames (a single word still lasts about half a second).
MIN_FRAMES = 6
#: Seconds of audio in the buffer every row is cut from (a longer row repeats it).
BUFFER_S = 30
_IGNORED = ("instruct", "seed", "temperature", "top_p", "top_k", "repetition_penalty")


def speech_frames(text: str) -> int:
    """Codec frames (12.5 per second) that ``text`` lasts when read aloud, about."""
    return max(MIN_FRAMES, round(len(text.strip()) / CHARS_PER_SECOND * FRAMES_PER_SECOND))


def batch_seconds(a_s: float, b_s: float, rows: int, longest_s: float) -> float:
    """What a batch of ``rows`` costs on the device: ``a + b * rows`` per second of its longest audio."""
    return (a_s + b_s * rows) * longest_s


def speech_like(seconds: float, rate: int = SAMPLE_RATE, seed: int = 0) -> npt.NDArray[np.float32]:
    """A quiet voiced tone with a syllable-rate envelope and a little noise, in [-1, 1]."""
    t = np.arange(round(seconds * rate), dtype=np.float64) / rate
    pitch = 140.0 + 25.0 * np.sin(2 * np.pi * 0.4 * t)  # an intonation that drifts
    voice = np.sin(2 * np.pi * np.cumsum(pitch) / rate) + 0.35 * np.sin(2 * np.pi * 2 * np.cumsum(pitch) / rate)
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2  # about four syllables a second
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return np.asarray(0.12 * voice * envelope + 0.01 * noise, dtype=np.float32)


class StandInEngine:
    """The stand-in engine (module docstring). Only the batcher thread calls it."""

    def __init__(self, settings: Settings) -> None:
        self.a_s = settings.standin_a_us / 1e6
        self.b_s = settings.standin_b_us / 1e6
        self._buffer: npt.NDArray[np.float32] | None = None
        self.identity = EngineIdentity(
            engine="standin",
            model="standin-speech-like",
            # The audio depends on neither a nor b: they are not part of what a content key names.
            revision="1",
            sample_rate=SAMPLE_RATE,
            modes=("voice_design",),
            max_frames=settings.qwen_max_frames,
        )

    def batch_cost_s(self, rows: int, chars: int) -> float:
        """The most a batch of ``rows`` texts costs when its longest has ``chars`` characters, its audio
        cut at the frame cap (``ttsq.engines.base.worst_batch_s``)."""
        frames = speech_frames("x" * chars)
        if self.identity.max_frames:
            frames = min(frames, self.identity.max_frames)
        return batch_seconds(self.a_s, self.b_s, rows, frames / FRAMES_PER_SECOND)

    def load(self) -> None:
        """Make the buffer every row's audio is cut from."""
        self._buffer = speech_like(BUFFER_S)

    def warmup(self) -> None:
        """Nothing to warm: the first batch costs what every batch does."""

    def synthesize_batch(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        """Wait what the batch costs on the device (the lock released), then cut each row's audio."""
        if self._buffer is None:
            raise EngineError("stand-in engine used before load()")
        frames = [self._frames(request) for request in requests]
        # The device decodes until its longest row ends or is cut at its cap: what the rows keep.
        kept = [
            min(f, self._cap(request, f)) for request, f in zip(requests, frames, strict=True) if isinstance(f, int)
        ]
        longest = max(kept, default=0) / FRAMES_PER_SECOND
        if longest:
            time.sleep(batch_seconds(self.a_s, self.b_s, len(requests), longest))
        return [
            f if isinstance(f, Exception) else self._output(request, f)
            for request, f in zip(requests, frames, strict=True)
        ]

    def close(self) -> None:
        """Drop the buffer."""
        self._buffer = None

    def _frames(self, request: SynthesisRequest) -> int | Exception:
        try:
            self.identity.check(request)
        except InvalidRequest as exc:
            return exc
        if not any(ch.isalnum() for ch in request.text):
            return EngineError("nothing to speak in this text")
        return speech_frames(request.text)

    def _cap(self, request: SynthesisRequest, frames: int) -> int:
        """The most frames the row may have: its text's frame cap, and its ``max_new_tokens``."""
        cap = frame_cap(request.text, self.identity.max_frames) if self.identity.max_frames else frames
        return cap if request.max_new_tokens is None else min(cap, request.max_new_tokens)

    def _output(self, request: SynthesisRequest, frames: int) -> EngineOutput:
        if self._buffer is None:
            raise EngineError("stand-in engine used before load()")
        cap = self._cap(request, frames)
        kept = min(frames, cap)
        samples = _cut(self._buffer, round(kept / FRAMES_PER_SECOND * SAMPLE_RATE), request.text)
        ignored = tuple(name for name in _IGNORED if getattr(request, name) not in (None, ""))
        return EngineOutput(samples, SAMPLE_RATE, truncated=frames > cap, ignored=ignored)


def _cut(buffer: npt.NDArray[np.float32], size: int, text: str) -> npt.NDArray[np.float32]:
    """``size`` samples of ``buffer``, from a place the text picks (so clips differ), as a copy. Only the
    clip is copied, wrapping round the buffer's end: tiling the whole buffer for the rows that cross it
    (about one in four) cost the batcher thread, which holds the interpreter lock meanwhile, more than
    the rest of the worker's share of a job."""
    start = zlib.crc32(text.encode()) % buffer.size
    out = np.empty(size, dtype=np.float32)
    done = 0
    while done < size:
        take = min(size - done, buffer.size - start)
        out[done : done + take] = buffer[start : start + take]
        done, start = done + take, 0
    return out
