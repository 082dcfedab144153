"""The HTTP gateway against ``Client.submit`` on the same deployment, side by side in one run.

One redis-server, two ``ttsq worker`` processes (espeak, local storage) and one ``ttsq serve`` process.
Measured, each pair interleaved on the same deployment:

- **added latency, cache hits**: ``Client.submit`` of a cached request (a Redis look-up and a signed
  URL) against ``POST /v1/jobs`` of the same request through the gateway (HTTP, the key check, the same
  look-up): p50 and p99, and the difference;
- **added latency, synthesized jobs**: ``Client.submit(...).wait()`` against ``POST /generate`` (submit,
  wait asynchronously, the result JSON), one job at a time;
- **throughput at concurrency 64**: distinct jobs, 64 in flight, through each path (jobs/s); the gateway
  path twice, with httpx as the load generator and with a minimal HTTP/1.1 keep-alive client (on one
  2-core machine the load generator's own CPU is taken from the workers). The three paths run in turn
  for ``--rounds`` rounds and each reports its median round, with the CPU a job costs in this process
  (the producer, or the HTTP client), in the gateway and in the workers;
- **1,000 concurrent waiting requests** on the one gateway process: all answered; the gateway's peak
  memory (RSS) and open file descriptors while they wait.

    python benchmarks/gateway.py   # --hits 400 --jobs 40 --throughput 300 --rounds 3 --waiting 1000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.gateway.apikeys import ApiKeys
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer, free_port
from ttsq.records.connection import connect


def env_of(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    env.update({f"TTSQ_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(settings)})
    return env


def percentiles(values: list[float]) -> dict[str, float]:
    data = np.asarray(values) * 1000
    return {"p50_ms": round(float(np.percentile(data, 50)), 2), "p99_ms": round(float(np.percentile(data, 99)), 2)}


def cpu_seconds(pid: int) -> float:
    """User and system CPU a process has used, in seconds."""
    fields_ = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields_[11]) + int(fields_[12])) / os.sysconf("SC_CLK_TCK")


def _cpu(procs: list[subprocess.Popen[bytes]]) -> float:
    return sum(cpu_seconds(proc.pid) for proc in procs)


def process_figures(pid: int) -> tuple[int, int]:
    """(RSS in bytes, open file descriptors) of a process."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hits", type=int, default=400, help="cache-hit requests per path (default 400)")
    parser.add_argument("--jobs", type=int, default=40, help="synthesized jobs per path, one at a time (40)")
    parser.add_argument("--throughput", type=int, default=300, help="jobs per path and round at concurrency 64 (300)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three throughput paths (3)")
    parser.add_argument("--waiting", type=int, default=1000, help="concurrent waiting requests (1000)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ttsq-gateway-bench-") as root:
        figures = run(Path(root), args)
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    hits, jobs = figures["cache_hit"], figures["synthesized"]
    print(f"{'':<28}{'Client.submit':>16}{'gateway':>16}{'added':>12}")
    for name, row in (("cache hit, p50", hits), ("synthesized job, p50", jobs)):
        print(
            f"{name:<28}{row['client']['p50_ms']:>13.2f} ms{row['gateway']['p50_ms']:>13.2f} ms"
            f"{row['gateway']['p50_ms'] - row['client']['p50_ms']:>9.2f} ms"
        )
        print(
            f"{name.replace('p50', 'p99'):<28}{row['client']['p99_ms']:>13.2f} ms{row['gateway']['p99_ms']:>13.2f} ms"
            f"{row['gateway']['p99_ms'] - row['client']['p99_ms']:>9.2f} ms"
        )
    tp, spent = figures["throughput_c64"], figures["cpu_ms_per_job"]
    print(
        f"\njobs/s at concurrency 64 (median of {args.rounds} rounds)      ratio   CPU ms a job: here gateway workers"
    )
    for name, label in (
        ("client", "Client.submit"),
        ("gateway", "gateway, httpx as the load generator"),
        ("gateway_minimal_client", "gateway, a minimal HTTP/1.1 client"),
    ):
        rounds = " ".join(f"{v:.0f}" for v in figures["throughput_rounds"][name])
        print(
            f"  {label:<38}{tp[name]:>7.1f}  ({rounds:<11}) {tp[name] / tp['client']:>5.2f}x"
            f"{spent[name]['here']:>9.2f}{spent[name]['gateway']:>8.2f}{spent[name]['workers']:>8.2f}"
        )
    w = figures["waiting"]
    print(
        f"\n{w['requests']} concurrent waiting requests on one gateway: {w['answered']} answered in "
        f"{w['wall_s']:.1f} s; "
        f"gateway RSS {w['rss_mb_before']:.0f} MB idle, {w['rss_mb_peak']:.0f} MB peak; "
        f"open fds {w['fds_before']} idle, {w['fds_peak']} peak"
    )
    return 0


