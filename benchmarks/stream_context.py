"""qwen-fast's streaming decode: what its left context and its chunk ramp cost and change.

A streaming row's codes are decoded in chunks (1, 2, 4 … frames up to a cap), each with up to
``LEFT_CONTEXT_FRAMES`` frames of left context, and cut at its first new frame
(``ttsq/engines/qwen/stream.py``). Three tables, in one run, on random-weight codecs (the tiny
checkpoint's and the full-size architecture's decoder, randomly initialised as
``ttsq.testing.qwen_checkpoint`` initialises them, with qwen-fast's rewritten modules):

- **Error against the whole-row decode, by left context.** The same random codes decoded whole and
  streamed at each ``--contexts`` value: the largest sample error, the signal-to-error ratio over the
  row, and the error in steps of 16-bit PCM. Random weights are not a trained codec: the figures show
  how far the context reaches in this network, not how a join sounds.
- **Codec cost by chunk cap.** Frames the codec decodes for a streamed row against its whole-row decode
  (the left context is decoded again for every chunk), and the seconds that takes, at each ``--caps``
  value.
- **First audio by first chunk** (tiny checkpoint only, the real engine): seconds from ``admit`` to
  the first piece for first chunks of 1, 2 and 4 frames, the median of ``--repeats``.

    python benchmarks/stream_context.py                          # both sizes, a few minutes on 2 cores
    python benchmarks/stream_context.py --size tiny --frames 300
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import statistics
import tempfile
import time
from typing import Any


def random_decoder(size: str, seed: int) -> Any:
    """A codec decoder of the tiny or full-size architecture, random as the test checkpoints are, with
    qwen-fast's cheaper modules swapped in (what the engine runs)."""
    import torch

    with contextlib.redirect_stdout(io.StringIO()):  # qwen-tts's flash-attn banner
        from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (
            Qwen3TTSTokenizerV2DecoderConfig,
        )
        from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Decoder

    from ttsq.engines.qwen.codec import rewrite
    from ttsq.testing.qwen_checkpoint import _FULL_DECODER, _TINY_DECODER

    torch.manual_seed(seed)
    config = _FULL_DECODER if size == "full" else _TINY_DECODER
    decoder = Qwen3TTSTokenizerV2Decoder(Qwen3TTSTokenizerV2DecoderConfig(**config)).eval()
    with torch.no_grad():
        for module in decoder.modules():
            if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
                module.reset_parameters()
        for name, weight in decoder.named_parameters():
            if name.endswith(("embedding_sum", "scale")):
                torch.nn.init.normal_(weight)
    rewrite(decoder)
    return decoder


def errors(decoder: Any, frames: int, contexts: list[int], seed: int) -> list[dict[str, float]]:
    import numpy as np
    import torch

    from ttsq.engines.qwen.stream import stream_decode

    torch.manual_seed(1000 + seed)
    codes = torch.randint(0, 2048, (frames, 16))
    with torch.inference_mode():
        whole = decoder.chunked_decode(codes.T[None])[0, 0].float().numpy()
    power = float(np.sum(whole.astype(np.float64) ** 2))
    rows = []
    for context in contexts:
        streamed = np.concatenate(stream_decode(decoder, codes, context=context))
        error = streamed.astype(np.float64) - whole
        noise = float(np.sum(error**2))
        rows.append(
            {
                "context": context,
                "max_abs": float(np.abs(error).max()),
                "snr_db": 10 * np.log10(power / noise) if noise > 0 else float("inf"),
                "pcm_steps": float(np.abs(error).max() * 32768),
                "rms": float(np.sqrt(power / whole.size)),
            }
        )
    return rows


def costs(decoder: Any, frames: int, caps: list[int], repeats: int) -> list[dict[str, float]]:
    """Per cap: the frames the codec decodes for a streamed row against the row's own (the context is
    decoded again for every chunk; deterministic), and the seconds, the fastest of ``repeats`` (the
    least disturbed by whatever else runs on the machine)."""
    import torch

    from ttsq.engines.qwen import stream

    codes = torch.randint(0, 2048, (frames, 16))

    def timed(call: Any) -> float:
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            with torch.inference_mode():
                call()
            times.append(time.perf_counter() - started)
        return min(times)

    whole = timed(lambda: decoder.chunked_decode(codes.T[None]))
    saved = stream.CHUNK_CAP_FRAMES
    rows = [{"cap": 0, "chunks": 1, "decoded": 1.0, "seconds": whole, "ratio": 1.0}]
    try:
        for cap in caps:
            stream.CHUNK_CAP_FRAMES = cap
            bounds = stream.schedule(frames)
            decoded = sum(end - max(0, start - stream.LEFT_CONTEXT_FRAMES) for start, end in bounds) / frames
            seconds = timed(lambda: stream.stream_decode(decoder, codes))
            rows.append(
                {"cap": cap, "chunks": len(bounds), "decoded": decoded, "seconds": seconds, "ratio": seconds / whole}
            )
    finally:
        stream.CHUNK_CAP_FRAMES = saved
    return rows


