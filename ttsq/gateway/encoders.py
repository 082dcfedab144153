"""Streamed audio in OpenAI's response formats: 16-bit mono PCM pieces in, the bytes of the format out,
as soon as each piece is encoded.

- ``pcm``: OpenAI's raw 16-bit little-endian mono at 24 kHz (resampled, ``ttsq.audio.Resampler``, when
  the engine's rate differs).
- ``wav``: a 44-byte header whose RIFF and data sizes are 0xFFFFFFFF (the length is not known when the
  header goes out; the convention of streamed WAV, which Python's ``wave``, libsndfile and ffmpeg read
  to the end of the bytes), then the samples as they come, at the engine's rate (the stored WAV's).
- ``mp3``: libsndfile's MP3 encoder at a constant bitrate, written to a file object that hands its bytes
  on (``ByteSink``). Constant, because a streamed file cannot carry the Info header a file gets at its
  end (which a variable bitrate needs for its length): the header's place is one silent frame.
- ``opus``: Ogg Opus through libsndfile, resampled to an Opus rate and at the bitrate of the stored file
  (``ttsq.audio.OPUS_COMPRESSION``: below about 48 kbit/s libopus costs 2.5x the CPU); Ogg pages go
  out as libsndfile fills them (about a second of speech each).
- ``flac`` does not stream: libsndfile writes a FLAC's length into its first block at the end, and a
  FLAC sent without it is one that libsndfile cannot read whole. It is sent from the stored file once
  the job is done (``stream_from_worker``).
"""

from __future__ import annotations

import io
import struct
from typing import Protocol

import numpy as np
import soundfile as sf

from ttsq.audio import OPUS_COMPRESSION, Resampler, encoded_rate

#: OpenAI's pcm: 16-bit signed little-endian mono at this rate.
PCM_RATE = 24_000
#: The streamed WAV header's sizes: unknown.
UNKNOWN_SIZE = 0xFFFFFFFF
#: libsndfile's MP3 encoder quality for a constant bitrate (0 best .. 1 smallest): about 80 kbit/s
#: for mono speech at 22-24 kHz.
MP3_COMPRESSION = 0.5
#: response_format -> libsndfile (container, subtype) where it goes through libsndfile.
_SOUNDFILE = {"mp3": ("MP3", "MPEG_LAYER_III", "mp3"), "opus": ("OGG", "OPUS", "ogg")}


def stream_from_worker(response_format: str) -> bool:
    """Whether ``response_format`` is encoded from the worker's pieces as they come (all but flac)."""
    return response_format in ("pcm", "wav", *_SOUNDFILE)


class Encoder(Protocol):
    """Encodes one clip, piece by piece."""

    def feed(self, pcm: bytes) -> bytes:
        """The bytes that the next piece (16-bit mono PCM, little-endian) completes."""
        ...

    def finish(self) -> bytes:
        """The last bytes of the clip."""
        ...


def encoder(response_format: str, sample_rate: int) -> Encoder:
    """An encoder of pieces at ``sample_rate`` into ``response_format`` (not flac: ``stream_from_worker``)."""
    if response_format == "pcm":
        return PcmEncoder(sample_rate)
    if response_format == "wav":
        return WavEncoder(sample_rate)
    return SoundfileEncoder(response_format, sample_rate)


def wav_header(sample_rate: int) -> bytes:
    """The 44-byte header of a mono 16-bit PCM WAV of unknown length."""
    header = b"RIFF" + struct.pack("<I", UNKNOWN_SIZE) + b"WAVE"
    header += b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return header + b"data" + struct.pack("<I", UNKNOWN_SIZE)


