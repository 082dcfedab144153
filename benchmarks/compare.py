"""ttsq against its baselines, in one run, on one machine, interleaved.

    python benchmarks/compare.py [--jobs 200] [--concurrency 16] [--rounds 3] [--storage local|s3] [--json out.json]

Starts a private Redis, the storage (a local folder, or moto's S3 server with ``--storage s3``) and
three worker processes on their own queues, all up for the whole run:

- **ttsq, batching on**: ``ttsq worker`` (max batch ``--max-batch``, threads pool, twice the batch);
- **ttsq, batching off**: ``ttsq worker`` with max batch 1;
- **bare Celery task**: ``benchmarks/bare_task.py``, the same engine called once per message, audio
  in the result, no cache, batching or storage (``celery worker -P solo``, Celery's defaults).

Each round runs the same closed-loop bench (every job a cache miss) against the three in a rotated
order, then times a first submit against a cached submit of the same requests through
``Client.submit``, then measures each ttsq configuration one job at a time to break a job's time down
by stage. Ratios are medians of the per-round ratios; the spread across rounds is printed with them.
``--tiny`` is the CI smoke test: the whole path in a few seconds, figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.ops import bench
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer, free_port, parent_death_signal

ROOT = Path(__file__).resolve().parent.parent
BUCKET = "ttsq-bench"
#: Codec frames per job in ``--tiny`` with a qwen engine (about 2 s of audio).
TINY_QWEN_FRAMES = 24


@dataclass(frozen=True)
class Config:
    """One system under test."""

    name: str
    label: str
    queue: str


BATCHED = Config("batched", "ttsq, batching on", "bench-batched")
UNBATCHED = Config("unbatched", "ttsq, batching off", "bench-unbatched")
BARE = Config("bare", "bare Celery task", "bench-bare")
#: Ratios reported: name -> (numerator, denominator).
RATIOS = {
    "batching_on_over_off": (BATCHED.name, UNBATCHED.name),
    "ttsq_over_bare": (BATCHED.name, BARE.name),
    "ttsq_unbatched_over_bare": (UNBATCHED.name, BARE.name),
}


class BareTarget:
    """Jobs sent by name to the bare task, results awaited like any Celery user would."""

    def __init__(self, broker_url: str, result_backend: str, queue: str) -> None:
        from celery import Celery

        self.app = Celery("bare-producer", broker=broker_url, backend=result_backend, set_as_current=False)
        self.queue = queue

    def run_one(self, fields: dict[str, Any], timeout_s: float) -> tuple[Mapping[str, Any], dict[str, float]]:
        """Send one job and wait for its audio."""
        kwargs = {name: fields[name] for name in ("text", "language", "max_new_tokens") if name in fields}
        result = self.app.send_task("bare.synthesize", kwargs=kwargs, queue=self.queue)
        value: Mapping[str, Any] = result.get(timeout=timeout_s)
        return {"duration_s": value["duration_s"], "cached": False}, {}

    def close(self) -> None:
        """Release connections."""
        self.app.close()


def _env(settings: Settings, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    for name, value in vars(settings).items():
        env[f"TTSQ_{name.upper()}"] = str(value)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


@contextmanager
def _process(command: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        # Children die with this process even when it is killed outright, like the embedded Redis.
        process = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=parent_death_signal()
        )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_for_port(port: int, what: str, process: subprocess.Popen[bytes] | None = None, timeout_s: float = 30) -> None:
    """Wait until something listens on loopback ``port`` (``what``, for the error; ``process``: the one
    that should, whose exit ends the wait at once)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline or (process is not None and process.poll() is not None):
                raise RuntimeError(f"{what} did not start") from None
            time.sleep(0.1)


@contextmanager
def _s3_server(folder: Path) -> Iterator[str]:
    port = free_port()
    with _process(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], dict(os.environ), folder / "moto.log"
    ):
        endpoint = f"http://127.0.0.1:{port}"
        _wait_for_port(port, "moto's S3 server")
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=BUCKET)
        yield endpoint