def run(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    server = RedisServer(directory=str(root / "redis"))
    (root / "redis").mkdir()
    server.start()
    url = server.url
    settings = Settings(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        cache_url=f"{url}/2",
        storage_url=str(root / "audio"),
        max_batch=16,
        max_wait_ms=10,
        metrics_port=0,
        log_level="WARNING",
        gateway_port=free_port(),
        gateway_max_queue=0,
        gateway_wait_s=600,
    )
    env = env_of(settings)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", f"w{n}@bench"],
            env=env,
            stdout=open(root / f"w{n}.log", "wb"),  # noqa: SIM115 - lives with the process
            stderr=subprocess.STDOUT,
        )
        for n in (1, 2)
    ]
    gateway = subprocess.Popen(
        [sys.executable, "-m", "ttsq.cli.main", "serve", "--log-level", "warning"],
        env=env,
        stdout=open(root / "gateway.log", "wb"),  # noqa: SIM115 - lives with the process
        stderr=subprocess.STDOUT,
    )
    procs.append(gateway)
    base = f"http://127.0.0.1:{settings.gateway_port}"
    try:
        cache = connect(settings.cache_url)
        deadline = time.monotonic() + 120
        while not cache.exists(FLEET_PREFIX + settings.queue) or not _up(base):
            if time.monotonic() > deadline:
                raise SystemExit(f"deployment did not start; see {root}")
            time.sleep(0.2)
        token, _ = ApiKeys(cache).add("bench")
        headers = {"Authorization": f"Bearer {token}"}
        client = Client(settings)
        run_id = uuid.uuid4().hex[:6]
        figures: dict[str, Any] = {}

        # Cache hits: the same cached request through each path, interleaved.
        text = f"A cached sentence for the gateway benchmark {run_id}."
        client.submit(text, language="english").wait(60)
        with httpx.Client(base_url=base, headers=headers, timeout=60) as http:
            for _ in range(20):  # warm both paths
                client.submit(text, language="english")
                http.post("/v1/jobs", json={"text": text, "language": "english"})
            direct, through = [], []
            for _ in range(args.hits):
                started = time.perf_counter()
                assert client.submit(text, language="english").cached
                direct.append(time.perf_counter() - started)
                started = time.perf_counter()
                assert http.post("/v1/jobs", json={"text": text, "language": "english"}).json()["result"]["cached"]
                through.append(time.perf_counter() - started)
            figures["cache_hit"] = {"client": percentiles(direct), "gateway": percentiles(through)}

            # Synthesized jobs, one at a time.
            direct, through = [], []
            for n in range(args.jobs):
                started = time.perf_counter()
                client.submit(f"Synthesized through the client, {n} {run_id}.", language="english").wait(120)
                direct.append(time.perf_counter() - started)
                started = time.perf_counter()
                response = http.post(
                    "/generate", json={"text": f"Synthesized through the gateway, {n} {run_id}.", "language": "english"}
                )
                assert response.status_code == 200, response.text
                through.append(time.perf_counter() - started)
            figures["synthesized"] = {"client": percentiles(direct), "gateway": percentiles(through)}

        # Throughput at concurrency 64, distinct jobs: the three paths in turn, round after round (on a
        # shared 2-core machine one run of each drifts by 20 %); the median round of each, and the CPU
        # each path costs a job, counted where it is spent.
        def client_round(tag: str) -> float:
            def one(n: int) -> None:
                client.submit(f"Throughput job {n} through the client {tag}.", language="english").wait(300)

            started = time.perf_counter()
            with ThreadPoolExecutor(64) as pool:
                list(pool.map(one, range(args.throughput)))
            return float(args.throughput / (time.perf_counter() - started))

        paths: dict[str, Callable[[str], float]] = {
            "client": client_round,
            "gateway": lambda tag: asyncio.run(_gateway_rate(base, headers, args.throughput, tag, raw=False)),
            "gateway_minimal_client": lambda tag: asyncio.run(
                _gateway_rate(base, headers, args.throughput, tag, raw=True)
            ),
        }
        rates: dict[str, list[float]] = {name: [] for name in paths}
        cpu: dict[str, dict[str, list[float]]] = {name: {"here": [], "gateway": [], "workers": []} for name in paths}
        for round_ in range(args.rounds):
            for name, path in paths.items():
                here, there, workers = time.process_time(), cpu_seconds(gateway.pid), _cpu(procs[:-1])
                rates[name].append(path(f"{run_id}-{round_}"))
                cpu[name]["here"].append((time.process_time() - here) / args.throughput)
                cpu[name]["gateway"].append((cpu_seconds(gateway.pid) - there) / args.throughput)
                cpu[name]["workers"].append((_cpu(procs[:-1]) - workers) / args.throughput)
        figures["throughput_c64"] = {name: round(float(np.median(values)), 2) for name, values in rates.items()}
        figures["throughput_rounds"] = {name: [round(v, 1) for v in values] for name, values in rates.items()}
        figures["cpu_ms_per_job"] = {
            name: {where: round(float(np.median(values)) * 1000, 2) for where, values in spent.items()}
            for name, spent in cpu.items()
        }

        # 1,000 concurrent requests waiting on one gateway process.
        rss_before, fds_before = process_figures(gateway.pid)
        peak = [rss_before, fds_before]
        stop = threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                rss, fds = process_figures(gateway.pid)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], fds)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        answered = asyncio.run(_waiting(base, headers, args.waiting, run_id))
        wall = time.perf_counter() - started
        stop.set()
        sampler.join()
        figures["waiting"] = {
            "requests": args.waiting,
            "answered": answered,
            "wall_s": round(wall, 2),
            "rss_mb_before": rss_before / 2**20,
            "rss_mb_peak": peak[0] / 2**20,
            "fds_before": fds_before,
            "fds_peak": peak[1],
        }
        client.close()
        return figures
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        server.stop()


