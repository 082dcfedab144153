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
