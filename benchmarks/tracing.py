"""What traces cost: ``ttsq bench`` with tracing off and on, side by side, in one run.

    python benchmarks/tracing.py [--pairs 8] [--jobs 300] [--warmup 16] [--concurrency N] [--embedded]
        [--json out.json]

Starts an OTLP/HTTP receiver (a process of its own that accepts every export and drops it, counting the
requests and bytes) and a private Redis, then runs the same closed-loop bench (espeak unless
``--engine``; a qwen engine on CPU with a tiny checkpoint built for the run unless ``--model``, at
most ``--frames`` codec frames a job; every job a cache miss, the same seed within a pair) ``--pairs``
times off and on, each against a ``ttsq worker`` process started for the run (local storage): a
deployment's shape, the
producer's spans in the bench's process and the worker's in the worker's. ``--embedded`` runs
``ttsq bench --embedded`` instead: producer and worker in one process, every span of a job made and
exported there. The order alternates between pairs (off-on, on-off, ...) so that a machine that slows
down or speeds up during the run weighs on both sides alike. On: ``OTEL_EXPORTER_OTLP_ENDPOINT`` points
at the receiver for every process of the run, with the SDK's default batch export; off: no ``OTEL_*``
at all. CPU seconds are those of the run's processes (worker and bench), start-up included.

Printed: each pair's jobs/s off and on and their ratio, the CPU milliseconds per job of each, and the
median of the paired ratios (the figure: a pair shares the machine's state of the moment) beside the
ratio of the medians. ``--tiny`` is the CI smoke test: one pair of a few jobs, figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import redis

from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer, free_port

# Run as a script, this folder is on the path, not the repository: compare.py's process helpers are
# imported from beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.compare import _env, _process, _wait_for_port


class _Receiver(BaseHTTPRequestHandler):
    """Accepts an OTLP/HTTP export and drops it; its server counts the requests and bytes."""

    def do_POST(self) -> None:
        size = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(size)
        server: Any = self.server
        with server.lock:
            server.requests += 1
            server.bytes += size
            server.counts.write_text(json.dumps({"requests": server.requests, "bytes": server.bytes}))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_: object) -> None:
        pass


def receive(port: int, counts: Path) -> None:
    """Run the receiver until killed, its counts in ``counts`` after every export."""
    server: Any = ThreadingHTTPServer(("127.0.0.1", port), _Receiver)
    server.requests, server.bytes, server.counts, server.lock = 0, 0, counts, threading.Lock()
    server.serve_forever()


@contextmanager
def receiver(folder: Path) -> Iterator[tuple[str, Path]]:
    """A receiver process on a free loopback port: its endpoint, and the file of its counts."""
    port, counts = free_port(), folder / "receiver.json"
    process = subprocess.Popen([sys.executable, __file__, "--receive", str(port), "--counts", str(counts)])
    try:
        _wait_for_port(port, "the OTLP receiver", process)
        yield f"http://127.0.0.1:{port}", counts
    finally:
        process.terminate()
        process.wait(timeout=10)


def bench(args: argparse.Namespace, seed: int, endpoint: str | None, folder: Path, redis_url: str) -> dict[str, Any]:
    """One ``ttsq bench`` run (and its worker, unless ``--embedded``), processes of their own: the
    bench's report, with their CPU seconds."""
    side = "on" if endpoint else "off"
    settings = Settings().replace(
        broker_url=f"{redis_url}/0",
        result_backend=f"{redis_url}/1",
        cache_url=f"{redis_url}/2",
        storage_url=str(folder / "audio"),
        queue=f"tracing-{seed}-{side}",
        engine=args.engine,
        max_batch=args.max_batch,
        metrics_port=0,
    )
    if args.engine.startswith("qwen"):
        settings = settings.replace(qwen_model=str(args.model), qwen_device="cpu", qwen_max_frames=args.frames)
    env = {k: v for k, v in _env(settings).items() if not k.startswith("OTEL_")}
    if endpoint is not None:
        env.update(OTEL_EXPORTER_OTLP_ENDPOINT=endpoint)
        env.update(dict(option.split("=", 1) for option in args.otel))
    out = folder / f"seed{seed}-{side}.json"
    command = [sys.executable, "-m", "ttsq.cli.main", "bench", "-n", str(args.jobs), "--warmup", str(args.warmup)]
    command += ["--seed", str(seed), "--json", str(out)]
    if args.concurrency:
        command += ["--concurrency", str(args.concurrency)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with ExitStack() as stack:
        if args.embedded:
            command += ["--embedded", "--engine", args.engine, "--max-batch", str(args.max_batch)]
        else:
            worker = [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"w@tracing-{seed}-{side}"]
            stack.enter_context(_process(worker, {**env, "OTEL_SERVICE_NAME": "ttsq-worker"}, folder / "worker.log"))
            _wait_for_worker(settings, folder)
        producer = {k: v for k, v in env.items() if not (args.worker_only and k.startswith("OTEL_"))}
        done = subprocess.run(
            command, env={**producer, "OTEL_SERVICE_NAME": "ttsq-bench"}, capture_output=True, timeout=args.timeout
        )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"ttsq bench failed ({done.returncode}): {done.stderr.decode()[-3000:]}")
    report = json.loads(out.read_text())
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"jobs_per_s": report["throughput"]["jobs_per_s"], "cpu_s": cpu_s, "jobs": args.jobs + args.warmup}


