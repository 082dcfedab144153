"""qwen-fast's streaming rows: audio in ramped chunks while the row generates (``ttsq.engines.qwen.stream``).

Two halves. The codec: a row's codes streamed (the engine's chunks, left context and cuts) against the
whole-row decode of the same codes, within the stated bounds, on the tiny checkpoint's codec and on the
full-size architecture, and breaking them without the left context (so the bound tests the joins). The
engine: rows admitted with a ``piece`` sink, stepped by hand, answered on the real codec thread; a
streaming row's output is exactly what it handed over, within the tiny bound of the whole-row path's
output for the same seeded request, and a first chunk overtakes work already waiting for the codec.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ttsq.engines.base import EngineOutput, streams_audio
from ttsq.engines.qwen.stream import (
    CHUNK_CAP_FRAMES,
    FIRST_CHUNK_FRAMES,
    FIRST_CHUNK_MAX_FRAMES,
    LEFT_CONTEXT_FRAMES,
    Chunk,
    first_chunk_frames,
    schedule,
    stream_decode,
)
from ttsq.errors import EngineError

#: Whole-file: real engines, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

PER_FRAME = 1920  # samples per codec frame at 24 kHz: the decoder's total upsampling (8*5*4*3 * 2*2)
#: The tiny codec: streamed within one step of 16-bit PCM of the whole-row decode (measured: 7e-6 at
#: most, docs/qwen.md "Streaming").
TINY_MAX_ERROR = 2**-15
#: The full-size architecture, random weights: its eight stacked attention windows reach past the 72
#: frames of context, so the joins differ a little (measured over three random decoders: 3.9e-4 to
#: 5.2e-4 at most; 51 to 69 dB, as loud as each random decoder is).
FULL_MAX_ERROR = 1e-3
FULL_MIN_SNR_DB = 45.0


def snr_db(signal: np.ndarray, other: np.ndarray) -> float:
    noise = float(np.sum((signal.astype(np.float64) - other) ** 2))
    return float(10 * np.log10(float(np.sum(signal.astype(np.float64) ** 2)) / max(noise, 1e-30)))


# -- the codec ----------------------------------------------------------------------------------


def tiny_tokenizer(path: Path) -> Any:
    """The tiny checkpoint's codec through qwen-tts's own load, with qwen-fast's rewritten modules."""
    with contextlib.redirect_stdout(io.StringIO()):  # qwen-tts's flash-attn banner
        from qwen_tts import Qwen3TTSModel

    from ttsq.engines.qwen.codec import rewrite

    tokenizer = Qwen3TTSModel.from_pretrained(str(path), device_map="cpu", dtype=torch.float32).model.speech_tokenizer
    rewrite(tokenizer.model.decoder)
    return tokenizer


def full_decoder() -> Any:
    """The released decoder architecture, random as ``ttsq.testing.qwen_checkpoint`` makes it."""
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2DecoderConfig
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

    from ttsq.engines.qwen.codec import rewrite
    from ttsq.testing.qwen_checkpoint import _FULL_DECODER

    torch.manual_seed(2)
    decoder = Qwen3TTSTokenizerV2Decoder(Qwen3TTSTokenizerV2DecoderConfig(**_FULL_DECODER)).eval()
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.reset_parameters()
        for name, weight in decoder.named_parameters():
            if name.endswith(("embedding_sum", "scale")):
                torch.nn.init.normal_(weight)
    rewrite(decoder)
    return decoder


def joined(pieces: list[np.ndarray], frames: int) -> np.ndarray:
    """The pieces are the ramp's chunks (2, 4, 8, 16 … frames, from a larger first one while the loop
    is busy), cut at frame boundaries; joined."""
    first = pieces[0].size // PER_FRAME
    assert FIRST_CHUNK_FRAMES <= first <= max(FIRST_CHUNK_MAX_FRAMES, frames)
    bounds = schedule(frames, first)
    assert [piece.size for piece in pieces] == [(end - start) * PER_FRAME for start, end in bounds]
    sizes = [end - start for start, end in bounds]
    assert sizes[:-1] == [min(first << k, CHUNK_CAP_FRAMES) for k in range(len(sizes) - 1)]
    return np.concatenate(pieces)


