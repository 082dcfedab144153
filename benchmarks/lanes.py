"""Lanes and fair shares on real workers: interactive waits behind a bulk backlog, and tenants' shares.

Each scenario starts its own redis-server, ``--workers`` ``ttsq worker`` processes (local storage) and
producers in this process (``Client.submit``), and measures from the jobs' own results (the worker's
``queue_wait_s``, and Celery's ``date_done`` for when each finished):

- **capacity**: ``--capacity-jobs`` bulk jobs at once on the idle fleet: the fleet's jobs/s, and one
  batch's engine time (the median ``synthesis_s``);
- **idle**: tenant B sends interactive jobs at ``--share`` of that capacity for ``--seconds``: queue wait
  p50/p95, and submit-to-result p95 (the baseline);
- **backlog**: tenant A first enqueues ``--backlog`` bulk jobs, then B sends the same interactive load:
  the same figures, side by side with the idle ones, and A's bulk throughput during B's load as a share
  of the fleet's capacity. Passes when B's wait p95 is at most 1.5 x the idle one plus one batch time,
  and bulk keeps at least 40% of the capacity;
- **tenants**: three bulk tenants with ``--tenants`` jobs (10,000 / 1,000 / 100), one producer each,
  with fair shares (the default ``TTSQ_RELEASE_WINDOW``), with fair shares and a per-tenant cap
  (``--tenant-cap`` jobs in flight, ``TTSQ_TENANT_MAX_IN_FLIGHT``) and without (0: one FIFO list, the baseline):
  when the smallest tenant's last job finished against the largest one's 1,000th and the middle one's
  200th. Twice: the three producers started together, and the largest one ``--stagger`` seconds ahead
  (a batch file already going when the others arrive).

    python benchmarks/lanes.py                                  # espeak, ~8 min on 2 cores
    python benchmarks/lanes.py --engine qwen-fast --backlog 2000 --tenants 2000,400,40 --seconds 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis

from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.constants import FLEET_NODES_PREFIX, FLEET_PREFIX
from ttsq.job import Lane
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer

# Run as a script, this folder is on the path, not the repository: compare.py's process helpers are
# imported from beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.compare import _env, _process

RESULT_PREFIX = "celery-task-meta-"


@contextmanager
def fleet(base: Settings, folder: Path, workers: int, **changes: Any) -> Iterator[Settings]:
    """A private Redis and ``workers`` worker processes; the settings they run with."""
    folder.mkdir(parents=True, exist_ok=True)
    server = RedisServer()
    server.start()
    try:
        url = server.url
        settings = base.replace(
            broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2", storage_url=str(folder / "audio")
        ).replace(**changes)
        with ExitStack() as stack:
            for n in range(workers):
                command = [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"w{n}@lanes"]
                stack.enter_context(_process(command, _env(settings), folder / f"w{n}.log"))
            cache = redis.Redis.from_url(settings.cache_url)
            deadline = time.monotonic() + 300
            while len(cache.hgetall(FLEET_NODES_PREFIX + settings.queue)) < workers or not cache.exists(
                FLEET_PREFIX + settings.queue
            ):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the workers did not start; see {folder}")
                time.sleep(0.2)
            cache.close()
            yield settings
    finally:
        server.stop()


def finished_at(settings: Settings, ids: list[str]) -> dict[str, float]:
    """UNIX time each finished job's result was stored (jobs not finished are absent)."""
    backend = redis.Redis.from_url(settings.result_backend)
    done: dict[str, float] = {}
    try:
        for start in range(0, len(ids), 1000):
            chunk = ids[start : start + 1000]
            for task_id, raw in zip(chunk, backend.mget([RESULT_PREFIX + i for i in chunk]), strict=True):
                if raw is None:
                    continue
                meta = json.loads(raw)
                if meta.get("status") == "SUCCESS" and meta.get("date_done"):
                    when = datetime.fromisoformat(meta["date_done"])
                    done[task_id] = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    finally:
        backend.close()
    return done


