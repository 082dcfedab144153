"""Soak: many distinct jobs through two real ``ttsq worker`` processes; memory sampled as they run.

    python benchmarks/soak.py                 # 10,000 jobs, the espeak engine, cache misses only
    python benchmarks/soak.py --jobs 300 --json
    python benchmarks/soak.py --engine qwen --jobs 2000   # a tiny random-weight checkpoint on the CPU

It starts a private redis-server and two workers (espeak by default, a local storage folder), submits every
job through ``ttsq.client.Client`` with a distinct text (so the cache never answers), waits for all
of them, and checks that every job completed and that none ran twice (one synthesis and one stored
object per job). While it runs it samples each worker's resident memory (VmRSS) and prints it
against the jobs done so far: the figure to watch is the growth after warm-up, which stays flat
when nothing leaks. Nothing here asserts on time.

``--engine qwen`` or ``qwen-fast`` soaks a worker whose engine computes on the CPU, the one case where
the worker leaves glibc's mmap threshold adaptive (``workers/celery_worker.py``): every job is
``--frames`` codec frames of a tiny random-weight checkpoint built for the run (or ``--model``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer
from ttsq.records.owner import RedisOwner
from ttsq.records.stats import FLUSH_INTERVAL_S

WORDS = (
    "amber",
    "river",
    "quiet",
    "signal",
    "harbor",
    "lantern",
    "meadow",
    "copper",
    "violet",
    "summit",
    "orbit",
    "willow",
    "canyon",
    "ember",
    "falcon",
    "glacier",
)


def text_for(i: int) -> str:
    """A distinct, speakable sentence per job (distinct texts: every job is a cache miss)."""
    a, b, c = WORDS[i % 16], WORDS[(i // 16) % 16], WORDS[(i // 256) % 16]
    return f"Soak sentence {i}: the {a} {b} near the {c}."


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def start_worker(settings: Settings, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    env.update({f"TTSQ_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(settings)})
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"{name}@soak"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs to run (default 10000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--max-batch", type=int, default=8, help="TTSQ_MAX_BATCH of each worker")
    parser.add_argument("--samples", type=int, default=10, help="memory samples to print over the run")
    parser.add_argument("--timeout", type=float, default=3600, help="give up after this many seconds")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the audio and worker logs (a temp folder)")
    parser.add_argument("--engine", choices=("espeak", "qwen", "qwen-fast"), default="espeak")
    parser.add_argument("--model", help="qwen: an existing VoiceDesign checkpoint folder (default: a tiny one)")
    parser.add_argument("--frames", type=int, default=8, help="qwen: codec frames per job (default 8)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ttsq-soak-"))
    server = RedisServer().start()
    url = server.url
    settings = Settings(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        cache_url=f"{url}/2",
        storage_url=str(work / "audio"),
        queue="soak",
        max_batch=args.max_batch,
        log_level="WARNING",
        metrics_port=0,
        engine=args.engine,
    )  # two workers on one host: no metrics port
    submit_options: dict[str, Any] = {}
    if args.engine != "espeak":
        from ttsq.testing.qwen_checkpoint import build

        model = Path(args.model) if args.model else build(work / "tiny", "voice_design")
        settings = settings.replace(qwen_model=str(model), qwen_device="cpu", qwen_max_frames=max(256, args.frames))
        submit_options["max_new_tokens"] = args.frames
    workers: list[subprocess.Popen[bytes]] = []
    try:
        for n in range(args.workers):
            workers.append(start_worker(settings, f"w{n + 1}", work / f"w{n + 1}.log"))
        redis = RedisOwner(settings, role="soak")
        cache = redis.cache
        deadline = time.monotonic() + (120 if args.engine == "espeak" else 600)
        while not cache.exists(FLEET_PREFIX + settings.queue):
            if time.monotonic() > deadline or any(w.poll() is not None for w in workers):
                raise SystemExit(f"workers did not start; see {work}")
            time.sleep(0.1)
        time.sleep(1.0)  # every worker has loaded and announced by now; the first RSS is after warm-up
        samples: list[dict[str, Any]] = []
        stop = threading.Event()
        started, started_at = time.monotonic(), time.time()

        def synthesized_so_far() -> int:
            # The fleet's per-minute counters (``ttsq stats``), over every minute since the soak began.
            return int(redis.stats.window(int((time.time() - started_at) // 60) + 2)["synthesized"])

        def sample() -> None:
            done = synthesized_so_far()
            samples.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "jobs_done": done,
                    "rss_kib": [rss_kib(w.pid) for w in workers],
                }
            )

        def sampler() -> None:
            step = max(1, args.jobs // args.samples)
            next_mark = step
            while not stop.wait(0.5):
                if synthesized_so_far() >= next_mark:
                    sample()
                    next_mark += step

        sample()
        thread = threading.Thread(target=sampler, daemon=True)
        thread.start()
        client = Client(settings)
        jobs = [client.submit(text_for(i), **submit_options) for i in range(args.jobs)]
        submitted_s = time.monotonic() - started
        give_up = started + args.timeout
        keys = set()
        for job in jobs:
            keys.add(job.wait(timeout=max(1.0, give_up - time.monotonic()))["key"])
        duration = time.monotonic() - started
        # Workers write their minute counters once a second (``FLUSH_INTERVAL_S``): wait for the last flush.
        flushed_by = time.monotonic() + 3 * FLUSH_INTERVAL_S + 2
        while synthesized_so_far() < args.jobs and time.monotonic() < flushed_by:
            time.sleep(0.1)
        stop.set()
        thread.join()
        sample()

        synthesized = synthesized_so_far()
        stored = sum(1 for path in (work / "audio").rglob("*.wav"))
        first, last = samples[0]["rss_kib"], samples[-1]["rss_kib"]
        warm = next((s for s in samples if s["jobs_done"] >= args.jobs * 0.2), samples[0])["rss_kib"]
        summary = {
            "engine": args.engine,
            "jobs": args.jobs,
            "completed": len(keys),
            "synthesized": synthesized,
            "objects_stored": stored,
            "workers": args.workers,
            "max_batch": args.max_batch,
            "duration_s": round(duration, 1),
            "submit_s": round(submitted_s, 1),
            "jobs_per_s": round(args.jobs / duration, 1),
            "rss_start_kib": first,
            "rss_at_20pct_kib": warm,
            "rss_end_kib": last,
            "rss_growth_after_20pct_kib": [e - w for e, w in zip(last, warm, strict=True)],
            "samples": samples,
            "workers_alive": sum(1 for w in workers if w.poll() is None),
            "ok": len(keys) == synthesized == stored == args.jobs and all(w.poll() is None for w in workers),
        }
        if args.json:
            print(json.dumps(summary))
        else:
            print(
                f"jobs {args.jobs}: completed {len(keys)}, synthesized {synthesized}, "
                f"stored {stored} -> {'OK: all done, none twice' if summary['ok'] else 'MISMATCH'}"
            )
            print(
                f"duration {duration:.1f}s ({summary['jobs_per_s']} jobs/s) with {args.workers} {args.engine} workers, "
                f"max_batch {args.max_batch}; submitting took {submitted_s:.1f}s"
            )
            print("t_s      jobs_done  " + "  ".join(f"w{n + 1}_rss_MiB" for n in range(args.workers)))
            for s in samples:
                print(f"{s['t_s']:<8} {s['jobs_done']:<10} " + "  ".join(f"{r / 1024:>10.1f}" for r in s["rss_kib"]))
            for n in range(args.workers):
                print(
                    f"w{n + 1}: RSS start {first[n] / 1024:.1f} MiB, at 20% {warm[n] / 1024:.1f} MiB, "
                    f"end {last[n] / 1024:.1f} MiB (growth after 20%: {(last[n] - warm[n]) / 1024:+.1f} MiB)"
                )
        client.close()
        return 0 if summary["ok"] else 1
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
        for worker in workers:
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
        server.stop()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