def floats(pcm: bytes) -> np.ndarray[tuple[int], np.dtype[np.float32]]:
    """16-bit PCM as floats the way libsndfile reads them (``x / 32768``)."""
    return (np.frombuffer(pcm[: len(pcm) // 2 * 2], dtype="<i2").astype(np.float32) / np.float32(32768.0)).reshape(-1)


def pcm16(samples: np.ndarray[tuple[int], np.dtype[np.float32]]) -> bytes:
    """Floats as 16-bit PCM the way libsndfile writes them (``floor(x * 32768)``, clipped): the
    inverse of ``floats``, so 16-bit samples at the same rate pass through unchanged."""
    scaled = np.floor(np.clip(samples, -1.0, 1.0) * np.float32(32768.0))
    return bytes(np.clip(scaled, -32768, 32767).astype("<i2").tobytes())


class PcmEncoder:
    """OpenAI's ``pcm``: 16-bit mono at 24 kHz."""

    def __init__(self, sample_rate: int) -> None:
        self._resampler = Resampler(sample_rate, PCM_RATE) if sample_rate != PCM_RATE else None

    def feed(self, pcm: bytes) -> bytes:
        if self._resampler is None:
            return pcm
        return pcm16(self._resampler.feed(floats(pcm)))

    def finish(self) -> bytes:
        return b"" if self._resampler is None else pcm16(self._resampler.finish())


class WavEncoder:
    """A WAV of unknown length: the header, then the samples as they are."""

    def __init__(self, sample_rate: int) -> None:
        self._header = wav_header(sample_rate)

    def feed(self, pcm: bytes) -> bytes:
        header, self._header = self._header, b""
        return header + pcm

    def finish(self) -> bytes:
        return self._header  # a clip without samples is still a WAV


class SoundfileEncoder:
    """MP3 or Ogg Opus through libsndfile, which encodes incrementally into ``ByteSink``."""

    def __init__(self, response_format: str, sample_rate: int) -> None:
        container, subtype, stored = _SOUNDFILE[response_format]
        rate = encoded_rate(sample_rate, stored)
        self._resampler = Resampler(sample_rate, rate)
        self._sink = ByteSink()
        options: dict[str, object] = (
            {"compression_level": MP3_COMPRESSION, "bitrate_mode": "CONSTANT"}
            if container == "MP3"
            else {"compression_level": OPUS_COMPRESSION}
        )
        self._file = sf.SoundFile(
            self._sink, "w", samplerate=rate, channels=1, format=container, subtype=subtype, closefd=False, **options
        )

    def feed(self, pcm: bytes) -> bytes:
        block = self._resampler.feed(floats(pcm))
        if block.size:
            self._file.write(block)
        return self._sink.take()

    def finish(self) -> bytes:
        tail = self._resampler.finish()
        if tail.size:
            self._file.write(tail)
        self._file.close()
        return self._sink.take()


class ByteSink(io.RawIOBase):
    """A file object for libsndfile to write an encoded stream into, whose bytes are taken (``take``) as
    they are written. libsndfile seeks as if into a file: a write behind the bytes already taken (a
    header patched at close) is dropped, which the formats streamed here are written not to need."""

    def __init__(self) -> None:
        super().__init__()
        self._buffer = bytearray()
        self._taken = 0  # bytes handed on: the offset of the buffer's first byte
        self._position = 0
        #: Bytes libsndfile wrote behind what was already taken, and which were dropped.
        self.dropped = 0

    def readable(self) -> bool:
        return True  # libsndfile opens its virtual files for reading too; it reads nothing when writing

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        return 0

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        end = self._taken + len(self._buffer)
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: end}[whence]
        self._position = max(0, base + offset)
        return self._position

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        chunk = bytes(data)
        written = len(chunk)
        if self._position < self._taken:
            behind = min(written, self._taken - self._position)
            self.dropped += behind
            chunk, self._position = chunk[behind:], self._position + behind
        offset = self._position - self._taken
        if offset > len(self._buffer):
            self._buffer.extend(bytes(offset - len(self._buffer)))
        self._buffer[offset : offset + len(chunk)] = chunk
        self._position += len(chunk)
        return written

    def take(self) -> bytes:
        """The bytes written since the last take."""
        data = bytes(self._buffer)
        self._taken += len(data)
        self._buffer.clear()
        return data
