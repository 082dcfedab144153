"""Batches through the queue against a direct batched call of the same jobs, in one run.

For each system (an engine with a batch window or a thread setting), every round:

- **direct**: the round's ``--jobs`` requests through an engine loaded in this process, in batches
  of ``--max-batch`` (``synthesize_batch``, one after another): what the device can do with perfectly
  filled batches and no queue at all;
- **queue**: the same number of new requests (their own texts: every one a cache miss), submitted at
  once with ``Client.submit`` to a ``ttsq worker`` on a private Redis (a local folder for storage),
  timed from the first submit to the last result.

Rounds alternate which of the two runs first, so that a drift in the machine's speed falls on both.

Every request has the same frame count (random weights never sample their end token) and the same
seed (the batcher groups jobs by seed and sampling). Prints audio seconds per second of both, their
ratio (1.0: the queue costs nothing), and the batch sizes the worker formed. Systems:

- ``qwen@20``: stock qwen with a fixed 20 ms window (``TTSQ_MAX_WAIT_MS=20``, the old default);
- ``qwen``: stock qwen with the default window, which waits for jobs still on their way;
- ``qwen-fast#N``: qwen-fast with ``TTSQ_TORCH_THREADS=N`` (N = the cores: torch's own default for
  each thread that runs torch), and ``qwen-fast``: the thread policy's default.

A system is ``engine[@MS][#THREADS]`` in general. Besides the ratio, ``engine busy`` is the worker's
engine time (the distinct batches' ``synthesis_s``) over the queue run's wall time: near 1, the
engine never waited for jobs, and what the queue lost went to the engine running slower beside the
worker's other threads.

    python benchmarks/queue_batching.py                   # CPU, tiny checkpoint, ~6 min on 2 cores
    python benchmarks/queue_batching.py --systems qwen@20,qwen --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer

# Run as a script, this folder is on the path, not the repository: compare.py's process helpers are
# imported from beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.compare import _env, _process

TEXT = "The quick brown fox jumps over the lazy dog."
FRAMES_PER_SECOND = 12.5


def system_settings(name: str, base: Settings) -> Settings:
    """``engine[@MS][#THREADS]``: a max wait in milliseconds (``TTSQ_MAX_WAIT_MS``), torch threads per
    torch thread (``TTSQ_TORCH_THREADS``); the defaults where left out."""
    rest, _, threads = name.partition("#")
    engine, _, wait = rest.partition("@")
    if engine not in ("qwen", "qwen-fast"):
        raise SystemExit(f"unknown system {name!r}: qwen or qwen-fast, then @MS and #THREADS if wanted")
    queue = "bench-" + "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name)
    settings = base.replace(engine=engine, queue=queue)
    if wait:
        settings = settings.replace(max_wait_ms=int(wait))
    if threads:
        settings = settings.replace(torch_threads=int(threads))
    return settings


def called_directly(engine: Any, requests: list[Any], max_batch: int) -> float:
    """Seconds for ``requests`` through ``engine.synthesize_batch`` in full batches, one after another."""
    started = time.perf_counter()
    for start in range(0, len(requests), max_batch):
        outputs = engine.synthesize_batch(requests[start : start + max_batch])
        if any(isinstance(out, Exception) for out in outputs):
            raise SystemExit(f"a direct call failed: {outputs}")
    return time.perf_counter() - started


def through_queue(client: Any, texts: list[str], frames: int, timeout: float) -> tuple[float, list[dict[str, Any]]]:
    """Seconds from the first submit to the last result, and the results."""
    started = time.perf_counter()
    jobs = [client.submit(text, max_new_tokens=frames, seed=1) for text in texts]
    done = [job.wait(timeout) for job in jobs]
    return time.perf_counter() - started, done


def main() -> None:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an existing VoiceDesign checkpoint folder")
    parser.add_argument("--systems", default="qwen@20,qwen,qwen-fast#{cores},qwen-fast")
    parser.add_argument("--jobs", type=int, default=64, help="jobs per round per system")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--frames", type=int, default=48, help="codec frames per job")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the median ratio is reported")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for a round's jobs")
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args()
    figures = run(args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2))


def run(args: Any) -> dict[str, Any]:
    import os

    from ttsq.client import Client
    from ttsq.engines import create_engine
    from ttsq.engines.qwen.engine import usable_cores
    from ttsq.job import SynthesisRequest
    from ttsq.records.connection import connect
    from ttsq.testing.qwen_checkpoint import build

    cores = usable_cores()
    names = [name.format(cores=cores) for name in args.systems.split(",") if name]
    results: dict[str, Any] = {"cores": cores, "jobs": args.jobs, "frames": args.frames, "systems": {}}
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-queue-batching-")))
        model = Path(args.model) if args.model else build(folder / "tiny", "voice_design")
        redis = RedisServer().start()
        stack.callback(redis.stop)
        base = Settings(
            broker_url=f"{redis.url}/0",
            result_backend=f"{redis.url}/1",
            cache_url=f"{redis.url}/2",
            storage_url=str(folder / "audio"),
            qwen_model=str(model),
            qwen_device="cpu",
            qwen_max_frames=max(256, args.frames),
            max_batch=args.max_batch,
            metrics_port=0,
            job_timeout_s=int(args.timeout),
            visibility_timeout_s=int(args.timeout) * 4,
        )
        print(f"queue vs direct: {model.name} on cpu ({cores} cores), {args.jobs} jobs x {args.frames} frames")
        print(
            f"{'system':>14} {'round':>5} {'direct a-s/s':>12} {'queue a-s/s':>11} {'ratio':>6} {'busy':>6}  "
            "batch size:jobs"
        )
        for name in names:
            settings = system_settings(name, base)
            # One system at a time: its worker and its in-process engine alone on the machine.
            with ExitStack() as system:
                engine = create_engine(settings)
                engine.load()
                engine.warmup()
                system.callback(engine.close)
                process = system.enter_context(
                    _process(
                        [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"{settings.queue}@bench"],
                        _env(settings),
                        folder / f"{settings.queue}.log",
                    )
                )
                cache = connect(settings.cache_url)
                deadline = time.monotonic() + 300
                while not cache.exists(FLEET_PREFIX + settings.queue):
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise SystemExit(f"{name}: the worker did not start; see {folder / settings.queue}.log")
                    time.sleep(0.2)
                cache.close()
                client = Client(settings)
                system.callback(client.close)
                client.submit(f"warm {name}", max_new_tokens=4, seed=0).wait(args.timeout)
                rounds = []
                for number in range(args.rounds):

                    def texts(kind: str, tag: str = f"{name} {number} {os.getpid()}") -> list[str]:
                        return [f"{kind} {tag} {i}. {TEXT}" for i in range(args.jobs)]

                    direct_requests = [
                        SynthesisRequest(text=text, max_new_tokens=args.frames, seed=1) for text in texts("direct")
                    ]
                    # Odd rounds run the queue first: a machine whose speed drifts over a round (this
                    # 2-core one moved 15% between rounds) then tilts the ratio both ways, not one.
                    if number % 2:
                        queue_s, done = through_queue(client, texts("queue"), args.frames, args.timeout)
                        direct_s = called_directly(engine, direct_requests, args.max_batch)
                    else:
                        direct_s = called_directly(engine, direct_requests, args.max_batch)
                        queue_s, done = through_queue(client, texts("queue"), args.frames, args.timeout)
                    audio_s = args.jobs * args.frames / FRAMES_PER_SECOND
                    sizes = sorted(Counter(result["batch_size"] for result in done).items(), reverse=True)
                    # A stock batch's jobs share one synthesis_s; qwen-fast's rows each have their own.
                    busy = sum({result["timings"]["synthesis_s"] for result in done})
                    row = {
                        "direct_audio_s_per_s": round(audio_s / direct_s, 2),
                        "queue_audio_s_per_s": round(audio_s / queue_s, 2),
                        "ratio": round(direct_s / queue_s, 3),
                        "jobs_by_batch_size": {str(size): count for size, count in sizes},
                        "engine_busy": round(busy / queue_s, 3) if settings.engine == "qwen" else None,
                    }
                    rounds.append(row)
                    busy_text = "-" if row["engine_busy"] is None else f"{row['engine_busy']:.2f}"
                    print(
                        f"{name:>14} {number + 1:>5} {row['direct_audio_s_per_s']:>12} "
                        f"{row['queue_audio_s_per_s']:>11} {row['ratio']:>6} {busy_text:>6}  "
                        + ", ".join(f"{size}:{count}" for size, count in sizes),
                        flush=True,
                    )
                results["systems"][name] = {
                    "engine": settings.engine,
                    "max_wait_ms": settings.max_wait_ms,
                    "torch_threads": settings.torch_threads,
                    "rounds": rounds,
                    "median_ratio": statistics.median(r["ratio"] for r in rounds),
                    "median_queue_audio_s_per_s": statistics.median(r["queue_audio_s_per_s"] for r in rounds),
                }
    print("\nmedian queue/direct ratio, and queue audio-s/s:")
    for name, system in results["systems"].items():
        print(f"{name:>14} {system['median_ratio']:>6.3f}  {system['median_queue_audio_s_per_s']:>8.2f}")
    return results


if __name__ == "__main__":
    main()
