from __future__ import annotations

import io

import numpy as np
import pytest
import soundfile as sf

from ttsq.audio import CONTENT_TYPES, encode
from ttsq.errors import EngineError

TONE = (0.3 * np.sin(2 * np.pi * 220 * np.arange(22050) / 22050)).astype(np.float32)  # 1 s at 22.05 kHz


@pytest.mark.parametrize(("fmt", "container"), [("wav", "WAV"), ("flac", "FLAC"), ("ogg", "OGG"), ("mp3", "MP3")])
def test_every_format_decodes_back_to_the_same_duration(fmt: str, container: str) -> None:
    audio = encode(TONE, 22050, fmt)
    assert audio.content_type == CONTENT_TYPES[fmt]
    assert audio.duration_s == pytest.approx(1.0)
    info = sf.info(io.BytesIO(audio.data))
    assert info.format == container
    assert info.duration == pytest.approx(1.0, abs=0.08)  # codecs pad a frame or two


def test_wav_is_16_bit_pcm_at_the_engine_rate() -> None:
    audio = encode((TONE * 32767).astype(np.int16), 22050, "wav")
    info = sf.info(io.BytesIO(audio.data))
    assert (info.subtype, info.samplerate, info.channels) == ("PCM_16", 22050, 1)


def test_opus_is_resampled_to_a_rate_it_supports() -> None:
    assert encode(TONE, 22050, "ogg").sample_rate == 24000
    assert encode(TONE, 24000, "ogg").sample_rate == 24000


def test_empty_or_stereo_audio_is_an_engine_error() -> None:
    with pytest.raises(EngineError):
        encode(np.zeros(0, dtype=np.float32), 22050, "wav")
    with pytest.raises(EngineError):
        encode(np.zeros((10, 2), dtype=np.float32), 22050, "wav")


@pytest.mark.parametrize("dtype", ["float32", "float64", "int16"])
def test_wav_is_byte_for_byte_what_libsndfile_writes(dtype: str) -> None:
    """The direct WAV writer changes no stored byte: the same header and the same float rounding as
    libsndfile's own PCM_16 writer, over random samples, exact ties, both clipping edges and beyond."""
    rng = np.random.default_rng(7)
    if dtype == "int16":
        samples: np.ndarray = rng.integers(-32768, 32768, 30001).astype(np.int16)
        reference = samples
    else:
        noise = rng.random(20000) * 2.4 - 1.2
        ties = np.arange(-65536, 65537) / 65536  # every half step between two 16-bit values, and ±1
        samples = np.concatenate([noise, ties]).astype(dtype)
        reference = np.clip(samples, -1.0, 1.0).astype(np.float32)
    expected = io.BytesIO()
    sf.write(expected, reference, 24000, format="WAV", subtype="PCM_16")
    assert encode(samples, 24000, "wav").data == expected.getvalue()


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "ogg"])
def test_the_stream_encoder_makes_the_file_encode_makes_of_the_whole(fmt: str) -> None:
    # The stitch encodes a block at a time: WAV, FLAC and MP3 byte for byte what encode() writes of the
    # joined blocks; Opus resampled across block edges to the same length and rate.
    import tempfile

    from ttsq.audio import StreamEncoder

    rng = np.random.default_rng(3)
    whole = np.concatenate([TONE, rng.uniform(-1.2, 1.2, 7001).astype(np.float32), TONE[:999]])
    with tempfile.SpooledTemporaryFile(max_size=4096) as handle:  # rolls over to disk on the way
        encoder = StreamEncoder(handle, 22050, fmt)
        for block in np.array_split(whole, 7):
            encoder.write(block)
        facts = encoder.close()
        handle.seek(0)
        data = handle.read()
    expected = encode(whole, 22050, fmt)
    assert (facts.sample_rate, facts.duration_s, facts.bytes) == (expected.sample_rate, expected.duration_s, len(data))
    if fmt == "ogg":  # Opus streams carry a random serial number
        assert sf.info(io.BytesIO(data)).frames == sf.info(io.BytesIO(expected.data)).frames
    else:
        assert data == expected.data


def test_resampling_and_joining_a_piece_at_a_time_equal_the_whole() -> None:
    from ttsq.audio import Joiner, Resampler, join, resample

    rng = np.random.default_rng(5)
    pieces = [rng.uniform(-1, 1, int(n)).astype(np.float32) for n in rng.integers(0, 3000, 9)]
    crossfades, pauses = [0, 40, 0, 100, 40, 0, 40, 0, 0], [30, 0, 70, 0, 0, 30, 0, 70, 30]
    whole, spans = join(pieces, 22050, crossfades_ms=crossfades, pauses_ms=pauses)
    joiner = Joiner(22050)
    blocks: list[np.ndarray] = []
    for index, piece in enumerate(pieces):
        pause = pauses[index] if index < len(pieces) - 1 else 0
        blocks += joiner.add(piece, crossfade_ms=crossfades[index], pause_ms=pause)
    blocks += joiner.finish()
    assert np.array_equal(np.concatenate(blocks), whole) and joiner.spans == spans
    for source, target in ((22050, 24000), (24000, 16000), (44100, 48000)):
        resampler = Resampler(source, target)
        out = np.concatenate([*(resampler.feed(b) for b in np.array_split(whole, 5)), resampler.finish()])
        expected = resample(whole, source, target)
        assert out.size == expected.size and np.max(np.abs(out - expected)) < 1e-5


def test_opus_is_written_at_a_bitrate_where_libopus_is_cheap() -> None:
    """Below about 48 kbit/s libopus codes speech in its SILK or hybrid mode, at 2.5x the CPU (the
    benchmark's figure): the stored file, the stitched one and the gateway's stream all stay above it."""
    from ttsq.audio import StreamEncoder, pcm16
    from ttsq.gateway.encoders import encoder
    from ttsq.testing.standin import SAMPLE_RATE, speech_like

    seconds = 4.0
    speech = speech_like(seconds)
    stored = encode(speech, SAMPLE_RATE, "ogg").data
    handle = io.BytesIO()
    stitched = StreamEncoder(handle, SAMPLE_RATE, "ogg")
    for start in range(0, speech.size, SAMPLE_RATE):
        stitched.write(speech[start : start + SAMPLE_RATE])
    stitched.close()
    stream = encoder("opus", SAMPLE_RATE)
    pcm = pcm16(speech)
    streamed = b"".join(stream.feed(pcm[start : start + 9600]) for start in range(0, len(pcm), 9600)) + stream.finish()
    for name, data in (("stored", stored), ("stitched", handle.getvalue()), ("streamed", streamed)):
        kbit_s = len(data) * 8 / seconds / 1000
        assert 55 <= kbit_s <= 110, (name, kbit_s)  # libsndfile's default is about 35 kbit/s
