"""How often an accepted job is lost, and how fast a lost one comes back, over repeated trials.

Each trial starts its own redis-server (AOF on), two ``ttsq worker`` processes (espeak, local storage)
and a producer that submits a burst of distinct jobs, and loses messages in one of three ways:

- ``delete``: with the workers paused (SIGSTOP), the next queued message is taken out of its list, the
  state kombu's fetch window leaves (a message popped and never recorded as unacknowledged);
- ``sigterm``: Redis is stopped cleanly mid-burst and started again on its data (the compose file's
  ``appendfsync everysec``);
- ``sigkill``: Redis is killed outright mid-burst and started again (``appendfsync always``, the policy
  the "no accepted job lost" guarantee names).

A trial counts the submits accepted and refused (a refused submit got ``BrokerError``, and nothing of
it may run), the accepted jobs that completed, the stored objects against the distinct keys accepted
(equal when nothing is lost or stored twice), the jobs the sweeper sent again, and the seconds from the
loss to the last result. One more pair of runs, with no loss, times the same burst under each fsync
policy side by side: the cost of ``always``.

    python benchmarks/lost_jobs.py --trials 10 --jobs 300
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import redis

from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.errors import BrokerError
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer


@dataclass
class Trial:
    kind: str
    accepted: int
    refused: int
    completed: int
    objects: int
    distinct_keys: int
    sent_again: int
    recovery_s: float


def start_worker(settings: Settings, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    env.update({f"TTSQ_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(settings)})
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"{name}@lost"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def run(kind: str, jobs: int, folder: Path, *, grace_s: int, pace_s: float, appendfsync: str | None = None) -> Trial:
    """One trial; ``kind`` none (no loss, for timing), delete, sigterm or sigkill."""
    fsync = appendfsync or ("always" if kind == "sigkill" else "everysec")
    server = RedisServer(directory=str(folder / "redis"), appendonly=True, appendfsync=fsync)
    (folder / "redis").mkdir(parents=True)
    server.start()
    url = server.url
    settings = Settings(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        cache_url=f"{url}/2",
        storage_url=str(folder / "audio"),
        max_batch=8,
        metrics_port=0,
        log_level="INFO",
        visibility_timeout_s=90,
        job_timeout_s=20,
        storage_attempts=1,
        lost_job_grace_s=grace_s,
    )
    workers: list[subprocess.Popen[bytes]] = []
    try:
        workers = [start_worker(settings, f"w{n}", folder / f"w{n}.log") for n in (1, 2)]
        cache = redis.Redis.from_url(settings.cache_url)
        deadline = time.monotonic() + 120
        while not cache.exists(FLEET_PREFIX + settings.queue):
            if time.monotonic() > deadline:
                raise SystemExit(f"workers did not start; see {folder}")
            time.sleep(0.1)
        accepted: list[tuple[str, Job]] = []
        refused: list[str] = []
        lost_at: list[float] = []

        def burst() -> None:
            with Client(settings) as producer:
                for i in range(jobs):
                    text = f"Trial sentence {i} of a {kind} run in {folder.name}."
                    try:
                        accepted.append((text, producer.submit(text)))
                    except BrokerError:
                        refused.append(text)
                    time.sleep(pace_s)

        if kind == "delete":  # the workers pause, so the queue holds messages to lose
            for worker in workers:
                os.kill(worker.pid, signal.SIGSTOP)
        producer = threading.Thread(target=burst)
        started = time.monotonic()
        producer.start()
        while len(accepted) < jobs // 3 and producer.is_alive():
            time.sleep(0.01)
        if kind == "delete":
            broker = redis.Redis.from_url(settings.broker_url)
            items: list[Any] = broker.lrange(settings.queue, -1, -1)  # the next message a worker would take
            if items and broker.lrem(settings.queue, 1, items[0]):
                lost_at.append(time.monotonic())
            for worker in workers:
                os.kill(worker.pid, signal.SIGCONT)
        elif kind in ("sigterm", "sigkill"):
            server.stop(keep_data=True, crash=kind == "sigkill")
            lost_at.append(time.monotonic())
            time.sleep(1)
            server.start()
        producer.join()
        client = Client(settings)
        identity = client.identities()["voice_design"]
        completed = 0
        for _, job in accepted:
            try:
                if job.result is not None or client.wait(job.id or "", timeout=300):
                    completed += 1
            except Exception as exc:  # a loss: counted, and the trial goes on
                print(f"  {kind}: job {job.id} not completed: {type(exc).__name__}: {exc}", file=sys.stderr)
        finished = time.monotonic()
        client.close()
        keys = {content_key(SynthesisRequest.from_dict({"text": text}), identity) for text, _ in accepted}
        objects = len(list((folder / "audio").rglob("*.wav")))
        logs = "".join((folder / f"w{n}.log").read_text(errors="replace") for n in (1, 2))
        return Trial(
            kind=kind,
            accepted=len(accepted),
            refused=len(refused),
            completed=completed,
            objects=objects,
            distinct_keys=len(keys),
            sent_again=logs.count("sent again"),
            recovery_s=round(finished - (lost_at[0] if lost_at else started), 2),
        )
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        server.stop()


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="trials of each kind of loss (default 10)")
    parser.add_argument("--jobs", type=int, default=300, help="jobs per burst (default 300)")
    parser.add_argument("--grace", type=int, default=3, help="TTSQ_LOST_JOB_GRACE_S of the workers (default 3)")
    parser.add_argument("--kinds", default="delete,sigterm,sigkill", help="which losses to run")
    parser.add_argument("--pace", type=float, default=0.02, help="seconds between two submits (default 0.02)")
    parser.add_argument("--json", action="store_true", help="print every trial as JSON")
    args = parser.parse_args()
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="ttsq-lost-") as root:
        timing = {
            fsync: run(
                "none",
                args.jobs,
                Path(root) / f"timing-{fsync}",
                grace_s=args.grace,
                pace_s=0.0,  # as fast as a producer submits: the fsync policy is what differs
                appendfsync=fsync,
            )
            for fsync in ("everysec", "always")
        }
        for kind in args.kinds.split(","):
            for n in range(args.trials):
                trial = run(kind, args.jobs, Path(root) / f"{kind}-{n}", grace_s=args.grace, pace_s=args.pace)
                trials.append(trial)
                print(f"{kind} #{n + 1}: {asdict(trial)}", file=sys.stderr)
    if args.json:
        print(
            json.dumps(
                {"timing": {k: asdict(v) for k, v in timing.items()}, "trials": [asdict(t) for t in trials]}, indent=2
            )
        )
        return 0
    print(
        f"{'loss':<9}{'trials':>7}{'accepted':>10}{'refused':>9}{'completed':>11}{'lost':>6}{'objects':>9}"
        f"{'keys':>7}{'sent again':>12}{'recovery s (median, max)':>27}"
    )
    for kind in args.kinds.split(","):
        rows = [t for t in trials if t.kind == kind]
        if not rows:
            continue
        total = _sum(rows)
        recovery = [t.recovery_s for t in rows]
        print(
            f"{kind:<9}{len(rows):>7}{total['accepted']:>10}{total['refused']:>9}{total['completed']:>11}"
            f"{total['accepted'] - total['completed']:>6}{total['objects']:>9}{total['distinct_keys']:>7}"
            f"{total['sent_again']:>12}{statistics.median(recovery):>16.1f}, {max(recovery):.1f}"
        )
    base, always = timing["everysec"], timing["always"]
    print(
        f"\nno loss, {args.jobs} jobs submitted at once, to the last result: "
        f"appendfsync everysec {base.recovery_s:.1f} s, always {always.recovery_s:.1f} s "
        f"({always.recovery_s / base.recovery_s:.2f}x)"
    )
    return 0


def _sum(rows: list[Trial]) -> dict[str, Any]:
    return {
        name: sum(getattr(t, name) for t in rows)
        for name in ("accepted", "refused", "completed", "objects", "distinct_keys", "sent_again")
    }


if __name__ == "__main__":
    sys.exit(main())
