"""qwen-fast (ttsq's decode loop) against stock batched qwen-tts (the ``qwen`` engine), side by side in one run.

Two measurements, both engines loaded from the same checkpoint in one process and run interleaved:

- **Fixed batches.** For each batch size B, the same B requests with a fixed frame count (random
  weights never sample the end token, so every row makes exactly ``--frames`` frames) through each
  engine's ``synthesize_batch``. Prints audio seconds per wall second, time per frame, and their ratio;
  on CUDA also the peak device memory, and the fraction of the memory-bandwidth roofline the fast
  loop reaches (weights read once per frame plus every row's KV cache, against ``--bandwidth``).
- **Mixed lengths, open loop.** ``--jobs`` requests with frame caps drawn from a wide range arrive at
  a fixed rate (seeded Poisson arrivals, the same schedule for both engines, independent of how fast
  either serves) into the real ``Batcher``: stock batches them (each batch runs to its longest row),
  qwen-fast admits each into a free slot at the next frame. Every job carries the same seed: the
  batcher groups jobs by seed (and sampling), so per-job seeds would leave stock a batch of one each.
  Prints jobs/s and p50/p95 latency.

    python benchmarks/qwen_fast.py                                          # CPU, tiny checkpoint, ~5 min
    python benchmarks/qwen_fast.py --size full --device cuda --batches 1,2,4,8,16,32,64 --frames 64 \\
        --jobs 256 --rate 40 --slots 64                                     # one H200, a few minutes
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away into the forest."
FRAMES_PER_SECOND = 12.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an existing VoiceDesign checkpoint folder")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny", help="random checkpoint to build")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    parser.add_argument("--frames", type=int, default=48, help="codec frames per request in the fixed batches")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the median is reported")
    parser.add_argument("--jobs", type=int, default=30, help="requests in the mixed-length run (0: skip it)")
    parser.add_argument("--rate", type=float, default=0.5, help="mixed-length arrivals per second")
    parser.add_argument("--slots", type=int, default=16, help="batch size (stock) and slots (fast) in the mixed run")
    parser.add_argument("--min-frames", type=int, default=8)
    parser.add_argument("--max-frames", type=int, default=120)
    parser.add_argument("--bandwidth", type=float, default=4.8e12, help="device bytes/s for the roofline (H200)")
    parser.add_argument(
        "--threads",
        default="0",
        help="torch intra-op threads per torch thread, both engines (TTSQ_TORCH_THREADS; 0: each engine's "
        "policy); a comma-separated list runs the fixed batches once per setting (the batcher's threads; "
        "qwen-fast's codec thread keeps its policy) and reports each engine at its best",
    )
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args()

    import torch

    from ttsq.config import Settings
    from ttsq.engines.qwen.engine import QwenEngine
    from ttsq.engines.qwen.fast import QwenFastEngine
    from ttsq.testing.qwen_checkpoint import build

    batches = [int(b) for b in args.batches.split(",")]
    sweep = [int(t) for t in args.threads.split(",")]
    if any(t < 0 for t in sweep):
        parser.error("--threads: 0 or more threads per setting")
    slots = max(max(batches), args.slots)
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else build(Path(scratch) / args.size, "voice_design", args.size)
        settings = Settings(
            engine="qwen",
            qwen_model=str(model),
            qwen_device=args.device,
            max_batch=slots,
            qwen_max_frames=max(256, args.frames, args.max_frames),
            torch_threads=sweep[0] if len(sweep) == 1 else 0,
        )
        stock = QwenEngine(settings)
        fast = QwenFastEngine(settings.replace(engine="qwen-fast"))
        loads = {}
        for name, engine in (("stock", stock), ("fast", fast)):
            started = time.perf_counter()
            engine.load()
            engine.warmup()
            loads[name] = round(time.perf_counter() - started, 1)
        cuda = stock._device.startswith("cuda")
        device = (
            torch.cuda.get_device_name(0)
            if cuda
            else f"cpu (threads per torch thread: stock {stock.torch_threads}, fast {fast.torch_threads})"
        )
        print(f"qwen-fast vs stock qwen-tts: {model.name} on {device}, {stock._dtype_name}; load+warm-up s: {loads}")

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        rows = fixed_batches(args, batches, sweep, stock, fast, sync, cuda, torch)
        stock.close()
        fast.close()
        mixed = mixed_lengths(args, settings) if args.jobs else {}
        if args.json_path:
            figures = {"device": device, "rows": rows, "best": best_settings(rows), "mixed": mixed}
            Path(args.json_path).write_text(json.dumps(figures, indent=2))


class Stages:
    """Wall seconds of qwen-fast's stages: prefill (``admit``), frames (``step``), the codec decode (on
    its own thread) and the codec's tail, the part of it after the last frame, which nothing overlaps.
    The engine's own methods, timed from outside."""

    def __init__(self, fast: Any, sync: Any) -> None:
        self.seconds = {"prefill": 0.0, "frames": 0.0, "codec": 0.0, "codec_tail": 0.0}
        self._frames_end = self._codec_end = 0.0
        self._sync = sync
        timed = (("prefill", fast.loop, "admit"), ("frames", fast.loop, "step"), ("codec", fast, "_decode_rows"))
        for stage, owner, method in timed:
            setattr(owner, method, self._timed(stage, getattr(owner, method)))  # the instance's own attribute

    def _timed(self, stage: str, call: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self._sync()
                ended = time.perf_counter()
                self.seconds[stage] += ended - started
                if stage == "frames":
                    self._frames_end = ended
                elif stage == "codec":
                    self._codec_end = ended

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def batch_done(self) -> None:
        self.seconds["codec_tail"] += max(0.0, self._codec_end - self._frames_end)

    def per_batch(self, batches: int) -> dict[str, float]:
        return {stage: round(seconds / batches, 3) for stage, seconds in self.seconds.items()}


def fixed_batches(
    args: Any, batches: list[int], sweep: list[int], stock: Any, fast: Any, sync: Any, cuda: bool, torch: Any
) -> list[dict[str, Any]]:
    from ttsq.engines.qwen.engine import usable_cores
    from ttsq.job import SynthesisRequest

    stages = Stages(fast, sync)

    def timed(engine: Any, size: int) -> tuple[float, int]:
        requests = [
            SynthesisRequest.from_dict({"text": TEXT, "max_new_tokens": args.frames, "seed": i}) for i in range(size)
        ]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        else:  # one process holds both engines: each runs with the threads its worker would give it
            torch.set_num_threads(engine.torch_threads)
        sync()
        started = time.perf_counter()
        outputs = engine.synthesize_batch(requests)
        sync()
        seconds = time.perf_counter() - started
        if engine is fast:
            stages.batch_done()
        bad = [out for out in outputs if isinstance(out, Exception)]
        if bad:
            raise SystemExit(f"batch of {size} failed: {bad[0]}")
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        return seconds, peak

    def codec(engine: Any, size: int) -> float:
        """The engine's codec decode of a finished batch, on every core: what it does once the last
        frame is made (qwen-fast's decoder is ``qwen_codec``'s rewrite of stock's)."""
        codes = torch.randint(0, 2048, (args.frames, 16), device=fast.loop.device)
        if not cuda:
            torch.set_num_threads(usable_cores())
        sync()
        started = time.perf_counter()
        with torch.inference_mode():
            engine._tts.model.speech_tokenizer.decode([{"audio_codes": codes} for _ in range(size)])
        sync()
        return time.perf_counter() - started

    print(
        f"\nfixed batches, {args.frames} frames per request ({args.frames / FRAMES_PER_SECOND:.2f} s of audio); "
        "'codec s' is each engine's codec decode of the batch on every core (stock's decoder, then "
        "qwen-fast's rewrite of it); 'loop x' the speedup without them"
    )
    header = (
        f"{'batch':>5} {'stock a-s/s':>12} {'fast a-s/s':>11} {'speedup':>8} {'stock ms/fr':>12} "
        f"{'fast ms/fr':>11} {'codec s':>11} {'loop x':>7}"
    )
    if cuda:
        header += f" {'fast GiB':>9} {'roofline':>9}"
    print(header)
    rows = []
    policy = {"stock": stock.torch_threads, "fast": fast.torch_threads}
    for size, setting in ((size, setting) for size in batches for setting in sweep):
        if len(sweep) > 1 and not cuda:
            stock.torch_threads, fast.torch_threads = setting or policy["stock"], setting or policy["fast"]
            print(f"threads: stock {stock.torch_threads}, fast {fast.torch_threads}" + (" (policy)" * (not setting)))
        times: dict[str, list[float]] = {"stock": [], "fast": [], "codec_stock": [], "codec_fast": []}
        peak = 0
        stages.reset()
        for _ in range(args.repeats):
            for name, engine in (("stock", stock), ("fast", fast)):
                seconds, used = timed(engine, size)
                times[name].append(seconds)
                if name == "fast":
                    peak = max(peak, used)
            times["codec_stock"].append(codec(stock, size))
            times["codec_fast"].append(codec(fast, size))
        audio_s = size * args.frames / FRAMES_PER_SECOND
        s_stock, s_fast = statistics.median(times["stock"]), statistics.median(times["fast"])
        c_stock = min(statistics.median(times["codec_stock"]), 0.99 * s_stock)
        c_fast = min(statistics.median(times["codec_fast"]), 0.99 * s_fast)
        row = {
            "batch": size,
            "threads": {"stock": stock.torch_threads, "fast": fast.torch_threads, "policy": not setting},
            "audio_s": round(audio_s, 2),
            "stock_audio_s_per_s": round(audio_s / s_stock, 2),
            "fast_audio_s_per_s": round(audio_s / s_fast, 2),
            "speedup": round(s_stock / s_fast, 2),
            "stock_ms_per_frame": round(1000 * s_stock / args.frames, 2),
            "fast_ms_per_frame": round(1000 * s_fast / args.frames, 2),
            "fast_realtime_per_stream": round(audio_s / s_fast / size, 2),
            "codec_stock_s": round(c_stock, 3),
            "codec_fast_s": round(c_fast, 3),
            "loop_speedup": round((s_stock - c_stock) / (s_fast - c_fast), 2),
        }
        line = (
            f"{size:>5} {row['stock_audio_s_per_s']:>12} {row['fast_audio_s_per_s']:>11} {row['speedup']:>7}x "
            f"{row['stock_ms_per_frame']:>12} {row['fast_ms_per_frame']:>11} "
            f"{row['codec_stock_s']:>5}/{row['codec_fast_s']:<5} "
            f"{row['loop_speedup']:>6}x"
        )
        if cuda:
            moved = bytes_per_frame(fast, size, args.frames)
            row["fast_peak_gib"] = round(peak / 2**30, 2)
            row["roofline_fraction"] = round(moved / args.bandwidth / (s_fast / args.frames), 3)
            line += f" {row['fast_peak_gib']:>9} {row['roofline_fraction']:>9}"
        row["fast_stages_s"] = stages.per_batch(args.repeats)
        rows.append(row)
        print(line, flush=True)
    print("qwen-fast's stages per batch, s (codec_tail: the codec after the last frame, overlapping nothing)")
    for row in rows:
        threads = f"threads {row['threads']['fast']}  " if len(sweep) > 1 else ""
        print(f"{row['batch']:>5} {threads}" + "  ".join(f"{k} {v}" for k, v in row["fast_stages_s"].items()))
    if len(sweep) > 1:
        print("each engine at its best thread setting")
        for size, best in best_settings(rows).items():
            print(
                f"{size:>5} stock {best['stock_audio_s_per_s']} a-s/s ({best['stock_threads']} threads), fast "
                f"{best['fast_audio_s_per_s']} ({best['fast_threads']}): {best['speedup']}x"
            )
    single = next((r for r in rows if r["batch"] == 1), None)
    if single:
        print(
            f"single stream: fast {single['fast_realtime_per_stream']}x real time "
            f"(stock {single['stock_audio_s_per_s']}x)"
        )
    return rows


def best_settings(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per batch size, each engine's fastest thread setting and the speedup between the two."""
    best: dict[int, dict[str, Any]] = {}
    for size in dict.fromkeys(row["batch"] for row in rows):
        same = [row for row in rows if row["batch"] == size]
        stock = max(same, key=lambda row: row["stock_audio_s_per_s"])
        fast = max(same, key=lambda row: row["fast_audio_s_per_s"])
        best[size] = {
            "stock_audio_s_per_s": stock["stock_audio_s_per_s"],
            "stock_threads": stock["threads"]["stock"],
            "fast_audio_s_per_s": fast["fast_audio_s_per_s"],
            "fast_threads": fast["threads"]["fast"],
            "speedup": round(fast["fast_audio_s_per_s"] / stock["stock_audio_s_per_s"], 2),
        }
    return best


def bytes_per_frame(fast: Any, rows: int, frames: int) -> float:
    """Bytes a frame must read at least: the talker's layers and head once, the code predictor's layers,
    projection and one head 15 times, and every row's talker KV cache at the middle of its frames."""
    talker = fast._tts.model.talker
    size = {p.data_ptr(): p.numel() * p.element_size() for p in talker.model.layers.parameters()}
    layers = sum(size.values())
    head = talker.codec_head.weight.numel() * talker.codec_head.weight.element_size()
    predictor = talker.code_predictor
    per_step = (
        sum(p.numel() * p.element_size() for p in predictor.model.layers.parameters())
        + sum(p.numel() * p.element_size() for p in predictor.small_to_mtp_projection.parameters())
        + predictor.lm_head[0].weight.numel() * predictor.lm_head[0].weight.element_size()
    )
    config = talker.config
    kv_per_token = (
        2
        * config.num_hidden_layers
        * config.num_key_value_heads
        * config.head_dim
        * talker.codec_head.weight.element_size()
    )
    context = 40 + frames / 2  # a short prompt plus the mean decoded length
    return float(layers + head + 15 * per_step + rows * kv_per_token * context)


def mixed_lengths(args: Any, settings: Any) -> dict[str, Any]:
    from ttsq.batching.batcher import Batcher
    from ttsq.engines import create_engine
    from ttsq.job import SynthesisRequest

    schedule = random.Random(7)
    arrivals, at = [], 0.0
    for i in range(args.jobs):
        at += schedule.expovariate(args.rate)
        arrivals.append((at, schedule.randint(args.min_frames, args.max_frames), i))
    audio = sum(frames for _, frames, _ in arrivals) / FRAMES_PER_SECOND
    print(
        f"\nmixed lengths, open loop: {args.jobs} jobs of {args.min_frames}-{args.max_frames} frames "
        f"({audio:.0f} s of audio), {args.rate}/s arrivals, batch/slots {args.slots}"
    )
    print(f"{'engine':>6} {'jobs/s':>7} {'p50 s':>7} {'p95 s':>7} {'audio-s/s':>10}")
    figures = {}
    for name, engine_name in (("stock", "qwen"), ("fast", "qwen-fast")):
        engine = create_engine(settings.replace(engine=engine_name, max_batch=args.slots))
        batcher = Batcher(engine, max_batch=args.slots, max_wait_s=0.05)
        batcher.start()  # loads and warms a fresh engine on the batcher's thread
        latencies: list[float] = []
        lock = threading.Lock()
        started = time.perf_counter()
        futures = []
        for at, frames, i in arrivals:
            delay = started + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            submitted = time.perf_counter()
            future = batcher.submit(
                SynthesisRequest.from_dict({"text": f"{TEXT} {i}", "max_new_tokens": frames, "seed": 1})
            )  # one group: see the docstring

            def finished(
                _: Any, submitted: float = submitted, lock: threading.Lock = lock, latencies: list[float] = latencies
            ) -> None:
                with lock:
                    latencies.append(time.perf_counter() - submitted)

            future.add_done_callback(finished)
            futures.append(future)
        for future in futures:
            future.result(timeout=3600)
        elapsed = time.perf_counter() - started
        batcher.stop()
        quantiles = statistics.quantiles(latencies, n=20)
        figures[name] = {
            "jobs_per_s": round(args.jobs / elapsed, 2),
            "p50_s": round(statistics.median(latencies), 2),
            "p95_s": round(quantiles[18], 2),
            "audio_s_per_s": round(audio / elapsed, 2),
        }
        f = figures[name]
        print(f"{name:>6} {f['jobs_per_s']:>7} {f['p50_s']:>7} {f['p95_s']:>7} {f['audio_s_per_s']:>10}", flush=True)
    return figures


if __name__ == "__main__":
    main()
