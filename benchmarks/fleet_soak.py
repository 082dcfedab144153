"""A compressed soak of the fleet at GPU speed: workers on the stand-in engine, the HTTP gateway and one
Redis, driven for ``--minutes`` by a mix of producers and readers; memory sampled as it runs.

    python benchmarks/fleet_soak.py --minutes 30 --rate 2 --json soak.json   # issue 41, acceptance 6
    python benchmarks/fleet_soak.py --tiny                                   # the smoke test: ~25 s

It starts a private redis-server, a local storage folder, ``--workers`` ``ttsq worker`` processes on the
stand-in engine (``ttsq.testing.standin``, at ``--speed`` times the published H100 figures, as
``benchmarks/fleet.py``) and the gateway (``ttsq serve``) with ``--tenants`` API keys. Jobs arrive at
``--rate`` jobs/s (Poisson), each of distinct text (a cache miss), in a fixed rotation of kinds:

- ``wav``, ``mp3``, ``opus``: whole clips through ``Client.submit``/``wait``;
- ``pcm``: a stream read to its end through ``Client.stream``;
- ``http``: ``POST /v1/audio/speech`` (pcm, wav, mp3, opus in turn) read as fast as it comes;
- ``http-slow``: the same, read 4 KB every half second (it falls behind the stream's window and reads
  the rest from the stored file);
- ``http-silent``: the same, never read, closed after ``--silent-s``;

the gateway's requests spread over the tenants' keys. Every ``--sample-s`` it samples Redis's
``used_memory``, the bytes its stream keys hold (``MEMORY USAGE``), the gateway's and each worker's
resident memory (VmRSS), the jobs accepted and done, and the streams open. After the run, and a grace
for the last jobs, every accepted job's state is read back: a job not ``SUCCESS`` is **lost**; a job id
the workers' logs name as synthesized more than once is **duplicated**.

The report: the memory slope after warm-up (least squares, MB per minute, over the samples after the
first 20 % of the run), Redis bytes per active stream, gateway bytes per open stream, first audio
p50/p95 per kind, lost and duplicated counts, and Redis's keys by pattern at the start and the end (what
grew, if anything did). Nothing here asserts on time or memory: the figures are the output.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# Run as a script, this folder is on the path, not the repository: the helpers come from beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.compare import _cpu_s, _env, _process
from benchmarks.fleet import FILLER, _sleep_until
from benchmarks.soak import rss_kib
from ttsq.config import Settings
from ttsq.constants import STREAM_PREFIX, WORKER_PREFIX
from ttsq.ops.redis_server import RedisServer, free_port

#: One rotation of kinds (every kind within 20 arrivals); the share of each is its count here.
ROTATION = (
    ["wav"] * 3 + ["mp3"] * 2 + ["opus"] * 1 + ["pcm"] * 4 + ["http"] * 5 + ["http-slow"] * 3 + ["http-silent"] * 2
)
KINDS = tuple(dict.fromkeys(ROTATION))
#: The gateway's formats, in turn, for its readers.
HTTP_FORMATS = ("pcm", "wav", "mp3", "opus")
#: What a slow reader takes at a time, and how often.
SLOW_BYTES, SLOW_EVERY_S = 4096, 0.5
#: The worker's log line for each synthesis (``ttsq.worker.pipeline``): a job id twice is a job made twice.
SYNTHESIZED = re.compile(r"job (\S+): synthesized ")
MB = 1024 * 1024


def text_for(run: str, index: int, chars: int) -> str:
    """A distinct text of about ``chars`` characters (14 per second of audio): every job a cache miss."""
    body = (FILLER * (chars // len(FILLER) + 2))[:chars]
    return f"{run} {index}. {body}"


class Ledger:
    """What the driver saw: jobs accepted, finished and failed per kind, first audio, streams open."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accepted: dict[str, str] = {}  # job id -> kind
        self.finished: set[str] = set()
        self.refused: Counter[str] = Counter()
        self.errors: list[str] = []
        self.first_audio_s: dict[str, list[float]] = {}
        self.open_http = 0
        self.open_client_streams = 0
        self.running = 0

    def accept(self, job_id: str, kind: str) -> None:
        with self.lock:
            self.accepted[job_id] = kind

    def finish(self, job_id: str, kind: str, first_audio_s: float | None = None) -> None:
        with self.lock:
            self.finished.add(job_id)
            if first_audio_s is not None:
                self.first_audio_s.setdefault(kind, []).append(first_audio_s)

    def fail(self, kind: str, message: str) -> None:
        with self.lock:
            self.errors.append(f"{kind}: {message[:300]}")

    def add(self, name: str, delta: int) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + delta)