def submit_many(settings: Settings, count: int, *, tenant: str, lane: Lane, label: str) -> list[str]:
    """``count`` distinct jobs as fast as one producer sends them; their ids."""
    with Client(settings) as client:
        return [
            client.submit(f"{label} sentence number {i} for tenant {tenant}.", lane=lane, tenant=tenant).id or ""
            for i in range(count)
        ]


def capacity(settings: Settings, jobs: int) -> tuple[float, float]:
    """The fleet's jobs/s on a burst of bulk jobs (between its 10th and 90th percent finished, where the
    queue is never empty and the producer's ramp is over), and the median batch engine time."""
    ids = submit_many(settings, jobs, tenant="warm", lane="bulk", label="Capacity")
    with Client(settings) as client:
        results = [Job(id=task_id, key=None, client=client).wait(timeout=600) for task_id in ids]
    done = sorted(finished_at(settings, ids).values())
    low, high = len(done) // 10, len(done) * 9 // 10
    return (high - low) / (done[high] - done[low]), statistics.median(r["timings"]["synthesis_s"] for r in results)


def interactive(settings: Settings, rate: float, seconds: float, label: str) -> dict[str, float]:
    """Tenant B's interactive jobs at ``rate`` per second for ``seconds``: their waits."""
    sent: list[tuple[float, Job]] = []
    with Client(settings) as client:
        step, start = 1.0 / rate, time.monotonic()
        for i in range(int(rate * seconds)):
            pause = start + i * step - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            sent.append((time.time(), client.submit(f"{label} interactive request {i}, please.", tenant="tenant-b")))
        results = [job.wait(timeout=600) for _, job in sent]
    done = finished_at(settings, [job.id or "" for _, job in sent])
    waits = [r["timings"]["queue_wait_s"] for r in results]
    latency = [done[job.id or ""] - at for at, job in sent if job.id in done]
    return {
        "jobs": len(sent),
        "queue_wait_p50_s": round(statistics.median(waits), 3),
        "queue_wait_p95_s": round(_p95(waits), 3),
        "latency_p95_s": round(_p95(latency), 3),
    }


def backlog_run(settings: Settings, backlog: int, rate: float, seconds: float, cap: float) -> dict[str, Any]:
    """A's bulk backlog, then B's interactive load over it; A's throughput while B's load runs."""
    ids = submit_many(settings, backlog, tenant="tenant-a", lane="bulk", label="Backlog")
    before = len(finished_at(settings, ids))
    started = time.time()
    figures = interactive(settings, rate, seconds, "Backlog")
    ended = time.time()
    done = finished_at(settings, ids)
    during = sum(1 for at in done.values() if started <= at <= ended)
    return {
        **figures,
        "bulk_done_before": before,
        "bulk_jobs_per_s_during": round(during / (ended - started), 2),
        "bulk_share_of_capacity": round(during / (ended - started) / cap, 3),
        "bulk_left": backlog - len(done),
    }