def arrival(arrived: list[float], samples: Any) -> None:
    arrived.append(time.perf_counter())


def first_audio(firsts: list[int], repeats: int) -> list[dict[str, float]]:
    """Seconds from admit to the first piece in the real engine (tiny checkpoint, one row alone)."""
    from ttsq.config import Settings
    from ttsq.engines.qwen import stream
    from ttsq.engines.qwen.fast import QwenFastEngine
    from ttsq.job import SynthesisRequest
    from ttsq.testing.qwen_checkpoint import build

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        build(folder, "voice_design", "tiny")
        engine = QwenFastEngine(Settings(engine="qwen-fast", qwen_model=folder, qwen_max_frames=256, max_batch=4))
        engine.load()
        engine.warmup()
        saved = stream.FIRST_CHUNK_FRAMES
        try:
            for first in firsts:
                stream.FIRST_CHUNK_FRAMES = first
                times = []
                for repeat in range(repeats):
                    arrived: list[float] = []
                    answered: list[object] = []
                    request = SynthesisRequest.from_dict({"text": "Hello there.", "max_new_tokens": 24, "seed": repeat})
                    started = time.perf_counter()
                    engine.admit(request, answered.append, piece=functools.partial(arrival, arrived))
                    while engine.active or not answered:
                        engine.step()
                        if not engine.active:
                            time.sleep(0.001)
                    times.append(arrived[0] - started)
                rows.append({"first": first, "seconds": statistics.median(times)})
        finally:
            stream.FIRST_CHUNK_FRAMES = saved
            engine.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=("tiny", "full", "both"), default="both")
    parser.add_argument("--frames", type=int, default=0, help="frames per row (default: 300 tiny, 200 full)")
    parser.add_argument("--contexts", default="0,8,25,50,72,100,144", help="left contexts to measure, in frames")
    parser.add_argument("--caps", default="24,32,48,64", help="chunk caps to time, in frames")
    parser.add_argument("--seeds", type=int, default=2, help="random codecs (and codes) per size")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions; the median is reported")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    contexts = [int(v) for v in args.contexts.split(",")]
    caps = [int(v) for v in args.caps.split(",")]
    sizes = ["tiny", "full"] if args.size == "both" else [args.size]
    for size in sizes:
        frames = args.frames or (300 if size == "tiny" else 200)
        print(f"\n## {size} codec, {frames} frames, chunks {args.caps} capped; error against the whole-row decode\n")
        print("| left context (frames) | seed | max abs error | 16-bit steps | SNR (dB) | signal RMS |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: |")
        for seed in range(args.seeds):
            decoder = random_decoder(size, seed)
            for row in errors(decoder, frames, contexts, seed):
                print(
                    f"| {row['context']} | {seed} | {row['max_abs']:.2e} | {row['pcm_steps']:.2f} "
                    f"| {row['snr_db']:.1f} | {row['rms']:.3f} |",
                    flush=True,
                )
        print(f"\n## {size} codec: codec seconds for a {frames}-frame row, streamed (context 72) and whole\n")
        print("| chunk cap (frames) | chunks | frames decoded, against whole | seconds (fastest) | against whole |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for row in costs(random_decoder(size, 0), frames, caps, args.repeats):
            cap = "whole row" if not row["cap"] else str(row["cap"])
            print(
                f"| {cap} | {row['chunks']} | {row['decoded']:.2f}x | {row['seconds']:.3f} | {row['ratio']:.2f}x |",
                flush=True,
            )
    if "tiny" in sizes:
        print("\n## tiny engine: admit to first piece, one row alone\n")
        print("| first chunk (frames) | seconds (median) |")
        print("| ---: | ---: |")
        for row in first_audio([1, 2, 4], args.repeats * 3):
            print(f"| {row['first']} | {row['seconds']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