def client_job(client: Any, kind: str, text: str, ledger: Ledger, timeout: float) -> None:
    """A whole clip, or a pcm stream read to its end, through ``Client``."""
    if kind != "pcm":
        job = client.submit(text, format="ogg" if kind == "opus" else kind)
        assert job.id is not None
        ledger.accept(job.id, kind)
        job.wait(timeout)
        ledger.finish(job.id, kind)
        return
    started = time.perf_counter()
    stream = client.stream(text, timeout=timeout)
    assert stream.job.id is not None
    ledger.accept(stream.job.id, kind)
    ledger.add("open_client_streams", 1)
    first: float | None = None
    try:
        for piece in stream:
            if first is None and piece.pcm:
                first = time.perf_counter() - started
    finally:
        ledger.add("open_client_streams", -1)
    if first is None or stream.result is None:
        raise RuntimeError(f"stream {stream.job.id} ended without audio")
    ledger.finish(stream.job.id, kind, first)


def http_job(http: Any, kind: str, body: dict[str, Any], ledger: Ledger, silent_s: float) -> None:
    """``POST /v1/audio/speech`` through the gateway: read at once, slowly, or never."""
    started = time.perf_counter()
    with http.stream("POST", "/v1/audio/speech", json=body) as response:
        if response.status_code != 200:
            response.read()
            with ledger.lock:
                ledger.refused[f"{kind} {response.status_code}"] += 1
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:200]}")
        job_id = response.headers["x-ttsq-job-id"]
        ledger.accept(job_id, kind)
        ledger.add("open_http", 1)
        try:
            if kind == "http-silent":
                time.sleep(silent_s)  # then close unread; the job's own end is read back after the run
                return
            slow = kind == "http-slow"
            first: float | None = None
            received = 0
            for chunk in response.iter_raw(SLOW_BYTES if slow else 65536):
                if first is None and chunk:
                    first = time.perf_counter() - started
                received += len(chunk)
                if slow:
                    time.sleep(SLOW_EVERY_S)
        finally:
            ledger.add("open_http", -1)
    if not received:
        raise RuntimeError(f"job {job_id}: an empty body")
    ledger.finish(job_id, kind, first)


def redis_sample(redis: Any) -> dict[str, int]:
    """Redis's used memory, and the stream keys with the bytes they hold (``MEMORY USAGE``)."""
    info = redis.info("memory")
    keys = list(redis.scan_iter(match=STREAM_PREFIX + "*", count=1000))
    held = ended = 0
    if keys:
        with redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.memory_usage(key, samples=0)
                pipe.xrevrange(key, count=1)
            answers = pipe.execute()
        held = sum(int(size or 0) for size in answers[0::2])
        # A stream whose last entry is its end (or error) is in its grace: its job is done.
        ended = sum(1 for last in answers[1::2] if last and last[0][1].get(b"kind") in (b"end", b"error"))
    return {
        "redis_used_memory": int(info["used_memory"]),
        "redis_rss": int(info["used_memory_rss"]),
        "stream_keys": len(keys),
        "streams_ended": ended,
        "stream_bytes": held,
    }


_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{16,}|\d+")


def key_patterns(url: str, databases: tuple[int, ...] = (0, 1, 2)) -> dict[str, dict[str, int]]:
    """Every key of these databases, grouped by its name with ids and numbers as ``*``: count and bytes."""
    import redis as redis_py

    out: dict[str, dict[str, int]] = {}
    for db in databases:
        client = redis_py.Redis.from_url(f"{url}/{db}")
        try:
            keys = list(client.scan_iter(count=1000))
            sizes: list[Any] = []
            for start in range(0, len(keys), 500):
                with client.pipeline(transaction=False) as pipe:
                    for key in keys[start : start + 500]:
                        pipe.memory_usage(key, samples=0)
                    sizes.extend(pipe.execute())
        finally:
            client.close()
        for key, size in zip(keys, sizes, strict=True):
            pattern = f"db{db} " + _ID.sub("*", key.decode(errors="replace"))
            entry = out.setdefault(pattern, {"keys": 0, "bytes": 0})
            entry["keys"] += 1
            entry["bytes"] += int(size or 0)
    return dict(sorted(out.items(), key=lambda item: -item[1]["bytes"]))


