"""What a Redis failover costs ttsq: accepted jobs lost, jobs run twice, seconds of refused submits.

Each trial starts its own Sentinel topology on loopback (``ttsq.ops.sentinel``: a primary, two replicas,
three Sentinels; down after 1 s, failover timeout 3 s; AOF ``everysec``), two ``ttsq worker`` processes
(espeak, a local storage folder), a ``ttsq serve`` gateway, a producer that submits a burst of distinct
jobs through ``ttsq.client.Client`` and a second one that posts jobs to the gateway (``POST /v1/jobs``),
with ``TTSQ_REDIS_WAIT_REPLICAS=1``. A third of the way into the burst the primary fails (``--fault``):

- ``kill``: killed outright (SIGKILL); five seconds later (``--restart-after``) it is started again on
  its data, and the Sentinels make it a replica of the new primary (a rebooted host);
- ``pause``: frozen (SIGSTOP: alive, its connections open, a partition), let go at ``--restart-after``;
- ``sleep``: ``DEBUG SLEEP --sleep`` seconds (30): silent, then awake, calling itself primary until the
  Sentinels demote it.

Nothing is restarted on ttsq's side: the same producers, the same workers, the same gateway.

A trial counts the submits accepted and refused (a refused submit got ``BrokerError``, or a gateway
error; nothing of it may run), the accepted jobs that completed, the jobs synthesized more than once (a
job id in two workers' "synthesized" lines), the stored objects against the distinct content keys
accepted (equal when nothing is lost or stored twice), the jobs the sweeper sent again, the
``UnknownJob`` answers for accepted jobs from ``Client``s made before the fault (with ``sleep``, one
that stayed idle asks after each as soon as the old primary wakes; the producer then waits for each),
and the seconds from the fault to the new primary, to the first accepted submit and to the last result;
and from the promotion (when the harness saw every Sentinel name the new primary) to the first job the
``Client`` and the gateway accepted, and to the first result a worker stored for a job accepted after it.

    python benchmarks/failover.py --trials 10 --jobs 300
    python benchmarks/failover.py --trials 5 --jobs 300 --fault sleep
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import httpx
import redis

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.errors import BrokerError, UnknownJob
from ttsq.gateway.apikeys import ApiKeys
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import free_port
from ttsq.ops.sentinel import MASTER_NAME, SentinelTopology
from ttsq.records.connection import connect

#: Where Celery's result backend keeps a task's result.
RESULT_PREFIX = "celery-task-meta-"


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
    unknown: int
    promoted_s: float
    first_accept_s: float
    last_result_s: float
    client_after_promotion_s: float
    gateway_after_promotion_s: float
    worker_after_promotion_s: float


def start(settings: Settings, command: list[str], log: Path) -> subprocess.Popen[bytes]:
    """``ttsq COMMAND`` as a subprocess on ``settings``, its output in ``log``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    env.update({f"TTSQ_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(settings)})
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", *command], env=env, stdout=out, stderr=subprocess.STDOUT
        )


def run(
    n: int, jobs: int, folder: Path, *, pace_s: float, grace_s: int, restart_after_s: float, fault: str, sleep_s: int
) -> Trial:
    """One trial: a burst, the primary failed a third of the way in, every accepted job waited for."""
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
        gateway_host="127.0.0.1",
        gateway_port=free_port(),
    )
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes = [start(settings, ["worker", "-n", f"w{w}@failover"], folder / f"w{w}.log") for w in (1, 2)]
        processes.append(start(settings, ["serve"], folder / "gateway.log"))
        cache = connect(settings.cache_url, settings=settings)
        token, _ = ApiKeys(cache).add(f"failover-{n}")
        gateway_url = f"http://127.0.0.1:{settings.gateway_port}"
        deadline = time.monotonic() + 120
        while not cache.exists(FLEET_PREFIX + settings.queue) or not _healthy(gateway_url):
            if time.monotonic() > deadline:
                raise SystemExit(f"workers or gateway did not start; see {folder}")
            time.sleep(0.1)
        cache.close()
        # (text, job id or None for a cache hit, when), by the Client and by the gateway.
        accepted: list[tuple[str, str | None, float]] = []
        via_gateway: list[tuple[str, str | None, float]] = []
        refused: list[str] = []
        done = threading.Event()
        # The producer: made before the fault, and the one that waits for every job afterwards; and a
        # Client made before the fault that stays idle until the old primary wakes (with ``sleep``).
        producer = Client(settings)
        idle = Client(settings)

        def burst() -> None:
            for i in range(jobs):
                text = f"Failover trial {n} sentence {i}, in {folder.name}."
                try:
                    job = producer.submit(text)
                    accepted.append((text, None if job.result is not None else job.id, time.monotonic()))
                except BrokerError:
                    refused.append(text)
                time.sleep(pace_s)
            done.set()

        def post() -> None:
            i = 0
            with httpx.Client(base_url=gateway_url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:
                while not done.is_set():
                    text = f"Failover trial {n} gateway request {i}, in {folder.name}."
                    try:
                        answer = api.post("/v1/jobs", json={"text": text})
                        if answer.status_code == 202:
                            via_gateway.append((text, answer.json()["id"], time.monotonic()))
                        else:
                            refused.append(text)
                    except httpx.HTTPError:
                        refused.append(text)
                    i += 1
                    time.sleep(pace_s)

        threads = [threading.Thread(target=burst), threading.Thread(target=post)]
        for thread in threads:
            thread.start()
        while len(accepted) < jobs // 3 and threads[0].is_alive():
            time.sleep(0.01)
        idle.status(next(job_id for _, job_id, _ in accepted if job_id is not None))  # its connections open
        if fault == "sleep":
            old = topology.sleep_primary(sleep_s)
        else:
            old = topology.pause_primary() if fault == "pause" else topology.fail_primary()
        killed = time.monotonic()
        new = topology.wait_for_failover(old.port, timeout=60)
        promoted = time.monotonic()
        stored = _first_result(
            topology, new, lambda: [job_id or "" for _, job_id, at in accepted + via_gateway if at > promoted]
        )
        if fault != "sleep":
            time.sleep(max(0.0, killed + restart_after_s - time.monotonic()))
        if fault == "pause":
            topology.resume(old)
        elif fault == "kill":
            topology.restart(old)
        for thread in threads:
            thread.join()
        unknown = 0
        if fault == "sleep":
            # The old primary wakes calling itself primary, without what was written on the new one, until
            # the Sentinels demote it seconds later: the idle Client asks after every accepted job then.
            awake = topology.node(old.port)
            while not _answers(awake):
                time.sleep(0.05)
            awake.close()
            for _, job_id, _ in accepted + via_gateway:
                if job_id is not None:
                    try:
                        idle.status(job_id)
                    except UnknownJob:
                        unknown += 1
                    except BrokerError:
                        pass  # no primary to ask just now: not an answer
        identity = producer.identities()["voice_design"]
        completed = 0
        for _, job_id, _ in accepted + via_gateway:
            try:
                if job_id is None or _wait(producer, job_id):
                    completed += 1
            except UnknownJob:
                unknown += 1  # the producer made before the fault calls a job it accepted unknown
                # A Client made now tells a stale read from a loss.
                with Client(settings) as fresh, contextlib.suppress(Exception):
                    completed += bool(fresh.wait(job_id or "", timeout=300))
            except Exception as exc:  # a loss: counted, and the trial goes on
                print(f"  trial {n}: job {job_id} not completed: {type(exc).__name__}: {exc}", file=sys.stderr)
                print(f"  trial {n}: {_whereabouts(topology, job_id or '')}", file=sys.stderr)
        finished = time.monotonic()
        producer.close()
        idle.close()
        every = accepted + via_gateway
        after = [at for _, _, at in every if at > killed]
        keys = {content_key(SynthesisRequest.from_dict({"text": text}), identity) for text, _, _ in every}
        logs = "".join((folder / f"w{w}.log").read_text(errors="replace") for w in (1, 2))
        synthesized = Counter(re.findall(r"job (\S+): synthesized", logs))
        return Trial(
            accepted=len(every),
            refused=len(refused),
            completed=completed,
            lost=len(every) - completed,
            run_twice=sum(1 for count in synthesized.values() if count > 1),
            objects=len(list((folder / "audio").rglob("*.wav"))),
            distinct_keys=len(keys),
            sent_again=logs.count("sent again"),
            unknown=unknown,
            promoted_s=round(promoted - killed, 2),
            first_accept_s=round(min(after) - killed, 2) if after else float("nan"),
            last_result_s=round(finished - killed, 2),
            client_after_promotion_s=_first_after(accepted, killed, promoted),
            gateway_after_promotion_s=_first_after(via_gateway, killed, promoted),
            worker_after_promotion_s=round(stored - promoted, 2),
        )
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        topology.stop()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _answers(node: redis.Redis) -> bool:
    try:
        return bool(node.ping())
    except redis.RedisError:
        return False


def _wait(client: Client, job_id: str) -> bool:
    return bool(client.wait(job_id, timeout=300))


def _first_after(submits: list[tuple[str, str | None, float]], fault: float, promoted: float) -> float:
    """Seconds from the promotion to the first submit accepted after the fault (negative: the harness
    saw the promotion after a producer had already used it)."""
    after = [at for _, _, at in submits if at > fault]
    return round(min(after) - promoted, 2) if after else float("nan")


def _first_result(topology: SentinelTopology, primary: int, ids: Callable[[], list[str]]) -> float:
    """When a worker first stored, on the new primary, the result of a job accepted after the promotion."""
    deadline = time.monotonic() + 120
    with topology.node(primary, db=1) as results:
        while time.monotonic() < deadline:
            if any(results.exists(RESULT_PREFIX + job_id) for job_id in ids()):
                return time.monotonic()
            time.sleep(0.05)
    return float("nan")


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
        "--fault",
        choices=("kill", "pause", "sleep"),
        default="kill",
        help="kill: SIGKILL, restarted at --restart-after; pause: SIGSTOP (a partition), let go at --restart-after; "
        "sleep: DEBUG SLEEP --sleep seconds (default kill)",
    )
    parser.add_argument("--sleep", type=int, default=30, help="seconds of DEBUG SLEEP with --fault sleep (default 30)")
    parser.add_argument("--pause", action="store_true", help="the same as --fault pause (its older spelling)")
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
                fault="pause" if args.pause else args.fault,
                sleep_s=args.sleep,
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
        f"{total['distinct_keys']} distinct keys, {total['sent_again']} sent again by the sweeper, "
        f"{total['unknown']} accepted jobs called unknown by a Client made before the fault"
    )
    for name in (
        "promoted_s",
        "first_accept_s",
        "last_result_s",
        "client_after_promotion_s",
        "gateway_after_promotion_s",
        "worker_after_promotion_s",
    ):
        values = [getattr(t, name) for t in trials]
        print(f"{name}: median {statistics.median(values):.2f}, max {max(values):.2f}")
    return 0 if total["lost"] == total["unknown"] == 0 and total["objects"] == total["distinct_keys"] else 1


def _sum(rows: list[Trial]) -> dict[str, Any]:
    return {
        name: sum(getattr(t, name) for t in rows)
        for name in ("accepted", "refused", "lost", "run_twice", "objects", "distinct_keys", "sent_again", "unknown")
    }


if __name__ == "__main__":
    sys.exit(main())