def _wait_ready(target: bench.Target, name: str, corpus: list[bench.Sentence], timeout_s: float = 120.0) -> None:
    """One untimed job per system: proves it consumes, and pays the engine's first call."""
    warm = bench.make_requests(corpus, 1, mode="synthesize", run_id=f"ready-{time.time()}", seed=0, audio_format="wav")[
        0
    ]
    try:
        target.run_one(warm, timeout_s)
    except Exception as exc:
        raise RuntimeError(f"{name} did not answer its first job: {exc}") from exc


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) a process has used so far, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median_spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Start everything, run the interleaved rounds, return the figures."""
    from ttsq.client import Client

    load_before = os.getloadavg()
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-compare-")))
        redis = RedisServer().start()
        stack.callback(redis.stop)
        # From the environment first: an engine's own settings (TTSQ_QWEN_MODEL, ...) reach all three systems.
        base = Settings.from_env(
            broker_url=f"{redis.url}/0",
            result_backend=f"{redis.url}/1",
            cache_url=f"{redis.url}/2",
            engine=args.engine,
            max_wait_ms=args.max_wait_ms,
            log_level=args.log_level,
            storage_url=str(folder / "audio"),
            queue="unused",
            # Two workers on one host would contend for one metrics port; none is scraped.
            metrics_port=0,
        )
        corpus = list(bench.CORPUS)
        if args.tiny and args.engine.startswith("qwen"):
            # Random weights never sample their end token: every job would run to its text's frame cap
            # (60 to 491 frames for this corpus), minutes on a CPU. The smoke test caps each job instead.
            corpus = [replace(s, fields={**s.fields, "max_new_tokens": TINY_QWEN_FRAMES}) for s in corpus]
            if not base.qwen_model:
                from ttsq.testing.qwen_checkpoint import build

                base = base.replace(qwen_model=str(build(folder / "tiny-qwen", "voice_design")))
        if args.storage == "s3":
            os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
            os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
            endpoint = stack.enter_context(_s3_server(folder))
            base = base.replace(storage_url=f"s3://{BUCKET}/bench", s3_endpoint_url=endpoint, s3_region="us-east-1")

        settings = {
            BATCHED.name: base.replace(queue=BATCHED.queue, max_batch=args.max_batch),
            UNBATCHED.name: base.replace(queue=UNBATCHED.queue, max_batch=1),
        }
        pids: dict[str, int] = {}
        for config in (BATCHED, UNBATCHED):
            pids[config.name] = stack.enter_context(
                _process(
                    [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"{config.name}@bench"],
                    _env(settings[config.name]),
                    folder / f"{config.name}.log",
                )
            ).pid
        pids[BARE.name] = stack.enter_context(
            _process(
                [
                    sys.executable,
                    "-m",
                    "celery",
                    "-A",
                    "benchmarks.bare_task",
                    "worker",
                    "-P",
                    "solo",
                    "-Q",
                    BARE.queue,
                    "-n",
                    "bare@bench",
                ],
                _env(base, BARE_BROKER_URL=base.broker_url, BARE_RESULT_BACKEND=base.result_backend),
                folder / "bare.log",
            )
        ).pid
        assert redis.process is not None
        redis_pid = redis.process.pid

        from ttsq.records.connection import connect

        cache = connect(base.cache_url)
        deadline = time.monotonic() + 120
        # Both ttsq workers announced their model (each under its own queue).
        while not all(cache.exists(FLEET_PREFIX + each.queue) for each in settings.values()):
            if time.monotonic() > deadline:
                raise RuntimeError("no ttsq worker started; logs in " + str(folder))
            time.sleep(0.1)
        cache.close()
        clients = {name: Client(s) for name, s in settings.items()}
        for client in clients.values():
            stack.callback(client.close)
        bare = BareTarget(base.broker_url, base.result_backend, BARE.queue)
        stack.callback(bare.close)
        targets: dict[str, bench.Target] = {name: bench.ClientTarget(c) for name, c in clients.items()}
        targets[BARE.name] = bare
        for config in (BATCHED, UNBATCHED, BARE):
            _wait_ready(targets[config.name], config.label, corpus)

        configs = [BATCHED, UNBATCHED, BARE]
        rounds: list[dict[str, Any]] = []
        overhead: dict[str, list[bench.Outcome]] = {BATCHED.name: [], UNBATCHED.name: []}
        overhead_walls = dict.fromkeys(overhead, 0.0)
        first_s: list[float] = []
        hit_s: list[float] = []
        plan = bench.Plan(jobs=args.jobs, concurrency=args.concurrency, timeout_s=args.timeout)
        for number in range(args.rounds):
            figures: dict[str, Any] = {}
            order = configs[number % 3 :] + configs[: number % 3]
            for config in order:
                print(f"round {number + 1}/{args.rounds}: {config.label} ...", file=sys.stderr, flush=True)
                cpu_before = (_cpu_s(pids[config.name]), _cpu_s(redis_pid), time.process_time())
                outcomes, wall = bench.run(
                    targets[config.name],
                    corpus,
                    bench.Plan(jobs=plan.jobs, concurrency=plan.concurrency, timeout_s=plan.timeout_s, seed=number),
                )
                cpu_after = (_cpu_s(pids[config.name]), _cpu_s(redis_pid), time.process_time())
                cpu_ms = [
                    (after - before) * 1000 / plan.jobs for before, after in zip(cpu_before, cpu_after, strict=True)
                ]
                data = bench.report(outcomes, wall, plan)
                if data["jobs"]["errors"]:
                    raise RuntimeError(f"{config.label}: {data['errors']}; logs in {folder}")
                figures[config.name] = {
                    "jobs_per_s": data["throughput"]["jobs_per_s"],
                    "audio_s_per_s": data["throughput"]["audio_s_per_s"],
                    "latency_p50_s": data["latency_s"]["p50"],
                    "latency_p95_s": data["latency_s"]["p95"],
                    "mean_batch_size": data["batch"]["mean_size"],
                    "order": order.index(config),
                    # CPU time per job of the worker, of Redis and of this producer: unlike wall time,
                    # it hardly moves when other work shares the machine.
                    "worker_cpu_ms": cpu_ms[0],
                    "redis_cpu_ms": cpu_ms[1],
                    "producer_cpu_ms": cpu_ms[2],
                    "total_cpu_ms": sum(cpu_ms),
                }
            rounds.append(figures)

            # Cache: the first submit of a request against a submit of the same, now cached, request.
            print(f"round {number + 1}/{args.rounds}: cache hit vs first submit ...", file=sys.stderr, flush=True)
            client = clients[BATCHED.name]
            for fields in bench.make_requests(
                corpus,
                args.cache_requests,
                mode="synthesize",
                run_id=f"cache-{number}-{time.time()}",
                seed=number,
                audio_format="wav",
            ):
                for sink in (first_s, hit_s):
                    started = time.perf_counter()
                    job = client.submit(fields["text"], **{k: v for k, v in fields.items() if k != "text"})
                    job.wait(args.timeout)
                    sink.append(time.perf_counter() - started)
                    if sink is hit_s and not job.cached:
                        raise RuntimeError("the second submit of a request was not a cache hit")

            # Overhead: one job at a time, so no job waits behind another and each stage is its own cost.
            for config in (BATCHED, UNBATCHED):
                print(
                    f"round {number + 1}/{args.rounds}: {config.label}, one job at a time ...",
                    file=sys.stderr,
                    flush=True,
                )
                outcomes, wall = bench.run(
                    targets[config.name],
                    corpus,
                    bench.Plan(jobs=args.overhead_jobs, concurrency=1, timeout_s=args.timeout, seed=100 + number),
                )
                overhead[config.name] += outcomes
                overhead_walls[config.name] += wall
        load_after = os.getloadavg()

    def ratio(metric: str, over: str, under: str) -> dict[str, float]:
        return _median_spread([r[over][metric] / r[under][metric] for r in rounds])

    summary = {
        c.name: {
            metric: _median_spread([r[c.name][metric] for r in rounds])
            for metric in (
                "jobs_per_s",
                "audio_s_per_s",
                "latency_p50_s",
                "latency_p95_s",
                "worker_cpu_ms",
                "redis_cpu_ms",
                "producer_cpu_ms",
                "total_cpu_ms",
            )
        }
        for c in configs
    }
    one_at_a_time = {
        name: bench.report(outcomes, overhead_walls[name], bench.Plan(jobs=len(outcomes), concurrency=1))
        for name, outcomes in overhead.items()
    }
    return {
        "ttsq_compare": 1,
        "config": {
            "engine": args.engine,
            "jobs": args.jobs,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "max_batch": args.max_batch,
            "max_wait_ms": args.max_wait_ms,
            "storage": args.storage,
            "log_level": args.log_level,
            "overhead_jobs": args.overhead_jobs,
            "cache_requests": args.cache_requests,
            "cpus": os.cpu_count(),
            "load_average_before": load_before,
            "load_average_after": load_after,
        },
        "labels": {c.name: c.label for c in configs},
        "rounds": rounds,
        "summary": summary,
        "ratios": {
            key: {
                "jobs_per_s": ratio("jobs_per_s", over, under),
                "latency_p50": ratio("latency_p50_s", over, under),
                "total_cpu_ms": ratio("total_cpu_ms", over, under),
            }
            for key, (over, under) in RATIOS.items()
        },
        "cache": {
            "first_submit_ms": _median_spread([s * 1000 for s in first_s]),
            "cached_submit_ms": _median_spread([s * 1000 for s in hit_s]),
            "first_over_cached": statistics.median(first_s) / statistics.median(hit_s),
        },
        "overhead_ms": {name: figures["stages_ms"] for name, figures in one_at_a_time.items()},
        "queue_overhead_ms": {name: figures["queue_overhead_ms"] for name, figures in one_at_a_time.items()},
    }


def _spread(value: Mapping[str, float], digits: int = 1) -> str:
    return f"{value['median']:.{digits}f} ({value['min']:.{digits}f}-{value['max']:.{digits}f})"


def format_figures(data: Mapping[str, Any]) -> str:
    """The figures as text: per-system medians, ratios, cache, overhead by stage."""
    config = data["config"]
    lines = [
        f"ttsq compare: {config['engine']} engine, {config['jobs']} jobs per run at concurrency "
        f"{config['concurrency']}, {config['rounds']} interleaved rounds, storage {config['storage']}, "
        f"ttsq log level {config['log_level']}, "
        f"{config['cpus']} CPUs (load average {config['load_average_before'][0]:.2f} before, "
        f"{config['load_average_after'][0]:.2f} after)",
        "median over rounds (min-max)",
        f"  {'':<22}{'jobs/s':>21}{'audio s/s':>23}{'p50 ms':>21}{'p95 ms':>21}",
    ]
    for name, label in data["labels"].items():
        figures = data["summary"][name]
        ms = {k: {p: v * 1000 for p, v in figures[k].items()} for k in ("latency_p50_s", "latency_p95_s")}
        lines.append(
            f"  {label:<22}{_spread(figures['jobs_per_s']):>21}{_spread(figures['audio_s_per_s']):>23}"
            f"{_spread(ms['latency_p50_s']):>21}{_spread(ms['latency_p95_s']):>21}"
        )
    lines.append(f"  {'CPU ms per job':<22}{'worker':>21}{'redis':>23}{'producer':>21}{'total':>21}")
    for name, label in data["labels"].items():
        figures = data["summary"][name]
        lines.append(
            f"  {label:<22}"
            + "".join(
                f"{_spread(figures[k], 2):>{w}}"
                for k, w in (("worker_cpu_ms", 21), ("redis_cpu_ms", 23), ("producer_cpu_ms", 21), ("total_cpu_ms", 21))
            )
        )
    lines.append("ratios (median of per-round ratios, min-max)")
    names = {
        "batching_on_over_off": "batching on / off",
        "ttsq_over_bare": "ttsq (batching on) / bare task",
        "ttsq_unbatched_over_bare": "ttsq (batching off) / bare task",
    }
    for key, label in names.items():
        entry = data["ratios"][key]
        lines.append(
            f"  {label:<34} throughput x{_spread(entry['jobs_per_s'], 2)}, p50 latency "
            f"x{_spread(entry['latency_p50'], 2)}, CPU per job x{_spread(entry['total_cpu_ms'], 2)}"
        )
    cache = data["cache"]
    lines.append(
        f"cache: first submit {_spread(cache['first_submit_ms'], 2)} ms, same request cached "
        f"{_spread(cache['cached_submit_ms'], 2)} ms: x{cache['first_over_cached']:.1f} faster"
    )
    lines.append("where one job's time goes, one job at a time (ms, mean / p50)")
    overhead = data["overhead_ms"]
    first = next(iter(overhead.values()))
    lines.append(f"  {'':<48}" + "".join(f"{data['labels'][name]:>24}" for name in overhead))
    for stage, entry in first.items():
        cells = "".join(
            f"{overhead[name][stage]['mean_ms']:>14.2f} / {overhead[name][stage]['p50_ms']:>6.2f}" for name in overhead
        )
        lines.append(f"  {entry['label']:<48}{cells}")
    totals = "".join(f"{sum(s['mean_ms'] for s in overhead[name].values()):>14.2f}{'':>9}" for name in overhead)
    lines.append(f"  {'total (mean end-to-end latency)':<48}{totals}")
    own = data["queue_overhead_ms"]
    cells = "".join(f"{own[name]['mean_ms']:>14.2f} / {own[name]['p50_ms']:>6.2f}" for name in overhead)
    lines.append(f"  {bench.QUEUE_OVERHEAD_LABEL:<48}{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--jobs", type=int, default=200, help="timed jobs per system per round")
    parser.add_argument("--concurrency", type=int, default=16, help="jobs in flight (closed loop)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--max-batch", type=int, default=8, help="max batch of the batching-on worker")
    parser.add_argument("--max-wait-ms", type=int, default=20, help="batch fill wait of the ttsq workers")
    parser.add_argument("--engine", default="espeak", help="engine of all three systems")
    parser.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="local",
        help="ttsq's storage: a local folder, or moto's S3 server on loopback (needs moto[server])",
    )
    parser.add_argument(
        "--log-level", default="INFO", help="log level of the ttsq workers (INFO, as deployed: a few lines per job)"
    )
    parser.add_argument("--overhead-jobs", type=int, default=50, help="one-at-a-time jobs per config per round")
    parser.add_argument("--cache-requests", type=int, default=21, help="first/cached submit pairs per round")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for each job")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--tiny", action="store_true", help="smoke test: a few jobs, one round")
    args = parser.parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so the workers, Redis and the temporary folder are cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.tiny:
        args.jobs, args.concurrency, args.rounds, args.overhead_jobs, args.cache_requests = 8, 4, 1, 4, 2
    data = run(args)
    if args.json is not None:  # first: the figures survive a closed stdout
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    print(format_figures(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