def fit(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(x, y)`` points (nan where x never varies)."""
    if len(points) < 2:
        return float("nan")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else float("nan")


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, value)``, per minute."""
    return fit([(t / 60, value) for t, value in points])


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def _arrivals(rate: float, until: float, seed: int) -> Iterator[int]:
    """Poisson arrivals at ``rate`` jobs/s until ``until`` (perf_counter): yields each arrival's number."""
    rng = random.Random(seed)
    at = time.perf_counter()
    number = 0
    while at < until:
        _sleep_until(at)
        yield number
        number += 1
        at += rng.expovariate(rate)


def _wait_ready(settings: Settings, hostnames: list[str], processes: list[Any], folder: Path) -> None:
    from ttsq.records.connection import connect

    cache = connect(settings.cache_url)
    try:
        deadline = time.monotonic() + 180
        while cache.exists(*(WORKER_PREFIX + name for name in hostnames)) < len(hostnames):
            if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
                raise SystemExit(f"the workers did not start; logs in {folder}")
            time.sleep(0.2)
    finally:
        cache.close()


def traced_gateway(dump: Path, every_s: float, frames: int = 12) -> None:
    """``ttsq serve`` under tracemalloc (``--trace-gateway``): every ``every_s`` seconds, the 25 places whose
    Python memory grew most since the first snapshot go to ``dump`` (what grows, when the RSS does)."""
    import runpy
    import tracemalloc

    tracemalloc.start(frames)

    def dumper() -> None:
        first: tracemalloc.Snapshot | None = None
        started = time.monotonic()
        while True:
            time.sleep(every_s)
            snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
            if first is None:
                first = snapshot
                continue
            lines = [f"--- {time.monotonic() - started:.0f} s, traced {tracemalloc.get_traced_memory()[0] / MB:.1f} MB"]
            for stat in snapshot.compare_to(first, "traceback")[:25]:
                lines.append(f"{stat.size_diff / 1024:+.0f} KB in {stat.count_diff:+d} blocks:")
                lines.extend(f"    {line}" for line in stat.traceback.format()[-frames * 2 :])
            with open(dump, "a") as out:
                out.write("\n".join(lines) + "\n")

    threading.Thread(target=dumper, daemon=True).start()
    sys.argv = ["ttsq", "serve"]
    runpy.run_module("ttsq.cli.main", run_name="__main__")


def _start_gateway(settings: Settings, folder: Path, stack: ExitStack, trace_every_s: float) -> tuple[Any, str]:
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ttsq.cli.main", "serve"]
    if trace_every_s:
        dump = folder / "gateway-tracemalloc.txt"
        command = [sys.executable, __file__, "--as-traced-gateway", str(dump), "--sample-s", str(trace_every_s)]
    gateway = stack.enter_context(
        _process(
            command,
            _env(settings.replace(gateway_port=port), TTSQ_LOG_LEVEL="WARNING"),
            folder / "gateway.log",
        )
    )
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return gateway, url
        except httpx.HTTPError:
            pass
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the gateway did not start; its log: {folder / 'gateway.log'}")
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx
    import redis as redis_py

    from ttsq.client import Client
    from ttsq.gateway.apikeys import ApiKeys

    a_us = round(Settings().standin_a_us / args.speed)
    b_us = round(Settings().standin_b_us / args.speed)
    run_id = f"soak-{os.getpid()}-{int(time.time())}"
    with ExitStack() as stack:
        folder = (
            Path(args.keep)
            if args.keep
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-fleet-soak-")))
        )
        folder.mkdir(parents=True, exist_ok=True)
        server = RedisServer().start()
        stack.callback(server.stop)
        assert server.process is not None
        settings = Settings(
            broker_url=f"{server.url}/0",
            result_backend=f"{server.url}/1",
            cache_url=f"{server.url}/2",
            storage_url=str(folder / "audio"),
            engine="standin",
            standin_a_us=a_us,
            standin_b_us=b_us,
            max_batch=args.max_batch,
            queue="fleetsoak",
            metrics_port=0,
            log_level="INFO",  # the workers' "synthesized" lines are how a job made twice is seen
        )
        hostnames = [f"soak{n}@bench" for n in range(args.workers)]
        workers = [
            stack.enter_context(
                _process(
                    [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", name],
                    _env(settings),
                    folder / f"worker{n}.log",
                )
            )
            for n, name in enumerate(hostnames)
        ]
        _wait_ready(settings, hostnames, workers, folder)
        gateway, url = _start_gateway(settings, folder, stack, args.trace_gateway)
        cache = redis_py.Redis.from_url(settings.cache_url)
        stack.callback(cache.close)
        keys = ApiKeys(cache)
        tokens = [keys.add(f"tenant{n}-{run_id}")[0] for n in range(args.tenants)]
        https = [
            stack.enter_context(
                httpx.Client(
                    base_url=url,
                    headers={"Authorization": f"Bearer {token}"},
                    timeout=args.timeout,
                    # An idle connection is dropped well before uvicorn's own 5 s keep-alive timeout: reused
                    # at the moment the server closes it, a POST fails unsent ("Server disconnected without
                    # sending a response"; seen once in 2,300 requests), and a POST is not retried.
                    limits=httpx.Limits(max_connections=None, max_keepalive_connections=32, keepalive_expiry=2.0),
                )
            )
            for token in tokens
        ]
        clients = [Client(settings) for _ in range(args.clients)]
        for client in clients:
            stack.callback(client.close)
        # Warm every path once, untimed and uncounted: the first stream's imports and encoders.
        clients[0].submit("Warm up, please.").wait(args.timeout)
        for fmt in HTTP_FORMATS:
            https[0].post(
                "/v1/audio/speech", json={"model": "tts-1", "input": f"Warm up {fmt}.", "response_format": fmt}
            )
        time.sleep(2.0)
        patterns_before = key_patterns(server.url)
        pids = {
            "gateway": gateway.pid,
            "redis": server.process.pid,
            **{f"worker{n}": w.pid for n, w in enumerate(workers)},
        }
        print(
            f"fleet soak: {args.workers} worker(s), stand-in a={a_us} us b={b_us} us per audio-s "
            f"(published H100 / {args.speed:g}), max batch {args.max_batch}, gateway with {args.tenants} tenants, "
            f"Poisson {args.rate:g} jobs/s for {args.minutes:g} min, {args.chars} chars a job; folder {folder}",
            flush=True,
        )

        ledger = Ledger()
        samples: list[dict[str, Any]] = []
        stop_sampling = threading.Event()
        started = time.perf_counter()

        def sample() -> None:
            row: dict[str, Any] = {"t_s": round(time.perf_counter() - started, 1)}
            row.update(redis_sample(cache))
            row["gateway_rss"] = rss_kib(gateway.pid) * 1024
            row["worker_rss"] = [rss_kib(w.pid) * 1024 for w in workers]
            row["cpu_s"] = {name: round(_cpu_s(pid), 2) for name, pid in pids.items()}
            with ledger.lock:
                row.update(
                    accepted=len(ledger.accepted),
                    finished=len(ledger.finished),
                    errors=len(ledger.errors),
                    running=ledger.running,
                    open_http=ledger.open_http,
                    open_client_streams=ledger.open_client_streams,
                )
            samples.append(row)

        def sampler() -> None:
            next_at = time.perf_counter()
            while not stop_sampling.is_set():
                try:
                    sample()
                except Exception as exc:  # a failed sample is a gap, not the end of the run
                    ledger.fail("sampler", f"{type(exc).__name__}: {exc}")
                last = samples[-1] if samples else None
                if last is not None and len(samples) % max(1, round(60 / args.sample_s)) == 1:
                    print(
                        f"{last['t_s']:>7.0f} s  redis {last['redis_used_memory'] / MB:6.1f} MB "
                        f"({last['stream_keys']} streams, {last['stream_bytes'] / 1024:.0f} KB)  "
                        f"gateway {last['gateway_rss'] / MB:6.1f} MB ({last['open_http']} open)  workers "
                        + " ".join(f"{r / MB:.0f}" for r in last["worker_rss"])
                        + f" MB  jobs {last['finished']}/{last['accepted']}, {last['errors']} errors",
                        flush=True,
                    )
                next_at += args.sample_s
                stop_sampling.wait(max(0.0, next_at - time.perf_counter()))

        def job(number: int) -> None:
            kind = ROTATION[number % len(ROTATION)]
            text = text_for(run_id, number, args.chars)
            ledger.add("running", 1)
            try:
                if kind.startswith("http"):
                    fmt = HTTP_FORMATS[(number // len(ROTATION)) % len(HTTP_FORMATS)]
                    body = {"model": "tts-1", "input": text, "response_format": fmt}
                    http_job(https[number % len(https)], kind, body, ledger, args.silent_s)
                else:
                    client_job(clients[number % len(clients)], kind, text, ledger, args.timeout)
            except Exception as exc:
                ledger.fail(kind, f"{type(exc).__name__}: {exc}")
            finally:
                ledger.add("running", -1)

        sampling = threading.Thread(target=sampler, daemon=True)
        sampling.start()
        threads: list[threading.Thread] = []
        arrivals = 0
        for number in _arrivals(args.rate, started + args.minutes * 60, seed=7):
            thread = threading.Thread(target=job, args=(number,), daemon=True)
            thread.start()
            threads.append(thread)
            arrivals = number + 1
            if number % 100 == 0:  # the finished ones go; the list stays as long as the work in flight
                threads = [t for t in threads if t.is_alive()]
        load_end = time.perf_counter() - started
        drain_by = time.monotonic() + args.timeout
        for thread in threads:
            thread.join(max(0.1, drain_by - time.monotonic()))
        still_running = sum(1 for t in threads if t.is_alive())
        time.sleep(args.grace_s)  # the silent readers' jobs, and the streams' own grace after their end
        sample()
        stop_sampling.set()
        sampling.join(30)
        patterns_after = key_patterns(server.url)

        # Every accepted job's state, read back from Redis: what was accepted and has no result is lost.
        states: Counter[str] = Counter()
        lost: list[str] = []
        with ledger.lock:
            accepted = dict(ledger.accepted)
        for job_id, kind in accepted.items():
            try:
                state = clients[0].status(job_id)["state"]
            except Exception as exc:
                state = type(exc).__name__
            states[state] += 1
            if state != "SUCCESS":
                lost.append(f"{kind} {job_id} {state}")
        synthesized: Counter[str] = Counter()
        for n in range(args.workers):
            text = (folder / f"worker{n}.log").read_text(errors="replace")
            synthesized.update(SYNTHESIZED.findall(text))
        duplicated = sorted(job_id for job_id, count in synthesized.items() if count > 1)
        alive = {
            name: p.poll() is None
            for name, p in [("gateway", gateway), *[(f"worker{n}", w) for n, w in enumerate(workers)]]
        }

    return summarize(
        args,
        samples=samples,
        load_end=load_end,
        ledger=ledger,
        arrivals=arrivals,
        still_running=still_running,
        states=states,
        lost=lost,
        synthesized=synthesized,
        duplicated=duplicated,
        alive=alive,
        patterns_before=patterns_before,
        patterns_after=patterns_after,
        config={"a_us": a_us, "b_us": b_us, "cores": len(os.sched_getaffinity(0))},
    )


def summarize(
    args: argparse.Namespace, *, samples: list[dict[str, Any]], load_end: float, ledger: Ledger, **found: Any
) -> dict[str, Any]:
    """The figures from the samples and what the run found; printed, and returned for ``--json``."""
    warm_from = 0.2 * load_end
    steady = [s for s in samples if warm_from <= s["t_s"] <= load_end]
    rest = samples[0]

    def slope(metric: Any) -> float:
        return slope_per_min([(s["t_s"], metric(s) / MB) for s in steady])

    slopes = {
        "redis_used_memory": slope(lambda s: s["redis_used_memory"]),
        "redis_rss": slope(lambda s: s["redis_rss"]),
        "gateway_rss": slope(lambda s: s["gateway_rss"]),
        **{f"worker{n}_rss": slope(lambda s, n=n: s["worker_rss"][n]) for n in range(args.workers)},
    }
    with_streams = [s for s in steady if s["stream_keys"]]
    with_http = [s for s in steady if s["open_http"]]
    first_audio = {
        kind: {
            "count": len(values),
            "p50_ms": 1000 * percentile(values, 0.5),
            "p95_ms": 1000 * percentile(values, 0.95),
        }
        for kind, values in sorted(ledger.first_audio_s.items())
    }
    lost, duplicated = found["lost"], found["duplicated"]
    accepted = len(ledger.accepted)
    kinds = Counter(ledger.accepted.values())
    last = samples[-1]
    report: dict[str, Any] = {
        "ttsq_fleet_soak": 1,
        "config": {
            **found["config"],
            "minutes": args.minutes,
            "rate": args.rate,
            "workers": args.workers,
            "tenants": args.tenants,
            "max_batch": args.max_batch,
            "speed": args.speed,
            "chars": args.chars,
            "sample_s": args.sample_s,
            "grace_s": args.grace_s,
            "silent_s": args.silent_s,
            "rotation": dict(Counter(ROTATION)),
            "load_average_end": os.getloadavg(),
        },
        "load_s": round(load_end, 1),
        "arrivals": found["arrivals"],
        "accepted": accepted,
        "accepted_by_kind": dict(kinds),
        "finished_by_driver": len(ledger.finished),
        "still_running_at_drain": found["still_running"],
        "errors": len(ledger.errors),
        "first_errors": ledger.errors[:10],
        "refused": dict(ledger.refused),
        "states": dict(found["states"]),
        "lost": len(lost),
        "lost_jobs": lost[:20],
        "synthesized_jobs": len(found["synthesized"]),
        "syntheses": sum(found["synthesized"].values()),
        "duplicated": len(duplicated),
        "duplicated_jobs": duplicated[:20],
        "processes_alive": found["alive"],
        "slope_mb_per_min_after_warmup": slopes,
        "redis_bytes_per_active_stream": statistics.median(s["stream_bytes"] / s["stream_keys"] for s in with_streams)
        if with_streams
        else None,
        "redis_used_memory_per_active_stream": statistics.median(
            (s["redis_used_memory"] - rest["redis_used_memory"]) / s["stream_keys"] for s in with_streams
        )
        if with_streams
        else None,
        "active_streams_median": statistics.median(s["stream_keys"] for s in steady) if steady else None,
        "active_streams_max": max((s["stream_keys"] for s in samples), default=0),
        # Of the stream keys, those whose job is over and that wait out their grace (TTSQ_STREAM_GRACE_S).
        "streams_in_grace_median": statistics.median(s["streams_ended"] for s in steady) if steady else None,
        # How memory follows the streams, sample to sample after warm-up (least squares): Redis's used memory
        # against its stream keys, the gateway's RSS against its open streams. Near 0 for the gateway
        # means its memory does not follow the streams open at this scale (bounded per reader).
        "redis_bytes_per_stream_fit": fit([(s["stream_keys"], s["redis_used_memory"]) for s in steady]),
        "gateway_bytes_per_open_stream": fit([(s["open_http"], s["gateway_rss"]) for s in steady]),
        # An upper bound, not a per-stream cost: the gateway's RSS above its start (its warm-up included)
        # over the streams open.
        "gateway_rss_above_start_per_open_stream": statistics.median(
            (s["gateway_rss"] - rest["gateway_rss"]) / s["open_http"] for s in with_http
        )
        if with_http
        else None,
        "open_http_median": statistics.median(s["open_http"] for s in steady) if steady else None,
        "open_http_max": max((s["open_http"] for s in samples), default=0),
        "memory_mb": {
            "redis_used_start": rest["redis_used_memory"] / MB,
            "redis_used_end": last["redis_used_memory"] / MB,
            "redis_used_max": max(s["redis_used_memory"] for s in samples) / MB,
            "gateway_rss_start": rest["gateway_rss"] / MB,
            "gateway_rss_end": last["gateway_rss"] / MB,
            "gateway_rss_max": max(s["gateway_rss"] for s in samples) / MB,
            "worker_rss_start": [r / MB for r in rest["worker_rss"]],
            "worker_rss_end": [r / MB for r in last["worker_rss"]],
        },
        "cpu_s": {name: last["cpu_s"][name] - rest["cpu_s"][name] for name in rest["cpu_s"]},
        "first_audio": first_audio,
        "redis_keys_before": found["patterns_before"],
        "redis_keys_after": found["patterns_after"],
        "samples": samples,
    }
    print(
        f"\n{accepted} jobs accepted of {found['arrivals']} arrivals in {load_end / 60:.1f} min "
        f"({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}); {len(ledger.errors)} errors, "
        f"refused {dict(ledger.refused) or 0}; lost {len(lost)}, duplicated {len(duplicated)} "
        f"({report['syntheses']} syntheses of {report['synthesized_jobs']} jobs)"
    )
    print(
        "slope after warm-up, MB/min: " + ", ".join(f"{name} {value:+.3f}" for name, value in slopes.items()),
    )
    per_stream = report["redis_bytes_per_active_stream"]
    per_http = report["gateway_rss_above_start_per_open_stream"]
    print(
        f"Redis per active stream: {per_stream / 1024:.0f} KB held by its key, "
        f"{report['redis_bytes_per_stream_fit'] / 1024:.0f} KB of used memory per stream key (fit)"
        if per_stream is not None
        else "Redis per active stream: no stream seen in a sample",
        f"(median {report['active_streams_median']} stream keys, {report['streams_in_grace_median']} of them "
        f"in their grace after the end, at most {report['active_streams_max']}); "
        + (
            f"gateway RSS per open stream (fit) {report['gateway_bytes_per_open_stream'] / 1024:.0f} KB, "
            f"above its start per open stream: {per_http / 1024:.0f} KB "
            f"(median {report['open_http_median']} open, at most {report['open_http_max']})"
            if per_http is not None
            else "no gateway stream open in a sample"
        ),
    )
    memory = report["memory_mb"]
    print(
        f"Redis used {memory['redis_used_start']:.1f} -> {memory['redis_used_end']:.1f} MB "
        f"(max {memory['redis_used_max']:.1f}); gateway RSS {memory['gateway_rss_start']:.1f} -> "
        f"{memory['gateway_rss_end']:.1f} MB (max {memory['gateway_rss_max']:.1f}); "
        "workers "
        + ", ".join(
            f"{a:.0f} -> {b:.0f}" for a, b in zip(memory["worker_rss_start"], memory["worker_rss_end"], strict=True)
        )
        + " MB"
    )
    print(
        "first audio p50/p95: "
        + ", ".join(f"{k} {v['p50_ms']:.0f}/{v['p95_ms']:.0f} ms (n={v['count']})" for k, v in first_audio.items())
    )
    grown = _grown(found["patterns_before"], found["patterns_after"])
    print(
        "Redis keys that grew most: "
        + ("; ".join(f"{p} +{d['keys']} keys +{d['bytes'] / 1024:.0f} KB" for p, d in grown[:5]) or "none")
    )
    if ledger.errors:
        print("first errors: " + " | ".join(ledger.errors[:3]))
    return report


def _grown(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> list[tuple[str, dict[str, int]]]:
    rows = []
    for pattern, entry in after.items():
        old = before.get(pattern, {"keys": 0, "bytes": 0})
        rows.append((pattern, {"keys": entry["keys"] - old["keys"], "bytes": entry["bytes"] - old["bytes"]}))
    return sorted(rows, key=lambda row: -row[1]["bytes"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long jobs arrive")
    parser.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, jobs/s in all")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tenants", type=int, default=3, help="API keys the gateway's requests spread over")
    parser.add_argument("--clients", type=int, default=2, help="Client objects the producers share")
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--chars", type=int, default=100, help="characters per job (14 per second of audio)")
    parser.add_argument("--speed", type=float, default=10.0, help="the device this many times the published H100")
    parser.add_argument("--sample-s", type=float, default=10.0, help="seconds between samples")
    parser.add_argument("--silent-s", type=float, default=15.0, help="a silent reader closes after this")
    parser.add_argument("--grace-s", type=float, default=40.0, help="after the last job, before reading states back")
    parser.add_argument("--timeout", type=float, default=300.0, help="a job's limit, and the drain's")
    parser.add_argument("--keep", help="keep the storage and logs in this folder")
    parser.add_argument("--tiny", action="store_true", help="the smoke test: ~25 s, figures meaningless")
    parser.add_argument("--json", dest="json_path", help="also write the report here")
    parser.add_argument(
        "--trace-gateway",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="run the gateway under tracemalloc and write what grew every SECONDS to gateway-tracemalloc.txt "
        "in the run's folder (slower: a diagnosis, not a figure)",
    )
    parser.add_argument("--as-traced-gateway", metavar="DUMP", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_traced_gateway:
        traced_gateway(Path(args.as_traced_gateway), args.sample_s)
        return 0
    if args.tiny:
        args.minutes, args.rate, args.sample_s, args.silent_s, args.grace_s = 0.25, 3.0, 1.0, 2.0, 3.0
        args.workers, args.chars, args.max_batch, args.timeout = 1, 40, 8, 120.0
    report = run(args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