def _up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


async def _gateway_rate(base: str, headers: dict[str, str], count: int, run_id: str, *, raw: bool) -> float:
    """Jobs/s through ``POST /generate`` at concurrency 64: with httpx, or (``raw``) with a minimal
    HTTP/1.1 keep-alive client whose own CPU is next to nothing (on a 2-core machine the load generator
    competes with the workers; httpx costs about 3 ms of CPU a request)."""
    texts = [f"Throughput job {n} through the gateway{' raw' if raw else ''} {run_id}." for n in range(count)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in texts:
        queue.put_nowait(text)
    started = time.perf_counter()
    if raw:
        await asyncio.gather(*(_raw_sender(base, headers, queue) for _ in range(64)))
    else:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300, limits=limits) as http:

            async def sender() -> None:
                while not queue.empty():
                    response = await http.post("/generate", json={"text": queue.get_nowait(), "language": "english"})
                    assert response.status_code == 200, response.text

            await asyncio.gather(*(sender() for _ in range(64)))
    return count / (time.perf_counter() - started)


async def _raw_sender(base: str, headers: dict[str, str], queue: asyncio.Queue[str]) -> None:
    """POST /generate over one kept-alive connection until the queue is empty."""
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    auth = headers["Authorization"]
    try:
        while not queue.empty():
            body = json.dumps({"text": queue.get_nowait(), "language": "english"}).encode()
            writer.write(
                f"POST /generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: {auth}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
            )
            payload = await reader.readexactly(length)
            assert status == 200, payload[:200]
    finally:
        writer.close()


async def _waiting(base: str, headers: dict[str, str], count: int, run_id: str) -> int:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    failures: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600, limits=limits) as http:

        async def one(n: int) -> bool:
            body = {"text": f"Waiting request {n} of {count} {run_id}.", "language": "english"}
            try:
                response = await http.post("/generate", json=body)
            except httpx.HTTPError as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                return False
            if response.status_code != 200:
                reason = f"{response.status_code} {response.text[:120]}"
                failures[reason] = failures.get(reason, 0) + 1
            return response.status_code == 200

        answered = sum(await asyncio.gather(*(one(n) for n in range(count))))
    if failures:
        print(f"failed requests: {failures}", file=sys.stderr)
    return answered


if __name__ == "__main__":
    sys.exit(main())
