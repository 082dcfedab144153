"""Audio: encoding engine samples into the file a user downloads (soundfile / libsndfile), decoding
stored files, and joining pieces (a document's chunks) with pauses and crossfades.

A document's stitch runs piece by piece (``Joiner``, ``Resampler``, ``StreamEncoder``): what it holds
at once is a few chunks, whatever the document's length and format."""

from __future__ import annotations

import io
import math
import os
import struct
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

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
#: libsndfile's Opus compression level, which sets the bitrate (0 -> 256 kbit/s .. 1 -> 6 kbit/s): 0.75
#: is about 70 kbit/s for mono speech at 24 kHz. libsndfile's default (about 35 kbit/s) puts libopus in
#: its speech (SILK) or hybrid mode, which costs 2.5x the CPU: measured on this project's 2-core box,
#: 28-33 ms per second of speech against 12 at this level, and 7-8 for MP3 (docs/benchmarks.md,
#: "Encoding"). Past about 0.83 (48 kbit/s) the cost jumps back: keep a margin below it.
OPUS_COMPRESSION = 0.75
#: Options libsndfile is given per container when it encodes (``compression_level``, ...).
_OPTIONS: dict[str, dict[str, Any]] = {"ogg": {"compression_level": OPUS_COMPRESSION}}


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
    target = encoded_rate(sample_rate, audio_format)
    mono, sample_rate = resample(mono, sample_rate, target), target
    data = _written(mono, sample_rate, container, subtype, _OPTIONS.get(audio_format, {}))
    return EncodedAudio(data, CONTENT_TYPES[audio_format], sample_rate, round(duration_s, 4))


def _written(mono: npt.NDArray[Any], sample_rate: int, container: str, subtype: str, options: dict[str, Any]) -> bytes:
    """libsndfile's file of ``mono``, written to an anonymous file rather than a ``BytesIO``. Through a
    Python file object libsndfile calls back into Python for every write it makes (hundreds per clip of
    MP3), each call waiting for the interpreter lock: in a busy worker an encode then waited on the lock
    more than it encoded. Through a descriptor it writes alone, the lock free for the whole encode."""
    fd = _anonymous_file()
    try:
        with sf.SoundFile(
            fd, "w", sample_rate, 1, subtype=subtype, format=container, closefd=False, **options
        ) as handle:
            handle.write(mono)
        with open(fd, "rb", closefd=False) as written:
            written.seek(0)
            return written.read()
    finally:
        os.close(fd)


def _anonymous_file() -> int:
    """A descriptor of a new file in memory (Linux), or of a temporary file that has no name."""
    if hasattr(os, "memfd_create"):
        return os.memfd_create("ttsq-encode", os.MFD_CLOEXEC)
    return os.dup(tempfile.TemporaryFile().fileno())  # the dup outlives the closed object; its file has no name


def encoded_rate(sample_rate: int, audio_format: str) -> int:
    """The rate a file of ``audio_format`` is written at: the samples' own, except for Opus, which runs
    only at a few rates (anything else goes to the next one up)."""
    if audio_format != "ogg" or sample_rate in _OPUS_RATES:
        return sample_rate
    return next(rate for rate in _OPUS_RATES if rate >= sample_rate) if sample_rate <= 48000 else 48000


def wav_header(sample_rate: int, data_bytes: int | None = None) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV. Without ``data_bytes``, one for a stream whose
    length is not known yet: both sizes 0xFFFFFFFF, which players reading a pipe (ffmpeg and ffplay,
    aplay, browsers) take as "until the data ends"."""
    if data_bytes is not None:
        return _wav_header(sample_rate, data_bytes)
    header = _wav_header(sample_rate, 0)
    return header[:4] + b"\xff\xff\xff\xff" + header[8:40] + b"\xff\xff\xff\xff"


def _wav_header(sample_rate: int, data_bytes: int) -> bytes:
    """libsndfile's 44-byte header of a mono 16-bit PCM WAV."""
    header = b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return header + b"data" + struct.pack("<I", data_bytes)


def _pcm16(array: npt.NDArray[Any]) -> bytes:
    """16-bit little-endian PCM the way libsndfile converts floats: ``floor(x * 32768)``, clipped."""
    return bytes(as_int16(array).astype("<i2", copy=False).tobytes())


def as_int16(samples: npt.NDArray[Any]) -> npt.NDArray[np.int16]:
    """Samples as 16-bit integers, converted the way every WAV and stream ttsq writes converts floats
    (``floor(x * 32768)``, clipped); int16 samples as they are. Converted once, a clip's stream and its
    WAV then cost a copy each."""
    array = np.asarray(samples)
    if array.dtype == np.int16:
        return array
    scaled = np.floor(np.clip(array.astype(np.float32, copy=False), -1.0, 1.0) * np.float32(32768.0))
    converted: npt.NDArray[np.int16] = np.clip(scaled, -32768, 32767).astype(np.int16)
    return converted


