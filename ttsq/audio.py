"""Audio: encoding engine samples into the file a user downloads (soundfile / libsndfile), decoding
stored files, and joining pieces (a document's chunks) with pauses and crossfades."""

from __future__ import annotations

import io
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import soundfile as sf

from ttsq.errors import EngineError

CONTENT_TYPES = {"wav": "audio/wav", "flac": "audio/flac", "ogg": "audio/ogg", "mp3": "audio/mpeg"}
# (libsndfile container, subtype) per format. WAV is 16-bit PCM: what every player opens.
_SOUNDFILE = {
    "wav": ("WAV", "PCM_16"),
    "flac": ("FLAC", "PCM_16"),
    "ogg": ("OGG", "OPUS"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
}
#: Opus only runs at these rates; anything else is resampled to the next one up.
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


@dataclass(frozen=True)
class EncodedAudio:
    """An encoded file and the facts a result reports about it."""

    data: bytes
    content_type: str
    sample_rate: int
    duration_s: float


def encode(
    samples: npt.NDArray[np.floating] | npt.NDArray[np.int16], sample_rate: int, audio_format: str
) -> EncodedAudio:
    """Encode mono samples (float in [-1, 1] or int16) as ``audio_format``."""
    if audio_format == "wav":
        return _wav(samples, sample_rate)
    mono = _as_float_mono(samples)
    if mono.size == 0:
        raise EngineError("the engine produced no audio")
    container, subtype = _SOUNDFILE[audio_format]
    duration_s = mono.size / sample_rate
    if audio_format == "ogg" and sample_rate not in _OPUS_RATES:
        target = next(rate for rate in _OPUS_RATES if rate >= sample_rate) if sample_rate <= 48000 else 48000
        mono, sample_rate = resample(mono, sample_rate, target), target
    buffer = io.BytesIO()
    sf.write(buffer, mono, sample_rate, format=container, subtype=subtype)
    return EncodedAudio(buffer.getvalue(), CONTENT_TYPES[audio_format], sample_rate, round(duration_s, 4))


def _wav(samples: npt.NDArray[np.floating] | npt.NDArray[np.int16], sample_rate: int) -> EncodedAudio:
    """16-bit PCM WAV, written directly: the same bytes as libsndfile's (its 44-byte header, and its
    float conversion, ``floor(x * 32768)`` clipped), at a fraction of its cost per job, and int16
    samples go in as they are instead of through float and back."""
    array = np.asarray(samples)
    if array.ndim != 1:
        raise EngineError(f"expected mono samples, got shape {array.shape}")
    if array.size == 0:
        raise EngineError("the engine produced no audio")
    if array.dtype == np.int16:
        pcm = array.astype("<i2", copy=False)
    else:
        scaled = np.floor(np.clip(array.astype(np.float32), -1.0, 1.0) * np.float32(32768.0))
        pcm = np.clip(scaled, -32768, 32767).astype("<i2")
    data = pcm.tobytes()
    header = b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    header += b"data" + struct.pack("<I", len(data))
    return EncodedAudio(header + data, CONTENT_TYPES["wav"], sample_rate, round(array.size / sample_rate, 4))


def probe(data: bytes, audio_format: str) -> EncodedAudio:
    """The facts of an already encoded file (an object some earlier run stored)."""
    info = sf.info(io.BytesIO(data))
    return EncodedAudio(data, CONTENT_TYPES[audio_format], int(info.samplerate), round(float(info.duration), 4))


def decode(data: bytes) -> tuple[npt.NDArray[np.float32], int]:
    """Any file libsndfile reads (WAV, FLAC, OGG, MP3) as float32 mono samples and their rate.
    Raises libsndfile's own error on unreadable data: callers say what the data was."""
    samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    mono: npt.NDArray[np.float32] = samples.mean(axis=1).astype(np.float32)
    return mono, int(rate)


def resample(samples: npt.NDArray[np.float32], source_rate: int, target_rate: int) -> npt.NDArray[np.float32]:
    """Linear-interpolation resampling: enough for the small ratios between speech rates."""
    if source_rate == target_rate:
        return samples
    n_out = round(samples.size * target_rate / source_rate)
    positions = np.arange(n_out, dtype=np.float64) * (source_rate / target_rate)
    return np.interp(positions, np.arange(samples.size), samples).astype(np.float32)


def join(
    pieces: Sequence[npt.NDArray[np.float32]], rate: int, *, crossfades_ms: Sequence[int], pauses_ms: Sequence[int]
) -> tuple[npt.NDArray[np.float32], list[tuple[int, int]]]:
    """Concatenate pieces of one sample rate; return the audio and each piece's (start, end) sample.

    ``crossfades_ms[i]`` overlaps piece ``i`` with the end of piece ``i - 1`` (an equal-gain linear
    crossfade, at most as long as either piece); ``pauses_ms[i]`` puts silence after piece ``i`` (never
    after the last). The length is exactly the sum of the pieces, minus each crossfade, plus each pause.
    """
    out: list[npt.NDArray[np.float32]] = []
    length = 0
    spans: list[tuple[int, int]] = []
    for index, samples in enumerate(pieces):
        start = length
        fade = round(crossfades_ms[index] * rate / 1000) if index else 0
        overlap = min(fade, out[-1].size, samples.size) if out else 0
        if overlap:
            # A cut inside a sentence should neither click nor leave a gap.
            ramp = np.linspace(0.0, 1.0, overlap, dtype=np.float32)
            out[-1] = np.concatenate([out[-1][:-overlap], out[-1][-overlap:] * (1.0 - ramp) + samples[:overlap] * ramp])
            samples = samples[overlap:]
            start -= overlap
        out.append(samples)
        length += samples.size
        spans.append((start, length))
        if pauses_ms[index] and index < len(pieces) - 1:
            silence = np.zeros(round(pauses_ms[index] * rate / 1000), dtype=np.float32)
            out.append(silence)
            length += silence.size
    return (np.concatenate(out) if out else np.zeros(0, dtype=np.float32)), spans


def _as_float_mono(samples: npt.NDArray[np.floating] | npt.NDArray[np.int16]) -> npt.NDArray[np.float32]:
    array = np.asarray(samples)
    if array.ndim != 1:
        raise EngineError(f"expected mono samples, got shape {array.shape}")
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    return np.clip(array.astype(np.float32), -1.0, 1.0)
