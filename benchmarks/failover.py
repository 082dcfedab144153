"""What a Redis failover costs ttsq: accepted jobs lost, jobs run twice, seconds of refused submits.

Each trial starts its own Sentinel topology on loopback (``ttsq.ops.sentinel``: a primary, two replicas,
three Sentinels; down after 1 s, failover timeout 3 s; AOF ``everysec``), two ``ttsq worker`` processes
(espeak, a local storage folder) and a producer that submits a burst of distinct jobs through
``ttsq.client.Client``, with ``TTSQ_REDIS_WAIT_REPLICAS=1``. A third of the way into the burst the
primary is killed outright (SIGKILL); five seconds later (``--restart-after``) it is started again on
its data, and the Sentinels make it a replica of the new primary (a rebooted host, a healed
partition). Nothing is restarted on ttsq's side: the same producer, the same workers.

A trial counts the submits accepted and refused (a refused submit got ``BrokerError``; nothing of it may
run), the accepted jobs that completed, the jobs synthesized more than once (a job id in two workers'
"synthesized" lines), the stored objects against the distinct content keys accepted (equal when nothing
is lost or stored twice), the jobs the sweeper sent again, and the seconds from the kill to the new
primary, to the first accepted submit and to the last result.

    python benchmarks/failover.py --trials 10 --jobs 300
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.errors import BrokerError
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key
from ttsq.ops.preflight import require_command_line
from ttsq.ops.sentinel import MASTER_NAME, SentinelTopology
from ttsq.records.connection import connect


@dataclass
class Trial:
    accepted: int
    refused: int
    completed: int
    lost: int
    run_twice: int
    objects: int
    distinct_keys: int
    sent_again: int
    promoted_s: float
    first_accept_s: float
    last_result_s: float


def start_worker(settings: Settings, name: str, log: Path) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    env.update({f"TTSQ_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(settings)})
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"{name}@failover"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def run(n: int, jobs: int, folder: Path, *, pace_s: float, grace_s: int, restart_after_s: float, pause: bool) -> Trial:
    """One trial: a burst, the primary killed (or paused) a third of the way in, every accepted job waited for."""
    folder.mkdir(parents=True)
    topology = SentinelTopology(replicas=2, password="data-secret", sentinel_password="sentinel-secret").start()
    settings = Settings(
        broker_url=topology.url(0),
        result_backend=topology.url(1),
        cache_url=topology.url(2),
        redis_master_name=MASTER_NAME,
        sentinel_password="sentinel-secret",
        redis_wait_replicas=1,
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
        workers = [start_worker(settings, f"w{w}", folder / f"w{w}.log") for w in (1, 2)]
        cache = connect(settings.cache_url, settings=settings)
        deadline = time.monotonic() + 120
        while not cache.exists(FLEET_PREFIX + settings.queue):
            if time.monotonic() > deadline:
                raise SystemExit(f"workers did not start; see {folder}")
            time.sleep(0.1)
        cache.close()
        accepted: list[tuple[str, Job, float]] = []
        refused: list[str] = []

        def burst() -> None:
            with Client(settings) as producer:
                for i in range(jobs):
                    text = f"Failover trial {n} sentence {i}, in {folder.name}."
                    try:
                        accepted.append((text, producer.submit(text), time.monotonic()))
                    except BrokerError:
                        refused.append(text)
                    time.sleep(pace_s)

        producer = threading.Thread(target=burst)
        producer.start()
        while len(accepted) < jobs // 3 and producer.is_alive():
            time.sleep(0.01)
        old = topology.pause_primary() if pause else topology.fail_primary()
        killed = time.monotonic()
        topology.wait_for_failover(old.port, timeout=60)
        promoted = time.monotonic()
        time.sleep(max(0.0, killed + restart_after_s - time.monotonic()))
        if pause:
            topology.resume(old)
        else:
            topology.restart(old)
        producer.join()
        client = Client(settings)
        identity = client.identities()["voice_design"]
        completed = 0
        for _, job, _ in accepted:
            try:
                if job.result is not None or client.wait(job.id or "", timeout=300):
                    completed += 1
            except Exception as exc:  # a loss: counted, and the trial goes on
                print(f"  trial {n}: job {job.id} not completed: {type(exc).__name__}: {exc}", file=sys.stderr)
                print(f"  trial {n}: {_whereabouts(topology, job.id or '')}", file=sys.stderr)
        finished = time.monotonic()
        client.close()
        after = [at for _, _, at in accepted if at > killed]
        keys = {content_key(SynthesisRequest.from_dict({"text": text}), identity) for text, _, _ in accepted}
        logs = "".join((folder / f"w{w}.log").read_text(errors="replace") for w in (1, 2))
        synthesized = Counter(re.findall(r"job (\S+): synthesized", logs))
        return Trial(
            accepted=len(accepted),
            refused=len(refused),
            completed=completed,
            lost=len(accepted) - completed,
            run_twice=sum(1 for count in synthesized.values() if count > 1),
            objects=len(list((folder / "audio").rglob("*.wav"))),
            distinct_keys=len(keys),
            sent_again=logs.count("sent again"),
            promoted_s=round(promoted - killed, 2),
            first_accept_s=round(after[0] - killed, 2) if after else float("nan"),
            last_result_s=round(finished - killed, 2),
        )
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            try:
                worker.wait(30)
            except subprocess.TimeoutExpired:
                worker.kill()
        topology.stop()


def _whereabouts(topology: SentinelTopology, task_id: str) -> str:
    """Which data node (and in which role) holds a lost job's result and accepted record: where it went."""
    seen = []
    for node in topology.nodes:
        try:
            with topology.node(node.port, db=1) as results, topology.node(node.port, db=2) as cache:
                role = results.role()[0]
                seen.append(
                    f"{node.port} ({role}): result={bool(results.exists('celery-task-meta-' + task_id))} "
                    f"record={bool(cache.exists('ttsq:accepted:' + task_id))}"
                )
        except Exception as exc:  # a node that is down says so
            seen.append(f"{node.port}: {type(exc).__name__}")
    return "; ".join(seen) + f" (primary now {topology.primary_port()})"


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=10, help="failovers, one per trial (default 10)")
    parser.add_argument("--jobs", type=int, default=300, help="jobs per burst (default 300)")
    parser.add_argument("--grace", type=int, default=3, help="TTSQ_LOST_JOB_GRACE_S of the workers (default 3)")
    parser.add_argument("--pace", type=float, default=0.03, help="seconds between two submits (default 0.03)")
    parser.add_argument(
        "--restart-after",
        type=float,
        default=5.0,
        help="seconds after the kill to start the old primary again (default 5)",
    )
    parser.add_argument(
        "--pause",
        action="store_true",
        help="freeze the primary (SIGSTOP, a partition) instead of killing it, and let it go on at --restart-after",
    )
    parser.add_argument("--json", action="store_true", help="print every trial as JSON")
    parser.add_argument("--keep", metavar="DIR", help="keep every trial's logs and audio under DIR")
    args = parser.parse_args()
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="ttsq-failover-") as scratch:
        root = args.keep or scratch
        for n in range(args.trials):
            trial = run(
                n,
                args.jobs,
                Path(root) / f"trial-{n}",
                pace_s=args.pace,
                grace_s=args.grace,
                restart_after_s=args.restart_after,
                pause=args.pause,
            )
            trials.append(trial)
            print(f"#{n + 1}: {asdict(trial)}", file=sys.stderr)
    if args.json:
        print(json.dumps([asdict(t) for t in trials], indent=2))
        return 0
    columns = [f.name for f in fields(Trial)]
    print("trial " + " ".join(f"{name:>14}" for name in columns))
    for n, trial in enumerate(trials, 1):
        print(f"{n:>5} " + " ".join(f"{getattr(trial, name):>14}" for name in columns))
    total = _sum(trials)
    print(
        f"\n{len(trials)} failovers: {total['accepted']} accepted, {total['refused']} refused, "
        f"{total['lost']} lost, {total['run_twice']} run twice, {total['objects']} objects for "
        f"{total['distinct_keys']} distinct keys, {total['sent_again']} sent again by the sweeper"
    )
    for name in ("promoted_s", "first_accept_s", "last_result_s"):
        values = [getattr(t, name) for t in trials]
        print(f"{name}: median {statistics.median(values):.2f}, max {max(values):.2f}")
    return 0 if total["lost"] == 0 and total["objects"] == total["distinct_keys"] else 1


def _sum(rows: list[Trial]) -> dict[str, Any]:
    return {
        name: sum(getattr(t, name) for t in rows)
        for name in ("accepted", "refused", "lost", "run_twice", "objects", "distinct_keys", "sent_again")
    }


if __name__ == "__main__":
    sys.exit(main())