def pcm16(samples: npt.NDArray[Any]) -> bytes:
    """Mono samples as 16-bit little-endian PCM, the way every WAV ttsq writes converts them."""
    return _pcm16(np.asarray(samples))


def pcm_pieces(
    samples: npt.NDArray[np.floating] | npt.NDArray[np.int16], sample_rate: int, piece_s: float
) -> Iterator[bytes]:
    """Mono samples as 16-bit PCM (the WAV file's own conversion, so the pieces of a clip joined are its
    WAV data byte for byte), in pieces of ``piece_s`` seconds."""
    array = np.asarray(samples)
    step = max(1, int(sample_rate * piece_s))
    for start in range(0, array.size, step):
        yield _pcm16(array[start : start + step])


def _wav(samples: npt.NDArray[np.floating] | npt.NDArray[np.int16], sample_rate: int) -> EncodedAudio:
    """16-bit PCM WAV, written directly: the same bytes as libsndfile's (its 44-byte header, and its
    float conversion, ``floor(x * 32768)`` clipped), at a fraction of its cost per job, and int16
    samples go in as they are instead of through float and back."""
    array = np.asarray(samples)
    if array.ndim != 1:
        raise EngineError(f"expected mono samples, got shape {array.shape}")
    if array.size == 0:
        raise EngineError("the engine produced no audio")
    data = _pcm16(array)
    return EncodedAudio(
        _wav_header(sample_rate, len(data)) + data,
        CONTENT_TYPES["wav"],
        sample_rate,
        round(array.size / sample_rate, 4),
    )


@dataclass(frozen=True)
class EncodedFile:
    """What ``StreamEncoder`` wrote: the facts a result reports, the file's size."""

    content_type: str
    sample_rate: int
    duration_s: float
    bytes: int


class StreamEncoder:
    """``encode``, a block at a time, into a seekable binary file: the same file ``encode`` makes of
    the blocks joined (WAV byte for byte; Opus resampled across block edges as if in one piece).

    WAV is written directly (its header is patched at ``close``); the other formats go through
    libsndfile, which encodes incrementally."""

    def __init__(self, handle: IO[bytes], sample_rate: int, audio_format: str) -> None:
        self.handle = handle
        self.format = audio_format
        self.source_rate = sample_rate
        self.sample_rate = encoded_rate(sample_rate, audio_format)
        self._resampler = Resampler(sample_rate, self.sample_rate)
        self._frames = 0
        self._start = handle.tell()
        self._file: Any = None
        if audio_format == "wav":
            handle.write(_wav_header(sample_rate, 0))  # sizes are patched at close
        else:
            container, subtype = _SOUNDFILE[audio_format]
            self._file = sf.SoundFile(
                handle,
                "w",
                samplerate=self.sample_rate,
                channels=1,
                format=container,
                subtype=subtype,
                closefd=False,
                **_OPTIONS.get(audio_format, {}),
            )

    def write(self, block: npt.NDArray[np.float32]) -> None:
        """Encode the next mono float block (clipped to [-1, 1])."""
        if block.ndim != 1:
            raise EngineError(f"expected mono samples, got shape {block.shape}")
        if not block.size:
            return
        self._frames += block.size
        if self._file is None:
            self.handle.write(_pcm16(block))
            return
        self._file.write(self._resampler.feed(np.clip(block.astype(np.float32, copy=False), -1.0, 1.0)))

    def close(self) -> EncodedFile:
        """Finish the file (the resampler's last samples, the codec's last frame, the WAV sizes)."""
        if self._file is not None:
            tail = self._resampler.finish()
            if tail.size:
                self._file.write(tail)
            self._file.close()
        if not self._frames:
            raise EngineError("the engine produced no audio")
        end = self.handle.seek(0, io.SEEK_END)  # libsndfile may have left its position at a header
        if self._file is None:
            self.handle.seek(self._start)
            self.handle.write(_wav_header(self.source_rate, end - self._start - 44))
            self.handle.seek(end)
        return EncodedFile(
            content_type=CONTENT_TYPES[self.format],
            sample_rate=self.sample_rate,
            duration_s=round(self._frames / self.source_rate, 4),
            bytes=end - self._start,
        )


def probe_file(handle: IO[bytes], audio_format: str) -> EncodedFile:
    """The facts of an encoded file on a seekable handle (an object some earlier run stored)."""
    handle.seek(0, io.SEEK_END)
    size = handle.tell()
    handle.seek(0)
    info = sf.info(handle)
    return EncodedFile(CONTENT_TYPES[audio_format], int(info.samplerate), round(float(info.duration), 4), size)


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