def tenants_run(settings: Settings, sizes: list[int], stagger_s: float) -> dict[str, Any]:
    """Three bulk tenants, the largest ``stagger_s`` ahead: when the smallest finished against the others'
    progress (seconds from the first submit)."""
    names = [f"tenant-{size}" for size in sizes]
    ids: dict[str, list[str]] = {}

    def producer(name: str, size: int) -> None:
        ids[name] = submit_many(settings, size, tenant=name, lane="bulk", label="Fair")

    threads = [threading.Thread(target=producer, args=(n, s)) for n, s in zip(names, sizes, strict=True)]
    started = time.time()
    for index, thread in enumerate(threads):
        if index == 1:
            time.sleep(stagger_s)
        thread.start()
    for thread in threads:
        thread.join()
    big, mid, small = names
    marks = {big: min(1000, sizes[0]), mid: min(200, sizes[1])}
    deadline = time.monotonic() + 3600
    while True:
        done = {name: sorted(finished_at(settings, ids[name]).values()) for name in names}
        if len(done[small]) == sizes[2] and all(len(done[n]) >= m for n, m in marks.items()):
            break
        if time.monotonic() > deadline:
            raise SystemExit("the tenants run did not finish within an hour")
        time.sleep(1.0)
    small_last = done[small][-1] - started
    big_mark = done[big][marks[big] - 1] - started
    mid_mark = done[mid][marks[mid] - 1] - started
    return {
        "small_last_s": round(small_last, 1),
        f"big_{marks[big]}th_s": round(big_mark, 1),
        f"mid_{marks[mid]}th_s": round(mid_mark, 1),
        "small_before_both": small_last < big_mark and small_last < mid_mark,
    }


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=["espeak", "qwen-fast"], default="espeak")
    parser.add_argument("--model", default="", help="qwen-fast: a VoiceDesign checkpoint; default: a tiny one")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--capacity-jobs", type=int, default=600)
    parser.add_argument("--share", type=float, default=0.5, help="interactive load, as a share of capacity")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--tenants", default="10000,1000,100", help="three tenants' job counts, largest first")
    parser.add_argument("--stagger", type=float, default=2.0, help="seconds the largest tenant starts ahead")
    parser.add_argument("--tenant-cap", type=int, default=16, help="the capped tenants run's per-tenant cap")
    parser.add_argument("--skip", default="", help="scenarios to leave out: backlog, tenants")
    args = parser.parse_args()
    sizes = [int(size) for size in args.tenants.split(",")]
    with tempfile.TemporaryDirectory(prefix="ttsq-lanes-") as tmp:
        folder = Path(tmp)
        base = Settings(
            engine=args.engine,
            max_batch=args.max_batch,
            metrics_port=0,
            log_level="WARNING",
            storage_attempts=1,
            qwen_device="cpu",
        )
        if args.engine == "qwen-fast":
            model = args.model
            if not model:
                from ttsq.testing.qwen_checkpoint import build

                model = str(build(folder / "tiny-qwen", "voice_design"))
            base = base.replace(qwen_model=model)
        report: dict[str, Any] = {"engine": args.engine, "workers": args.workers, "max_batch": args.max_batch}
        if "backlog" not in args.skip:
            with fleet(base, folder / "backlog", args.workers, queue="lanes-backlog") as settings:
                cap, batch_s = capacity(settings, args.capacity_jobs)
                rate = args.share * cap
                report["capacity_jobs_per_s"] = round(cap, 2)
                report["batch_s"] = round(batch_s, 3)
                report["interactive_rate_per_s"] = round(rate, 2)
                report["idle"] = interactive(settings, rate, args.seconds, "Idle")
                print(json.dumps({"idle": report["idle"]}), flush=True)
                report["backlog"] = backlog_run(settings, args.backlog, rate, args.seconds, cap)
                print(json.dumps({"backlog": report["backlog"]}), flush=True)
            idle_p95, with_p95 = report["idle"]["queue_wait_p95_s"], report["backlog"]["queue_wait_p95_s"]
            report["verdict_interactive"] = with_p95 <= 1.5 * idle_p95 + batch_s
            report["verdict_bulk"] = report["backlog"]["bulk_share_of_capacity"] >= 0.4
        if "tenants" not in args.skip:
            for start, stagger in (("together", 0.0), ("staggered", args.stagger)):
                window = Settings().release_window
                for label, changes in (
                    ("fair", {"release_window": window}),
                    ("capped", {"release_window": window, "tenant_max_in_flight": args.tenant_cap}),
                    ("fifo", {"release_window": 0}),
                ):
                    name = f"tenants_{start}_{label}"
                    with fleet(base, folder / name, args.workers, queue=name, **changes) as s:
                        report[name] = tenants_run(s, sizes, stagger)
                    print(json.dumps({name: report[name]}), flush=True)
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