def test_the_first_chunk_grows_with_the_loops_frame_time() -> None:
    """Two frames while the loop is fast; more once the second chunk (twice as long) would come after a
    player that started with the first ran dry; the most a slower than real time loop allows."""
    assert first_chunk_frames(0.0) == first_chunk_frames(0.007) == FIRST_CHUNK_FRAMES == 2  # a lone stream
    assert first_chunk_frames(0.025) == 2  # 8 streams on 2 CPU cores
    assert first_chunk_frames(0.032) == 4  # 16 streams there
    assert first_chunk_frames(0.038) == FIRST_CHUNK_MAX_FRAMES
    assert first_chunk_frames(0.5) == FIRST_CHUNK_MAX_FRAMES
    assert schedule(40, 3) == [(0, 3), (3, 9), (9, 21), (21, 40)]


def cut_short(frames: int) -> bool:
    """Whether some chunk of a row of ``frames`` frames has less context than the whole row before it."""
    return any(start > LEFT_CONTEXT_FRAMES for start, _ in schedule(frames))


def test_tiny_streamed_chunks_join_to_the_whole_row_decode(qwen_checkpoints: dict[str, Path]) -> None:
    tokenizer = tiny_tokenizer(qwen_checkpoints["voice_design"])
    decoder = tokenizer.model.decoder
    assert int(decoder.total_upsample) == int(tokenizer.get_decode_upsample_rate()) == PER_FRAME
    frames = 160
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(0))
    whole = tokenizer.decode([{"audio_codes": codes}])[0][0]  # the whole-row path's own call
    assert float(np.std(whole)) > 0.01
    assert cut_short(frames)
    streamed = joined(stream_decode(decoder, codes), frames)
    assert streamed.shape == whole.shape
    assert float(np.abs(streamed - whole).max()) <= TINY_MAX_ERROR
    # Without left context every join is wrong: the bound is what the context buys.
    blind = np.concatenate(stream_decode(decoder, codes, context=0))
    assert float(np.abs(blind - whole).max()) > 100 * TINY_MAX_ERROR


def test_a_clones_reference_codes_are_the_first_chunks_context(qwen_checkpoints: dict[str, Path]) -> None:
    """In-context cloning decodes the reference's codes in front of the row and cuts them off again: a
    streamed clone row takes its early chunks' context from them."""
    decoder = tiny_tokenizer(qwen_checkpoints["base"]).model.decoder
    generator = torch.Generator().manual_seed(1)
    ref, codes = (
        torch.randint(0, 2048, (30, 16), generator=generator),
        torch.randint(0, 2048, (90, 16), generator=generator),
    )
    with torch.inference_mode():
        whole = decoder.chunked_decode(torch.cat([ref, codes]).T[None])[0, 0].numpy()[30 * PER_FRAME :]
    streamed = joined(stream_decode(decoder, codes, ref=ref), 90)
    assert float(np.abs(streamed - whole).max()) <= TINY_MAX_ERROR
    without = np.concatenate(stream_decode(decoder, codes))
    assert float(np.abs(without[:PER_FRAME] - whole[:PER_FRAME]).max()) > 100 * TINY_MAX_ERROR


def test_full_size_streamed_chunks_join_to_the_whole_row_decode() -> None:
    decoder = full_decoder()
    frames = 130  # chunks 63-111 and 111-130: the last one's 72 frames of context start at frame 39
    codes = torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        whole = decoder.chunked_decode(codes.T[None])[0, 0].numpy()
    assert float(np.abs(whole).max()) > 0.01 and cut_short(frames)
    streamed = joined(stream_decode(decoder, codes), frames)
    assert float(np.abs(streamed - whole).max()) <= FULL_MAX_ERROR
    assert snr_db(whole, streamed) >= FULL_MIN_SNR_DB
    # Without left context the joins break from the first one on (chunks 0-2, 2-6, 6-14): the row's first
    # 14 frames show it as the whole row does (95 times the bound either way, measured), at an eighth of
    # the decode's CPU on the test machine's two cores.
    blind = np.concatenate(stream_decode(decoder, codes[:14], context=0))
    assert float(np.abs(blind - whole[: blind.size]).max()) > 10 * FULL_MAX_ERROR


# -- the engine -----------------------------------------------------------------------------------