class Resampler:
    """``resample`` over a signal that arrives in blocks: the output is the one ``resample`` gives for
    the blocks joined (up to float rounding), holding one source sample between blocks."""

    def __init__(self, source_rate: int, target_rate: int) -> None:
        self.source_rate = source_rate
        self.target_rate = target_rate
        self._step = source_rate / target_rate  # source samples per output sample
        self._seen = 0  # source samples fed so far
        self._made = 0  # output samples made so far
        self._last = np.zeros(0, dtype=np.float32)  # the last source sample fed, at index seen - 1

    def feed(self, block: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The output samples that ``block`` completes."""
        if self.source_rate == self.target_rate or not block.size:
            self._seen += block.size
            return block
        window = np.concatenate([self._last, block])
        base = self._seen - self._last.size  # the source index of window[0]
        self._seen += block.size
        self._last = block[-1:].copy()
        # Outputs whose position the window covers, and never more than the whole signal's count
        # can be (it grows with the samples seen: these are made whatever comes next).
        until = min(
            math.floor((self._seen - 1) / self._step) + 1, round(self._seen * self.target_rate / self.source_rate)
        )
        return self._make(until, window, base)

    def finish(self) -> npt.NDArray[np.float32]:
        """The last output samples: those past the last source sample repeat it (as ``np.interp``)."""
        if self.source_rate == self.target_rate or not self._seen:
            return np.zeros(0, dtype=np.float32)
        return self._make(round(self._seen * self.target_rate / self.source_rate), self._last, self._seen - 1)

    def _make(self, until: int, window: npt.NDArray[np.float32], base: int) -> npt.NDArray[np.float32]:
        if until <= self._made:
            return np.zeros(0, dtype=np.float32)
        positions = np.arange(self._made, until, dtype=np.float64) * self._step - base
        self._made = until
        return np.interp(positions, np.arange(window.size), window).astype(np.float32)


class Joiner:
    """``join``, a piece at a time: ``add`` returns the audio no later piece can change any more
    (a piece's end waits for the next piece's crossfade), ``finish`` the rest. Holds one piece."""

    def __init__(self, rate: int) -> None:
        self.rate = rate
        #: Each piece's (start, end) sample in the joined audio.
        self.spans: list[tuple[int, int]] = []
        self.length = 0
        self._held: npt.NDArray[np.float32] | None = None  # the last thing added: a piece or a pause

    def add(
        self, samples: npt.NDArray[np.float32], *, crossfade_ms: int, pause_ms: int
    ) -> list[npt.NDArray[np.float32]]:
        """Add the next piece, overlapping the one before by ``crossfade_ms`` (never the first piece),
        followed by ``pause_ms`` of silence (give 0 for the last)."""
        done: list[npt.NDArray[np.float32]] = []
        start = self.length
        fade = round(crossfade_ms * self.rate / 1000) if self.spans else 0
        held = self._held
        overlap = min(fade, held.size, samples.size) if held is not None else 0
        if held is not None and overlap:
            # A cut inside a sentence should neither click nor leave a gap.
            ramp = np.linspace(0.0, 1.0, overlap, dtype=np.float32)
            done += [held[:-overlap], held[-overlap:] * (1.0 - ramp) + samples[:overlap] * ramp]
            samples = samples[overlap:]
            start -= overlap
        elif held is not None:
            done.append(held)
        self._held = samples
        self.length += samples.size
        self.spans.append((start, self.length))
        if pause_ms:
            done.append(samples)
            self._held = np.zeros(round(pause_ms * self.rate / 1000), dtype=np.float32)
            self.length += self._held.size
        return done

    def finish(self) -> list[npt.NDArray[np.float32]]:
        """What is still held."""
        held, self._held = self._held, None
        return [] if held is None else [held]


def join(
    pieces: Sequence[npt.NDArray[np.float32]], rate: int, *, crossfades_ms: Sequence[int], pauses_ms: Sequence[int]
) -> tuple[npt.NDArray[np.float32], list[tuple[int, int]]]:
    """Concatenate pieces of one sample rate; return the audio and each piece's (start, end) sample.

    ``crossfades_ms[i]`` overlaps piece ``i`` with the end of piece ``i - 1`` (an equal-gain linear
    crossfade, at most as long as either piece); ``pauses_ms[i]`` puts silence after piece ``i`` (never
    after the last). The length is exactly the sum of the pieces, minus each crossfade, plus each pause.
    """
    joiner = Joiner(rate)
    out: list[npt.NDArray[np.float32]] = []
    for index, samples in enumerate(pieces):
        pause = pauses_ms[index] if index < len(pieces) - 1 else 0
        out += joiner.add(samples, crossfade_ms=crossfades_ms[index], pause_ms=pause)
    out += joiner.finish()
    return (np.concatenate(out) if out else np.zeros(0, dtype=np.float32)), joiner.spans


def _as_float_mono(samples: npt.NDArray[np.floating] | npt.NDArray[np.int16]) -> npt.NDArray[np.float32]:
    array = np.asarray(samples)
    if array.ndim != 1:
        raise EngineError(f"expected mono samples, got shape {array.shape}")
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    return np.clip(array.astype(np.float32), -1.0, 1.0)
