"""Batched Qwen3-TTS through ttsq's engine against calling qwen-tts once per request, in one run.

For each batch size B, the same B requests (fixed frame count, so every row produces the same audio
length) are synthesized two ways, interleaved on the same loaded model:

- **ttsq**: one ``QwenEngine.synthesize_batch`` call (one padded ``generate`` for the whole batch);
- **one by one**: B calls of qwen-tts's ``generate_voice_design``, one request each, the way a plain
  per-message worker would.

It prints audio seconds per wall second for both, their ratio, the batch's latency and, on CUDA, the
peak device memory. Random-weight checkpoints are fine for speed: ``--size tiny`` builds a CPU-sized
one, ``--size full`` the published 1.7B architecture (for a GPU). ``--model`` uses an existing folder.

    python benchmarks/qwen_batching.py --size tiny                                   # CPU, ~1 min
    python benchmarks/qwen_batching.py --size full --device cuda --batches 1,2,4,8,16,32,64 --frames 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."
SAMPLE_RATE = 24_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an existing checkpoint folder (VoiceDesign)")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny", help="random checkpoint to build")
    parser.add_argument("--batches", default="1,2,4,8,16", help="comma-separated batch sizes")
    parser.add_argument("--frames", type=int, default=24, help="codec frames per request (12.5 per second)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the median is reported")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args()

    import torch

    from ttsq.config import Settings
    from ttsq.engines.qwen.engine import QwenEngine
    from ttsq.job import SynthesisRequest
    from ttsq.testing.qwen_checkpoint import build

    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else build(Path(scratch) / args.size, "voice_design", args.size)
        settings = Settings(
            engine="qwen",
            qwen_model=str(model),
            qwen_device=args.device,
            qwen_dtype=args.dtype,
            qwen_max_frames=max(2048, args.frames),
        )  # requests carry their own cap
        engine = QwenEngine(settings)
        started = time.perf_counter()
        engine.load()
        engine.warmup()
        load_s = time.perf_counter() - started
        tts: Any = engine._tts
        cuda = torch.cuda.is_available() and str(tts.device).startswith("cuda")

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def batched(size: int) -> tuple[float, float]:
            requests = [
                SynthesisRequest.from_dict({"text": TEXT, "seed": 0, "max_new_tokens": args.frames})
                for _ in range(size)
            ]
            sync()
            began = time.perf_counter()
            outputs = engine.synthesize_batch(requests)
            sync()
            elapsed = time.perf_counter() - began
            samples = 0
            for output in outputs:
                if isinstance(output, Exception):
                    raise output
                samples += output.samples.size
            return elapsed, samples / SAMPLE_RATE

        def one_by_one(size: int) -> tuple[float, float]:
            torch.manual_seed(0)
            sync()
            began = time.perf_counter()
            samples = 0
            for _ in range(size):
                wavs, _ = tts.generate_voice_design(
                    text=TEXT, instruct="", language="auto", max_new_tokens=args.frames + 1
                )
                samples += min(wavs[0].size, args.frames * 1920)
            sync()
            return time.perf_counter() - began, samples / SAMPLE_RATE

        batched(1), one_by_one(1)  # first calls pay for lazy initialisation: keep them out of the table
        rows = []
        for size in [int(b) for b in args.batches.split(",")]:
            runs: dict[str, list[tuple[float, float]]] = {"ttsq": [], "single": []}
            peak = 0.0
            for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both alike
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                runs["ttsq"].append(batched(size))
                if cuda:
                    peak = max(peak, torch.cuda.max_memory_allocated() / 2**30)
                runs["single"].append(one_by_one(size))
            ttsq_s = statistics.median(t for t, _ in runs["ttsq"])
            single_s = statistics.median(t for t, _ in runs["single"])
            audio = runs["ttsq"][0][1]
            single_audio = runs["single"][0][1]
            rows.append(
                {
                    "batch": size,
                    "audio_s": round(audio, 2),
                    "ttsq_audio_s_per_s": round(audio / ttsq_s, 2),
                    "one_by_one_audio_s_per_s": round(single_audio / single_s, 2),
                    "speedup": round((audio / ttsq_s) / (single_audio / single_s), 2),
                    "batch_latency_s": round(ttsq_s, 3),
                    "peak_device_gib": round(peak, 2) if cuda else None,
                }
            )
            print(f"batch {size}: done", file=sys.stderr)
        engine.close()

    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    print(
        f"\nQwen3-TTS {args.size if not args.model else model.name}, {args.frames} frames "
        f"({args.frames / 12.5:.2f} s audio) per request, {device}, load+warm-up {load_s:.1f} s, "
        f"median of {args.repeats}"
    )
    header = f"{'batch':>5} {'ttsq audio-s/s':>15} {'one-by-one':>11} {'speedup':>8} {'batch s':>8} {'peak GiB':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        peak_text = f"{row['peak_device_gib']:.2f}" if row["peak_device_gib"] is not None else "-"
        print(
            f"{row['batch']:>5} {row['ttsq_audio_s_per_s']:>15.2f} {row['one_by_one_audio_s_per_s']:>11.2f} "
            f"{row['speedup']:>7.2f}x {row['batch_latency_s']:>8.3f} {peak_text:>9}"
        )
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"frames": args.frames, "device": device, "size": args.size, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