class Row:
    """A job's two callbacks, recording what arrives, in order, in a log shared by the rows of a test."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log
        self.pieces: list[np.ndarray] = []
        self.answers: list[EngineOutput | Exception] = []
        self.future: Future[EngineOutput | Exception] = Future()

    def piece(self, samples: np.ndarray | None) -> None:
        assert samples is not None  # only the slot scheduler restarts a row
        self.log.append(f"{self.name} piece {len(self.pieces)}")
        self.pieces.append(samples)

    def done(self, output: EngineOutput | Exception) -> None:
        self.log.append(f"{self.name} done")
        self.answers.append(output)
        if not self.future.done():
            self.future.set_result(output)

    def output(self) -> EngineOutput:
        answer = self.future.result(60)
        assert isinstance(answer, EngineOutput), answer
        return answer


def request(text: str, frames: int, seed: int, **fields: Any) -> Any:
    from ttsq.job import SynthesisRequest

    return SynthesisRequest.from_dict({"text": text, "max_new_tokens": frames, "seed": seed, **fields})


def finish(engine: Any, *rows: Row) -> None:
    """Step until no row decodes, then wait for the codec thread to answer ``rows``."""
    while engine.active:
        engine.step()
    for row in rows:
        row.future.result(60)


@pytest.fixture(scope="module")
def fast(qwen_checkpoints: dict[str, Path]) -> Iterator[Any]:
    from ttsq.config import Settings
    from ttsq.engines.qwen.fast import QwenFastEngine

    engine = QwenFastEngine(
        Settings(engine="qwen-fast", qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=256, max_batch=3)
    )
    engine.load()
    yield engine
    engine.close()


def test_only_qwen_fast_streams_while_it_generates(fast: Any, qwen_checkpoints: dict[str, Path]) -> None:
    from ttsq.config import Settings
    from ttsq.engines.qwen.engine import QwenEngine

    stock = QwenEngine(Settings(engine="qwen", qwen_model=str(qwen_checkpoints["voice_design"])))
    assert streams_audio(fast) and not streams_audio(stock)


def test_a_streaming_rows_output_is_exactly_its_pieces_and_the_whole_rows_audio(fast: Any) -> None:
    log: list[str] = []
    streamed, neighbour = Row("streamed", log), Row("neighbour", log)
    frames = 130
    assert cut_short(frames)
    fast.admit(request("Hello there, world.", frames, seed=3), streamed.done, piece=streamed.piece)
    fast.admit(request("Other words.", 40, seed=5), neighbour.done)
    finish(fast, streamed, neighbour)
    out = streamed.output()
    assert np.array_equal(joined(streamed.pieces, frames), out.samples)
    assert out.samples.dtype == np.float32 and out.sample_rate == 24_000 and out.truncated
    assert streamed.answers == [out] and neighbour.pieces == []
    assert log.index("streamed piece 0") < log.index("neighbour done")  # audio long before its row ends

    # The same seeded requests through the whole-row path: the same codes (a seeded row's codes do
    # not depend on its batch), so the same audio within the bound; the neighbour's path is untouched.
    whole, alone = fast.synthesize_batch(
        [request("Hello there, world.", frames, seed=3), request("Other words.", 40, seed=5)]
    )
    assert isinstance(whole, EngineOutput) and isinstance(alone, EngineOutput)
    assert whole.samples.shape == out.samples.shape and whole.truncated
    assert float(np.abs(whole.samples - out.samples).max()) <= TINY_MAX_ERROR
    assert np.array_equal(alone.samples, neighbour.output().samples)


def test_a_first_chunk_overtakes_work_already_waiting_for_the_codec(fast: Any) -> None:
    """The codec thread is held busy (a sink that blocks, which a real one never does); meanwhile a
    whole row finishes and a streaming row makes its first frame. Released, the codec decodes the
    first chunk before the whole row that was waiting before it."""
    log: list[str] = []
    release = threading.Event()
    busy, whole, first = Row("busy", log), Row("whole", log), Row("first", log)

    def blocking(samples: np.ndarray | None) -> None:
        busy.piece(samples)
        release.wait(60)

    fast.admit(request("Hold the codec.", 1, seed=1), busy.done, piece=blocking)
    fast.step()  # its one frame: the codec thread takes its chunk and blocks in the sink
    fast.admit(request("A whole row.", 2, seed=2), whole.done)
    while fast.active:
        fast.step()  # the whole row has left the loop: its decode waits for the codec
    fast.admit(request("Stream me.", 12, seed=4), first.done, piece=first.piece)
    while not any(stream.chunks for stream in fast._streams.values()):
        fast.step()  # its first frames: its first chunk waits too, behind the whole row
    release.set()
    finish(fast, busy, whole, first)
    assert log.index("first piece 0") < log.index("whole done") < log.index("first done")
    assert log.index("first piece 1") > log.index("whole done")  # later chunks keep their place


def test_a_cancelled_streaming_row_is_answered_once_and_hands_over_nothing_after(fast: Any) -> None:
    log: list[str] = []
    cancelled, after = Row("cancelled", log), Row("after", log)
    done = cancelled.done  # the one callable the engine knows the job by
    fast.admit(request("Stop me halfway.", 200, seed=6), done, piece=cancelled.piece)
    for _ in range(40):
        fast.step()
    assert fast.cancel(done)
    assert fast.free_slots() == 3
    fast.admit(request("Then me.", 8, seed=7), after.done, piece=after.piece)
    finish(fast, after)  # its last chunk came after everything the cancelled row had queued
    assert len(cancelled.answers) == 1 and isinstance(cancelled.answers[0], EngineError)
    mine = [entry for entry in log if entry.startswith("cancelled")]
    assert mine[-1] == "cancelled done" and len(mine) >= 2  # pieces came, then the answer, then nothing
    assert sum(piece.size for piece in cancelled.pieces) < 40 * PER_FRAME


def test_a_failed_chunk_fails_its_row_only(qwen_checkpoints: dict[str, Path]) -> None:
    """A chunk's codec decode fails (on cue: a test engine whose decoder call fails for one request's
    later chunks, as a device fault would): that row is answered with the error at once, hands over
    nothing more and leaves the loop; the streaming row decoded beside it is retried alone and completes."""
    from ttsq.config import Settings
    from ttsq.engines.qwen.fast import QwenFastEngine

    class FailingCodec(QwenFastEngine):
        def _decode_windows(self, chunks: list[Chunk]) -> list[Any]:
            if any(chunk.stream.request.temperature == 0.33 and not chunk.first for chunk in chunks):
                raise RuntimeError("injected: the codec failed")
            return super()._decode_windows(chunks)

    engine = FailingCodec(
        Settings(engine="qwen-fast", qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=256, max_batch=2)
    )
    engine.load()
    try:
        log: list[str] = []
        failing, fine = Row("failing", log), Row("fine", log)
        engine.admit(request("Fail me.", 100, seed=8, temperature=0.33), failing.done, piece=failing.piece)
        engine.admit(request("Keep me.", 40, seed=9), fine.done, piece=fine.piece)
        finish(engine, failing, fine)
        assert np.array_equal(joined(fine.pieces, 40), fine.output().samples)
        assert len(failing.answers) == 1 and isinstance(failing.answers[0], EngineError)
        assert "codec decode failed" in str(failing.answers[0])
        assert [entry for entry in log if entry.startswith("failing")] == ["failing piece 0", "failing done"]
        assert engine.free_slots() == 2 and not engine.active
    finally:
        engine.close()


def test_a_streaming_clone_row_matches_its_whole_row(qwen_checkpoints: dict[str, Path], tmp_path: Path) -> None:
    """Voice cloning in context: the reference's codes stand in front of the row in both paths."""
    import soundfile

    from ttsq.config import Settings
    from ttsq.engines.qwen.fast import QwenFastEngine
    from ttsq.storage import LocalStorage
    from ttsq.voices import add_voice

    rate = 16_000
    t = np.arange(int(1.5 * rate)) / rate
    wav = io.BytesIO()
    soundfile.write(wav, (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), rate, format="WAV")
    storage_url = str(tmp_path / "store")
    voice = add_voice(LocalStorage(storage_url), wav.getvalue(), "This is my reference voice.")
    engine = QwenFastEngine(
        Settings(
            engine="qwen-fast",
            qwen_model=str(qwen_checkpoints["base"]),
            qwen_max_frames=256,
            max_batch=2,
            storage_url=storage_url,
        )
    )
    engine.load()
    try:
        clone = {"mode": "voice_clone", "reference": voice}
        row = Row("clone", [])
        engine.admit(request("Cloned words.", 90, seed=11, **clone), row.done, piece=row.piece)
        finish(engine, row)
        out = row.output()
        assert np.array_equal(joined(row.pieces, 90), out.samples)
        (whole,) = engine.synthesize_batch([request("Cloned words.", 90, seed=11, **clone)])
        assert isinstance(whole, EngineOutput) and whole.samples.shape == out.samples.shape
        assert float(np.abs(whole.samples - out.samples).max()) <= TINY_MAX_ERROR
    finally:
        engine.close()