def _wait_for_worker(settings: Settings, folder: Path) -> None:
    cache = redis.Redis.from_url(settings.cache_url)
    try:
        deadline = time.monotonic() + 300
        while not cache.exists(FLEET_PREFIX + settings.queue):  # the worker announced itself: it is ready
            if time.monotonic() > deadline:
                raise SystemExit(f"the worker did not start; see {folder / 'worker.log'}")
            time.sleep(0.1)
    finally:
        cache.close()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    pairs: list[dict[str, Any]] = []
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-tracing-"))
        endpoint, counts = stack.enter_context(receiver(Path(tmp)))
        server = RedisServer().start()
        stack.callback(server.stop)
        redis_url = server.url
        if args.engine.startswith("qwen") and args.model is None:
            from ttsq.testing.qwen_checkpoint import build

            args.model = build(Path(tmp) / "tiny", "voice_design")
        for n in range(args.pairs):
            seed = args.seed + n
            runs: dict[str, dict[str, Any]] = {}
            for side in ("off", "on") if n % 2 == 0 else ("on", "off"):
                before = _exports(counts)
                runs[side] = bench(args, seed, endpoint if side == "on" else None, Path(tmp), redis_url)
                # The run's processes flushed at exit: what reached the receiver since is the run's.
                runs[side]["exports"] = _exports(counts) - before
            pair = {
                "seed": seed,
                "off": runs["off"],
                "on": runs["on"],
                "ratio": runs["on"]["jobs_per_s"] / runs["off"]["jobs_per_s"],
            }
            pairs.append(pair)
            print(_row(pair), flush=True)
        exported = json.loads(counts.read_text()) if counts.exists() else {"requests": 0, "bytes": 0}
    off = [p["off"]["jobs_per_s"] for p in pairs]
    on = [p["on"]["jobs_per_s"] for p in pairs]
    cpu = {side: sum(p[side]["cpu_s"] for p in pairs) / sum(p[side]["jobs"] for p in pairs) for side in ("off", "on")}
    return {
        "embedded": args.embedded,
        "worker_only": args.worker_only,
        "engine": args.engine,
        "jobs": args.jobs,
        "warmup": args.warmup,
        "max_batch": args.max_batch,
        "pairs": pairs,
        "median_paired_ratio": statistics.median(p["ratio"] for p in pairs),
        "ratio_of_medians": statistics.median(on) / statistics.median(off),
        "jobs_per_s_median": {"off": statistics.median(off), "on": statistics.median(on)},
        "cpu_ms_per_job": {side: 1000 * value for side, value in cpu.items()},
        "exported": exported,
    }


def _exports(counts: Path) -> int:
    """The exports the receiver has taken so far."""
    return int(json.loads(counts.read_text())["requests"]) if counts.exists() else 0


def _row(pair: dict[str, Any]) -> str:
    off, on = pair["off"], pair["on"]
    return (
        f"seed {pair['seed']:>3}: off {off['jobs_per_s']:6.2f} jobs/s, on {on['jobs_per_s']:6.2f} jobs/s, "
        f"on/off {pair['ratio']:.3f}; CPU ms/job off {1000 * off['cpu_s'] / off['jobs']:.1f}, "
        f"on {1000 * on['cpu_s'] / on['jobs']:.1f}"
    )


def main() -> None:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument(
        "--concurrency", type=int, help="jobs in flight (ttsq bench's default: twice the max batch, the worker's slots)"
    )
    parser.add_argument("--engine", default="espeak")
    parser.add_argument("--model", type=Path, help="a qwen engine's checkpoint (default: a tiny one built for the run)")
    parser.add_argument("--frames", type=int, default=64, help="a qwen engine's most codec frames a job")
    parser.add_argument("--embedded", action="store_true", help="producer and worker in one process")
    parser.add_argument("--worker-only", action="store_true", help="tracing on in the worker alone, not the producer")
    parser.add_argument(
        "--otel", action="append", default=[], metavar="NAME=VALUE", help="another OTEL_* variable for the on side"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tiny", action="store_true", help="CI smoke test: one pair of a few jobs")
    parser.add_argument("--receive", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--counts", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.receive:
        receive(args.receive, args.counts)
        return
    if args.tiny:
        args.pairs, args.jobs, args.warmup, args.max_batch = 1, 6, 0, 2
    figures = measure(args)
    print(
        f"tracing on / off: {figures['median_paired_ratio']:.3f} by the median of {len(figures['pairs'])} paired "
        f"ratios, {figures['ratio_of_medians']:.3f} by the medians ({figures['jobs_per_s_median']['on']:.2f} / "
        f"{figures['jobs_per_s_median']['off']:.2f} jobs/s); CPU ms per job on {figures['cpu_ms_per_job']['on']:.2f}, "
        f"off {figures['cpu_ms_per_job']['off']:.2f}; {figures['exported']['requests']} exports, "
        f"{figures['exported']['bytes']} bytes"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
