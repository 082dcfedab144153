"""The fleet at GPU speed: real Redis, real ``ttsq worker`` processes on the stand-in engine, and each
encoder alone on the same cores, in one run.

    python benchmarks/fleet.py                                  # 1 worker, closed loop at 128, ~3 min
    python benchmarks/fleet.py --workers 2 --rate 60 --seconds 20
    python benchmarks/fleet.py --tiny                           # the smoke test: seconds, figures meaningless

The engine is ``ttsq.testing.standin``: a batch costs ``(a + b * rows)`` seconds per second of its longest
audio, asleep with the interpreter lock free, as on a GPU. ``a`` and ``b`` are the published H100
Qwen3-TTS 1.7B figures (docs/scaling.md) divided by ``--speed``: at the default 10 the engine alone
makes about 1,100 audio-s/s at 64 rows, so that what the run measures is the machinery around it (the
queue, the batcher, encoding, storage), not the device.

For each workload, each round (rounds rotate the order, so a drift of the machine falls on all):

- ``wav``, ``mp3``, ``opus`` (stored as Ogg Opus): whole-clip jobs through ``Client.submit``/``wait``;
- ``pcm``: streaming jobs read to their end through ``Client.stream`` (16-bit PCM pieces from Redis) by a
  player that starts at the first piece and plays in real time: first audio p50/p95 and its underruns;

closed loop at ``--in-flight`` jobs (or Poisson arrivals at ``--rate`` jobs/s), for ``--seconds``; only the
jobs that finish inside the window count. Per workload: jobs/s and audio-s/s per worker, the workers'
CPU per job and per audio second (from /proc), Redis's and this driver's CPU per job, and the mean batch
a job rode in, and the cores the workers used. Then the **baseline**: the same clips encoded by
``ttsq.audio.encode`` (what a worker stores) in a thread pool as wide as the workers' cores, alone, for
``--baseline-s`` right before each workload and again right after it, averaged (on shared cores what
the machine gives moves by the minute: the two bracket the window); and the gateway's streaming
encoders (``ttsq.gateway.encoders``) fed 0.2 s pieces, for their CPU per audio second. The summary
prints, per format, "through the queue / encoder alone" and Opus's CPU per audio second over MP3's.
Medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# Run as a script, this folder is on the path, not the repository: compare.py's helpers come from beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.compare import _cpu_s, _env, _process
from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.engines.base import FRAMES_PER_SECOND
from ttsq.ops.redis_server import RedisServer
from ttsq.testing.standin import speech_frames

#: Workload -> the stored format of its jobs ("pcm" streams, and stores a WAV).
WORKLOADS = {"wav": "wav", "pcm": "wav", "mp3": "mp3", "opus": "ogg"}
#: The sentence every job's text is made of (its own prefix makes it a cache miss).
FILLER = "The quick brown fox jumps over the lazy dog while the band plays on in the park. "


def texts(run: str, count: int, chars: int) -> list[str]:
    """``count`` distinct texts of about ``chars`` characters."""
    body = (FILLER * (chars // len(FILLER) + 2))[:chars]
    return [f"{run} {index}. {body}" for index in range(count)]


class Phase:
    """One workload: the jobs that finished inside its window. The window opens once the workload is in
    its steady state (``warm_jobs`` finished, and ``warm_s`` passed), so the jobs counted and the CPU
    measured over it belong to the same flow, not to a pipeline still filling."""

    def __init__(self, warm_jobs: int) -> None:
        self.lock = threading.Lock()
        self.warm_jobs = warm_jobs
        self.finished = 0
        self.warmed = threading.Event()
        self.window = (float("inf"), float("inf"))
        self.jobs = 0
        self.audio_s = 0.0
        self.batch_sizes: list[int] = []
        self.latencies_s: list[float] = []
        self.first_audio_s: list[float] = []
        self.underruns_s: list[float] = []
        self.errors: list[str] = []

    def done(self, result: dict[str, Any], finished: float) -> None:
        with self.lock:
            self.finished += 1
            if self.finished >= self.warm_jobs:
                self.warmed.set()
            if self.window[0] <= finished <= self.window[1]:
                self.jobs += 1
                self.audio_s += float(result["duration_s"])
                self.batch_sizes.append(int(result["batch_size"]))
                self.latencies_s.append(result["latency_s"])
                if "first_audio_s" in result:
                    self.first_audio_s.append(result["first_audio_s"])
                    self.underruns_s.append(result["underrun_s"])


def one_job(client: Any, workload: str, text: str, timeout: float) -> dict[str, Any]:
    """Submit one job of ``workload`` and wait for it. A stream is read to its end by a player that
    starts at its first piece and plays in real time: its result also says when the first audio came
    (``first_audio_s``, from the submit) and how long that player ran dry (``underrun_s``)."""
    started = time.perf_counter()
    if workload != "pcm":
        result = dict(client.submit(text, format=WORKLOADS[workload]).wait(timeout))
        return {**result, "latency_s": time.perf_counter() - started}
    stream = client.stream(text, timeout=timeout)
    first: float | None = None
    played_until = 0.0  # when the audio received so far runs out, on the player's clock
    underrun = 0.0
    for piece in stream:
        now = time.perf_counter()
        if first is None:
            first, played_until = now, now
        elif now > played_until:
            underrun += now - played_until
            played_until = now
        played_until += len(piece.pcm) / 2 / piece.sample_rate
    if first is None or stream.result is None:
        raise RuntimeError("a stream ended without audio")
    return {
        **stream.result,
        "first_audio_s": first - started,
        "underrun_s": underrun,
        "latency_s": time.perf_counter() - started,
    }


#: Sender threads per ``Client``: redis-py 8 pools hold at most 100 connections, and a waiting sender
#: holds one (a result subscription, a stream read).
THREADS_PER_CLIENT = 32


def drive(
    clients: list[Any], workload: str, args: argparse.Namespace, run: str, pids: list[int], redis_pid: int
) -> dict[str, Any]:
    """Run one workload until it is steady, then for ``args.seconds`` counted; return its figures."""
    warm_jobs = max(1, round(args.rate * args.warm_s)) if args.rate else args.in_flight
    phase = Phase(warm_jobs)
    pool = iter(texts(run, 1_000_000, args.chars))
    lock = threading.Lock()
    stop = threading.Event()
    turns = iter(range(1 << 62))

    def job() -> None:
        with lock:
            client, text = clients[next(turns) % len(clients)], next(pool)
        try:
            result = one_job(client, workload, text, args.timeout)
        except Exception as exc:
            with phase.lock:
                phase.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            return
        phase.done(result, time.perf_counter())

    def sender() -> None:
        while not stop.is_set():
            job()

    def cpu() -> tuple[float, float, float]:
        return sum(_cpu_s(pid) for pid in pids), _cpu_s(redis_pid), time.process_time()

    started = time.perf_counter()
    if args.rate:
        threads = _open_loop(job, args.rate, stop)
    else:
        threads = [threading.Thread(target=sender, daemon=True) for _ in range(args.in_flight)]
        for thread in threads:
            thread.start()
    _sleep_until(started + args.warm_s)
    if not phase.warmed.wait(args.timeout):
        stop.set()
        raise RuntimeError(f"{workload}: not {warm_jobs} jobs done in {args.timeout:.0f} s; {phase.errors[:1]}")
    before = cpu()
    with phase.lock:
        phase.window = (time.perf_counter(), time.perf_counter() + args.seconds)
    _sleep_until(phase.window[1])
    after = cpu()
    stop.set()
    for thread in threads:
        thread.join(args.timeout)
    if phase.errors and not phase.jobs:
        raise RuntimeError(f"{workload}: every job failed, first: {phase.errors[0]}")
    jobs = max(1, phase.jobs)
    workers_cpu = after[0] - before[0]
    return {
        "jobs": phase.jobs,
        # Failed jobs are counted and shown, not hidden: a failure under load is a finding.
        "errors": len(phase.errors),
        "first_error": phase.errors[0] if phase.errors else None,
        "jobs_per_s": phase.jobs / args.seconds / args.workers,
        "audio_s_per_s": phase.audio_s / args.seconds / args.workers,
        "audio_s_per_job": phase.audio_s / jobs,
        "worker_cpu_ms_per_job": workers_cpu * 1000 / jobs,
        # How much of the machine the workers got: on shared cores, the share the run had.
        "worker_cores_used": workers_cpu / args.seconds,
        "worker_cpu_ms_per_audio_s": workers_cpu * 1000 / max(phase.audio_s, 1e-9),
        "redis_cpu_ms_per_job": (after[1] - before[1]) * 1000 / jobs,
        "driver_cpu_ms_per_job": (after[2] - before[2]) * 1000 / jobs,
        "mean_batch": statistics.fmean(phase.batch_sizes) if phase.batch_sizes else 0.0,
        # Submit to result (a stream: to its end), of the jobs counted.
        "latency_p50_ms": 1000 * _quantile(phase.latencies_s, 0.5),
        "latency_p95_ms": 1000 * _quantile(phase.latencies_s, 0.95),
        **(_stream_figures(phase) if phase.first_audio_s else {}),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _stream_figures(phase: Phase) -> dict[str, float]:
    """First audio p50/p95 (ms, from the submit) and underruns of the streams counted."""
    return {
        "first_audio_p50_ms": 1000 * _quantile(phase.first_audio_s, 0.5),
        "first_audio_p95_ms": 1000 * _quantile(phase.first_audio_s, 0.95),
        "streams_with_underrun": float(sum(1 for u in phase.underruns_s if u > 0)),
        "underrun_s_per_stream": statistics.fmean(phase.underruns_s),
    }


def _sleep_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _open_loop(job: Callable[[], None], rate: float, stop: threading.Event) -> list[threading.Thread]:
    """Poisson arrivals at ``rate`` jobs/s until ``stop``; each job on its own thread."""
    import random

    def arrivals() -> None:
        rng = random.Random(7)
        at = time.perf_counter()
        while not stop.is_set():
            _sleep_until(at)
            threading.Thread(target=job, daemon=True).start()
            at += rng.expovariate(rate)

    thread = threading.Thread(target=arrivals, daemon=True)
    thread.start()
    return [thread]


def encoder_alone(
    audio_format: str, clip_s: float, seconds: float, threads: int, cores: set[int] | None = None
) -> dict[str, float]:
    """``ttsq.audio.encode`` of stand-in clips of ``clip_s`` seconds on ``threads`` threads (each pinned
    to ``cores`` when given: the workers' own), alone: audio seconds encoded per second, and CPU
    milliseconds per audio second."""
    from ttsq.audio import encode
    from ttsq.testing.standin import SAMPLE_RATE, speech_like

    clips = [speech_like(clip_s, seed=seed) for seed in range(threads * 2)]
    done = [0]
    lock = threading.Lock()
    until = time.perf_counter() + seconds

    def encoder(index: int) -> None:
        if cores:
            os.sched_setaffinity(0, cores)  # this thread only (Linux): the pool's threads are fresh
        while time.perf_counter() < until:
            encode(clips[index % len(clips)], SAMPLE_RATE, audio_format)
            with lock:
                done[0] += 1

    cpu, wall = time.process_time(), time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(encoder, range(threads)))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    audio_s = done[0] * clip_s
    return {"audio_s_per_s": audio_s / wall, "cpu_ms_per_audio_s": cpu * 1000 / audio_s, "cores_used": cpu / wall}


def bracketed(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The encoder alone just before a workload and just after it, averaged: on cores that other work
    shares, what the machine gave moves by the minute, and the two together bracket the window."""
    return {key: (before[key] + after[key]) / 2 for key in before}


def streamed_encoder_cpu(response_format: str, clip_s: float, repeats: int) -> float:
    """CPU milliseconds per audio second of the gateway's streaming encoder, fed 0.2 s pieces."""
    from ttsq.audio import pcm16
    from ttsq.gateway.encoders import encoder
    from ttsq.testing.standin import SAMPLE_RATE, speech_like

    pcm = pcm16(speech_like(clip_s))
    step = int(SAMPLE_RATE * 0.2) * 2
    cpu = time.process_time()
    for _ in range(repeats):
        stream = encoder(response_format, SAMPLE_RATE)
        for start in range(0, len(pcm), step):
            stream.feed(pcm[start : start + step])
        stream.finish()
    return (time.process_time() - cpu) * 1000 / (clip_s * repeats)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ttsq.client import Client
    from ttsq.engines.qwen.engine import usable_cores
    from ttsq.records.connection import connect

    cores = usable_cores()
    pinned = {int(core) for core in args.worker_cores.split(",")} if args.worker_cores else None
    if pinned:
        # The workers on their cores, this driver and Redis (started below, inheriting it) on the rest:
        # the encoder alone then runs on exactly the cores the workers had.
        rest = set(os.sched_getaffinity(0)) - pinned
        if not rest or not pinned <= set(os.sched_getaffinity(0)):
            raise SystemExit(f"--worker-cores {args.worker_cores}: must leave this process at least one other core")
        os.sched_setaffinity(0, rest)
        cores = len(pinned)
    a_us = round((args.a_us if args.a_us is not None else Settings().standin_a_us) / args.speed)
    b_us = round((args.b_us if args.b_us is not None else Settings().standin_b_us) / args.speed)
    workloads = [w for w in args.workloads.split(",") if w]
    for workload in workloads:
        if workload not in WORKLOADS:
            raise SystemExit(f"unknown workload {workload!r}: expected some of {', '.join(WORKLOADS)}")
    rounds: list[dict[str, Any]] = []
    baselines: list[dict[str, Any]] = []
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-fleet-")))
        redis = RedisServer().start()
        stack.callback(redis.stop)
        assert redis.process is not None
        settings = Settings(
            broker_url=f"{redis.url}/0",
            result_backend=f"{redis.url}/1",
            cache_url=f"{redis.url}/2",
            storage_url=str(folder / "audio"),
            engine="standin",
            standin_a_us=a_us,
            standin_b_us=b_us,
            max_batch=args.max_batch,
            queue="fleet",
            metrics_port=0,
            log_level="WARNING",
        )
        if args.encode_threads is not None:
            settings = settings.replace(encode_threads=args.encode_threads)
        taskset = ["taskset", "-c", args.worker_cores] if pinned else []
        pids = [
            stack.enter_context(
                _process(
                    [*taskset, sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"fleet{n}@bench"],
                    _env(settings),
                    folder / f"worker{n}.log",
                )
            ).pid
            for n in range(args.workers)
        ]
        cache = connect(settings.cache_url)
        deadline = time.monotonic() + 120
        while not cache.exists(FLEET_PREFIX + settings.queue):
            if time.monotonic() > deadline:
                raise SystemExit(f"no worker started; logs in {folder}")
            time.sleep(0.2)
        cache.close()
        time.sleep(1.0)  # every worker of --workers up, not only the first
        clients = [Client(settings) for _ in range(-(-max(args.in_flight, 1) // THREADS_PER_CLIENT))]
        for client in clients:
            stack.callback(client.close)
        clients[0].submit("Warm up, please.").wait(args.timeout)
        print(
            f"fleet: {args.workers} worker(s), stand-in a={a_us} us b={b_us} us per audio-s "
            f"(published H100 / {args.speed:g}), max batch {args.max_batch}, "
            + (f"Poisson {args.rate:g} jobs/s" if args.rate else f"closed loop at {args.in_flight}")
            + f", {args.seconds:g} s windows, {cores} cores",
            flush=True,
        )
        # Each job's audio, for the encoder alone: what the stand-in makes of texts this long.
        clip_s = speech_frames(texts("r", 1, args.chars)[0]) / FRAMES_PER_SECOND
        header = f"{'round':>5} {'workload':>8} {'jobs/s':>7} {'audio-s/s':>9} {'batch':>6} {'cpu ms/job':>10} "
        print(
            header
            + f"{'cpu ms/audio-s':>14} {'redis ms/job':>12} {'driver ms/job':>13} {'cores':>5} {'latency p50/p95 ms'}",
            flush=True,
        )
        for number in range(args.rounds):
            figures: dict[str, Any] = {}
            order = workloads[number % len(workloads) :] + workloads[: number % len(workloads)]
            baseline: dict[str, Any] = {}
            for workload in order:
                encoded = workload != "pcm"
                if encoded:  # the encoder alone right before the workload, and right after it (below)
                    alone = encoder_alone(WORKLOADS[workload], clip_s, args.baseline_s, cores, pinned)
                row = drive(clients, workload, args, f"r{number}-{workload}-{os.getpid()}", pids, redis.process.pid)
                figures[workload] = row
                if encoded:
                    after = encoder_alone(WORKLOADS[workload], clip_s, args.baseline_s, cores, pinned)
                    baseline[workload] = bracketed(alone, after)
                print(
                    f"{number + 1:>5} {workload:>8} {row['jobs_per_s']:>7.1f} {row['audio_s_per_s']:>9.1f} "
                    f"{row['mean_batch']:>6.1f} {row['worker_cpu_ms_per_job']:>10.1f} "
                    f"{row['worker_cpu_ms_per_audio_s']:>14.2f} {row['redis_cpu_ms_per_job']:>12.2f} "
                    f"{row['driver_cpu_ms_per_job']:>13.2f} {row['worker_cores_used']:>5.2f} "
                    f"{row['latency_p50_ms']:>6.0f}/{row['latency_p95_ms']:<6.0f}"
                    + (
                        f"  first audio p50/p95 {row['first_audio_p50_ms']:.0f}/{row['first_audio_p95_ms']:.0f} ms, "
                        f"underruns in {row['streams_with_underrun']:.0f} of {row['jobs']} streams"
                        if "first_audio_p50_ms" in row
                        else ""
                    )
                    + (f"  {row['errors']} failed, first: {row['first_error']}" if row["errors"] else ""),
                    flush=True,
                )
                time.sleep(args.settle_s)  # the last window's stragglers finish before the next starts
            rounds.append(figures)
            baseline["streamed"] = {
                fmt: {"cpu_ms_per_audio_s": streamed_encoder_cpu(fmt, clip_s, args.stream_repeats)}
                for fmt in ("mp3", "opus")
            }
            baselines.append(baseline)
            print(
                f"{number + 1:>5} encoder alone on {cores} threads, before and after each workload ("
                + ", ".join(
                    f"{name} {each['audio_s_per_s']:.0f} audio-s/s, {each['cpu_ms_per_audio_s']:.2f} ms/audio-s, "
                    f"{each['cores_used']:.2f} cores"
                    for name, each in baseline.items()
                    if name != "streamed"
                )
                + "); streamed: "
                + ", ".join(
                    f"{fmt} {each['cpu_ms_per_audio_s']:.2f} ms/audio-s" for fmt, each in baseline["streamed"].items()
                ),
                flush=True,
            )
    return summarize(args, workloads, rounds, baselines, a_us=a_us, b_us=b_us, cores=cores)


def summarize(
    args: argparse.Namespace,
    workloads: list[str],
    rounds: list[dict[str, Any]],
    baselines: list[dict[str, Any]],
    **config: Any,
) -> dict[str, Any]:
    def median(values: list[float]) -> float:
        return statistics.median(values) if values else float("nan")

    summary: dict[str, Any] = {}
    for workload in workloads:
        rows = [r[workload] for r in rounds]
        entry: dict[str, Any] = {
            key: median([row[key] for row in rows]) for key in rows[0] if key not in ("errors", "first_error")
        }
        entry["errors"] = sum(row["errors"] for row in rows)
        if workload != "pcm":
            # Per round: through the queue over the same encoder alone in the same round.
            entry["over_encoder_alone"] = median(
                [
                    r[workload]["audio_s_per_s"] / b[workload]["audio_s_per_s"]
                    for r, b in zip(rounds, baselines, strict=True)
                ]
            )
            entry["encoder_alone_audio_s_per_s"] = median([b[workload]["audio_s_per_s"] for b in baselines])
            entry["encoder_alone_cpu_ms_per_audio_s"] = median([b[workload]["cpu_ms_per_audio_s"] for b in baselines])
            # The same ratio in CPU: what the encoder alone spends on an audio second over what the worker
            # spends on it, all told. Where both are bound by the same cores it is the ratio the machine
            # allows, and unlike wall time it hardly moves when other work shares the machine.
            entry["over_encoder_alone_cpu"] = median(
                [
                    b[workload]["cpu_ms_per_audio_s"] / r[workload]["worker_cpu_ms_per_audio_s"]
                    for r, b in zip(rounds, baselines, strict=True)
                ]
            )
        summary[workload] = entry
    ratios: dict[str, float] = {}
    if "mp3" in workloads and "opus" in workloads:
        ratios["opus_over_mp3_cpu_stored"] = median(
            [b["opus"]["cpu_ms_per_audio_s"] / b["mp3"]["cpu_ms_per_audio_s"] for b in baselines]
        )
        ratios["opus_over_mp3_cpu_in_worker"] = median(
            [r["opus"]["worker_cpu_ms_per_audio_s"] / r["mp3"]["worker_cpu_ms_per_audio_s"] for r in rounds]
        )
    ratios["opus_over_mp3_cpu_streamed"] = median(
        [b["streamed"]["opus"]["cpu_ms_per_audio_s"] / b["streamed"]["mp3"]["cpu_ms_per_audio_s"] for b in baselines]
    )
    if "mp3" in workloads and "wav" in workloads:
        ratios["mp3_batch_over_wav_batch"] = median([r["mp3"]["mean_batch"] / r["wav"]["mean_batch"] for r in rounds])
    print(f"\nmedians over {len(rounds)} round(s), per worker:")
    for workload, entry in summary.items():
        line = f"{workload:>8}: {entry['audio_s_per_s']:7.1f} audio-s/s, {entry['jobs_per_s']:6.1f} jobs/s, "
        line += f"batch {entry['mean_batch']:5.1f}, worker CPU {entry['worker_cpu_ms_per_job']:6.1f} ms/job, "
        line += f"latency p50/p95 {entry['latency_p50_ms']:.0f}/{entry['latency_p95_ms']:.0f} ms"
        if "first_audio_p50_ms" in entry:
            line += (
                f"; first audio p50/p95 {entry['first_audio_p50_ms']:.0f}/{entry['first_audio_p95_ms']:.0f} ms, "
                f"{entry['underrun_s_per_stream']:.2f} s of underrun per stream"
            )
        if "over_encoder_alone" in entry:
            line += (
                f"; encoder alone {entry['encoder_alone_audio_s_per_s']:.0f} audio-s/s, "
                f"through the queue / encoder alone {entry['over_encoder_alone']:.2f} "
                f"(in CPU per audio-s {entry['over_encoder_alone_cpu']:.2f})"
            )
        print(line)
    for name, value in ratios.items():
        print(f"{name}: {value:.2f}")
    return {
        "ttsq_fleet": 1,
        "config": {
            **config,
            "workers": args.workers,
            "max_batch": args.max_batch,
            "in_flight": None if args.rate else args.in_flight,
            "rate": args.rate,
            "seconds": args.seconds,
            "speed": args.speed,
            "chars": args.chars,
            "rounds": args.rounds,
            "load_average": os.getloadavg(),
        },
        "rounds": rounds,
        "baselines": baselines,
        "summary": summary,
        "ratios": ratios,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=128, help="closed loop: jobs in flight")
    parser.add_argument("--rate", type=float, default=None, help="open loop: Poisson arrivals, jobs/s in all")
    parser.add_argument("--seconds", type=float, default=15.0, help="the counted window of each workload")
    parser.add_argument(
        "--warm-s", type=float, default=3.0, help="at least this long before each window (and --in-flight jobs done)"
    )
    parser.add_argument("--settle-s", type=float, default=2.0, help="pause between workloads")
    parser.add_argument("--baseline-s", type=float, default=5.0, help="seconds of each encoder alone")
    parser.add_argument("--stream-repeats", type=int, default=3, help="clips through each streaming encoder")
    parser.add_argument("--workloads", default="wav,pcm,mp3,opus")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--chars", type=int, default=100, help="characters per job (14 per second of audio)")
    parser.add_argument("--speed", type=float, default=10.0, help="the device this many times the published H100")
    parser.add_argument("--a-us", type=int, default=None, help="stand-in a before --speed (default: published)")
    parser.add_argument("--b-us", type=int, default=None, help="stand-in b before --speed (default: published)")
    parser.add_argument("--encode-threads", type=int, default=None, help="TTSQ_ENCODE_THREADS of the workers")
    parser.add_argument(
        "--worker-cores",
        default="",
        help="pin the workers to these cores (e.g. 1) and this driver and Redis to the others; "
        "the encoder alone then runs on the workers' cores",
    )
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--tiny", action="store_true", help="the smoke test: a few jobs, figures meaningless")
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args(argv)
    if args.tiny:
        args.max_batch, args.in_flight, args.seconds, args.warm_s, args.settle_s = 4, 4, 2.0, 0.5, 0.5
        args.baseline_s, args.stream_repeats, args.rounds, args.chars = 0.3, 1, 1, 40
    figures = run(args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
