"""Streaming against the whole clip, side by side in one run: time to first audio, real-time factor and
playback underruns at 1, 4, 8 and 16 concurrent streams.

    python benchmarks/streaming.py [--engine espeak|qwen-fast] [--via client|gateway] [--concurrency 1,4,8,16]
        [--model CHECKPOINT --device cuda --max-batch 64]   # qwen-fast on real or full-size weights

One private redis-server, one ``ttsq worker`` (local storage) and, with ``--via gateway``, one ``ttsq
serve`` read through the official ``openai`` package (``with_streaming_response``, ``stream_format:
"audio"``, pcm). For each concurrency, in the same run:

- **streamed**: that many requests at once, each a cache miss, each read as a player would: time to
  first audio (p50/p95), the real-time factor (seconds to the last piece per second of audio), and
  underruns (a player that started at the first piece and plays in real time runs dry: count and
  seconds);
- **whole clip**: the same number of requests for whole files (``Client.submit(...).wait()`` and the
  download, or the gateway's plain response): time to the last byte (p50/p95);
- **the floor**: the engine's own first piece in this process, no queue (measured once, first).

``--redis-bytes N`` measures instead what Redis holds per stream being made (docs/deployment.md, "Redis
sizing"): N streams of ``--clip-s`` seconds of 24 kHz audio written by the worker's own ``StreamWriter``
into a private redis-server, left open (no ``end``: streams being made), Redis's ``used_memory`` over
N; in the same run the same streams kept whole (what every stream held before it kept a window); then
per stream ended and waiting out its grace (its ``end`` trims it to the window), and at rest: after
``TTSQ_STREAM_GRACE_S``.

    python benchmarks/streaming.py --redis-bytes 50 [--clip-s 60] [--window-s 5]

espeak is too fast for one clip to show anything: its requests are documents (``--doc-chars``, 8,000 by
default), which stream chunk by chunk. qwen-fast runs a tiny random-weight checkpoint on the CPU (or
``TTSQ_QWEN_MODEL``), each clip capped at ``--frames`` codec frames (125: ten seconds).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from ttsq.config import Settings
from ttsq.constants import FLEET_PREFIX
from ttsq.ops.preflight import require_command_line
from ttsq.ops.redis_server import RedisServer, free_port, parent_death_signal
from ttsq.records.connection import connect

ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_SAMPLE = 2


@dataclass
class Played:
    """One request read as a player reads it."""

    first_s: float  # request sent -> first audio byte
    last_s: float  # request sent -> last byte
    audio_s: float
    underruns: int
    underrun_s: float


class Player:
    """Counts underruns: playback starts with the first piece and runs in real time."""

    def __init__(self, rate: int, started: float) -> None:
        self.rate, self.started = rate, started
        self.first: float | None = None
        self.audio_s = 0.0
        self.stall_s = 0.0
        self.underruns = 0

    def piece(self, nbytes: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            due = self.first + self.audio_s + self.stall_s  # when the player needs this piece
            if now > due:
                self.underruns += 1
                self.stall_s += now - due
        self.audio_s += nbytes / BYTES_PER_SAMPLE / self.rate

    def done(self) -> Played:
        now = time.perf_counter()
        first = (self.first or now) - self.started
        return Played(first, now - self.started, self.audio_s, self.underruns, self.stall_s)


def _env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    env.update({f"TTSQ_{f.name.upper()}": str(getattr(settings, f.name)) for f in fields(settings)})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _start(stack: ExitStack, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, preexec_fn=parent_death_signal()
        )

    def stop() -> None:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()

    stack.callback(stop)
    return process


def floor_s(settings: Settings, request: dict[str, Any], runs: int = 5) -> float:
    """The engine's own first piece in this process: no queue, no Redis (median of ``runs``)."""
    from ttsq.engines import create_engine
    from ttsq.job import SynthesisRequest

    engine = create_engine(settings)
    engine.load()
    engine.warmup()
    times = []
    try:
        for _ in range(runs):
            req = SynthesisRequest.from_dict({**request, "stream": True})
            first: list[float] = []
            started = time.perf_counter()

            def piece(samples: Any, first: list[float] = first) -> None:
                if samples is not None and not first:
                    first.append(time.perf_counter())

            if callable(getattr(engine, "admit", None)):
                finished = threading.Event()
                engine.admit(req, lambda _, done=finished: done.set(), piece=piece)  # type: ignore[attr-defined]
                # Step while the row decodes; once it has left the loop its first piece and its answer
                # come from the codec thread: wait for them rather than spin on an idle loop (11 million
                # empty steps in a dry run, CPU and the GIL taken from the codec thread being timed).
                while not finished.is_set():  # let the row end before the next run
                    if engine.active:  # type: ignore[attr-defined]
                        engine.step()  # type: ignore[attr-defined]
                    else:
                        finished.wait(0.001)
            else:
                engine.synthesize_batch([req], pieces=[piece])  # type: ignore[call-arg]
            times.append((first[0] if first else time.perf_counter()) - started)
    finally:
        engine.close()
    return statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    with ExitStack() as stack:
        folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-streaming-")))
        redis = RedisServer().start()
        stack.callback(redis.stop)
        settings = Settings.from_env(
            broker_url=f"{redis.url}/0",
            result_backend=f"{redis.url}/1",
            cache_url=f"{redis.url}/2",
            engine=args.engine,
            storage_url=str(folder / "audio"),
            queue="bench-stream",
            metrics_port=0,
            log_level="WARNING",
            gateway_port=free_port(),
            gateway_max_queue=0,
            gateway_wait_s=600,
            max_batch=max(args.max_batch, *args.concurrency),
            qwen_device=args.device,
            **({"qwen_model": args.model} if args.model else {}),
        )
        base: dict[str, Any] = {"language": "english"}
        if args.engine == "qwen-fast":
            if not settings.qwen_model:
                from ttsq.testing.qwen_checkpoint import build

                settings = settings.replace(qwen_model=str(build(folder / "tiny-qwen", "voice_design")))
            base["max_new_tokens"] = args.frames
            text = "Streaming speech arrives while the rest of the sentence is still being made, piece by piece."
        else:
            text = _corpus(args.doc_chars)
        floor = floor_s(settings, {"text": text[: settings.max_text_chars], **base})
        env = _env(settings)
        _start(stack, [sys.executable, "-m", "ttsq.cli.main", "worker", "-n", "w@bench"], env, folder / "w.log")
        gateway_base = f"http://127.0.0.1:{settings.gateway_port}"
        if args.via == "gateway":
            _start(stack, [sys.executable, "-m", "ttsq.cli.main", "serve"], env, folder / "gateway.log")
        cache = connect(settings.cache_url)
        deadline = time.monotonic() + 300
        while not cache.exists(FLEET_PREFIX + settings.queue) or (args.via == "gateway" and not _up(gateway_base)):
            if time.monotonic() > deadline:
                raise SystemExit(f"the deployment did not start; logs in {folder}")
            time.sleep(0.2)
        document = args.engine == "espeak"
        reader: _ClientReader | _GatewayReader | None = None
        if args.via == "client":
            reader = _ClientReader(settings, base, document)
        else:
            from ttsq.gateway.apikeys import ApiKeys

            token, _ = ApiKeys(cache).add("bench")
            reader = _GatewayReader(gateway_base, token, base)
        assert reader is not None
        stack.callback(reader.close)
        run_id = uuid.uuid4().hex[:8]
        reader.stream(f"{text} Warm-up {run_id}.")  # the engine's first call, and every connection
        figures: dict[str, Any] = {
            "engine": args.engine,
            "via": args.via,
            "request": f"document of {len(text)} characters" if document else f"clip of {args.frames} frames",
            "floor_first_audio_ms": round(floor * 1000, 1),
            "runs": [],
        }
        for concurrency in args.concurrency:
            texts = [f"{text} Stream {run_id} {concurrency} {n}." for n in range(concurrency)]
            streamed = _at_once(reader.stream, texts)
            whole = _at_once(reader.whole, [f"{t} Whole." for t in texts])
            figures["runs"].append(
                {
                    "concurrency": concurrency,
                    "first_audio_ms": _pcts([p.first_s for p in streamed]),
                    "whole_clip_ms": _pcts([w for w in whole]),
                    "rtf": round(statistics.median(p.last_s / max(p.audio_s, 1e-9) for p in streamed), 3),
                    "audio_s": round(statistics.median(p.audio_s for p in streamed), 2),
                    "underruns": sum(p.underruns for p in streamed),
                    "underrun_s": round(sum(p.underrun_s for p in streamed), 3),
                    "streams_with_underrun": sum(1 for p in streamed if p.underruns),
                }
            )
        return figures


def redis_bytes(args: argparse.Namespace) -> dict[str, Any]:
    """Redis bytes per stream being made, windowed and kept whole, and at rest after the grace."""
    from ttsq.engines.base import EngineOutput
    from ttsq.observer import Observer
    from ttsq.records.streams import AudioStreams
    from ttsq.worker.streaming import StreamWriter

    rate, grace_s = 24_000, 1
    rng = np.random.default_rng(41)
    # Speech-like in what matters here: 16-bit samples are the same size in a stream whatever they are.
    clip = (rng.standard_normal(int(args.clip_s * rate)) * 0.1).astype(np.float32)
    redis = RedisServer().start()
    try:
        client = connect(f"{redis.url}/2")
        figures: dict[str, Any] = {"streams": args.redis_bytes, "clip_s": args.clip_s, "rate": rate}

        def used() -> int:
            return int(client.info("memory")["used_memory"])

        for name, window_s in (("whole", args.clip_s + 1.0), ("windowed", float(args.window_s))):
            streams = AudioStreams(client, window_s=window_s, grace_s=grace_s)
            before = used()
            ids = [f"bench-{name}-{n}" for n in range(args.redis_bytes)]
            writers = {}
            for task_id in ids:
                writers[task_id] = StreamWriter(streams, task_id, sample_rate=rate, observer=Observer(), sent_at=None)
                writers[task_id].finish(EngineOutput(samples=clip, sample_rate=rate))
            open_bytes = used() - before
            figures[f"{name}_bytes_per_stream"] = round(open_bytes / args.redis_bytes)
            for task_id in ids:  # as the worker ends a stream: trimmed to the window from the clip's end
                streams.end(task_id, {"duration_s": args.clip_s}, keep_from=writers[task_id].end_trim())
            figures[f"{name}_ended_bytes_per_stream"] = round((used() - before) / args.redis_bytes)
            time.sleep(grace_s + 1.5)
            figures[f"{name}_at_rest_bytes"] = used() - before
            figures[f"{name}_keys_at_rest"] = len(client.keys("ttsq:stream:bench-*"))
        figures["window_s"] = args.window_s
        return figures
    finally:
        redis.stop()


def _corpus(chars: int) -> str:
    """The tests' document (``tests/document_corpus.py``), cut back to a word under ``chars``."""
    sys.path.insert(0, str(ROOT / "tests"))
    text: str = importlib.import_module("document_corpus").corpus(chars)
    return text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0]


def _at_once(call: Callable[[str], Any], texts: list[str]) -> list[Any]:
    with ThreadPoolExecutor(len(texts)) as pool:
        return list(pool.map(call, texts))


def _pcts(values: list[float]) -> dict[str, float]:
    data = np.asarray(values) * 1000
    return {"p50": round(float(np.percentile(data, 50)), 1), "p95": round(float(np.percentile(data, 95)), 1)}


def _up(base: str) -> bool:
    import httpx

    try:
        return httpx.get(base + "/healthz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class _ClientReader:
    """``Client.stream`` (or ``stream_document``) and ``Client.submit(...).wait()`` plus the download."""

    def __init__(self, settings: Settings, base: dict[str, Any], document: bool) -> None:
        from ttsq.client import Client

        self.client = Client(settings)
        self.base, self.document = base, document

    def stream(self, text: str) -> Played:
        started = time.perf_counter()
        pieces = (
            self.client.stream_document(text, timeout=600, **self.base)
            if self.document
            else self.client.stream(text, timeout=600, **self.base)
        )
        player: Player | None = None
        for piece in pieces:
            player = player or Player(piece.sample_rate, started)
            player.piece(len(piece.pcm))
        assert player is not None
        return player.done()

    def whole(self, text: str) -> float:
        started = time.perf_counter()
        job = self.client.submit_document(text, **self.base) if self.document else self.client.submit(text, **self.base)
        self.client.download(job.wait(600))
        return time.perf_counter() - started

    def close(self) -> None:
        self.client.close()


class _GatewayReader:
    """The official ``openai`` package against ``ttsq serve``: streamed pcm, and the whole file."""

    def __init__(self, base: str, token: str, fields: dict[str, Any]) -> None:
        import openai

        self.openai = openai.OpenAI(base_url=base + "/v1", api_key=token, timeout=600, max_retries=0)
        self.fields = fields

    def _create(self, text: str, **extra: Any) -> Any:
        return self.openai.audio.speech.with_streaming_response.create(
            model="tts-1", voice="alloy", input=text, response_format="pcm", **extra
        )

    def stream(self, text: str) -> Played:
        started = time.perf_counter()
        with self._create(text, extra_body={"stream_format": "audio", **self.fields}) as response:
            rate = int(response.headers.get("x-sample-rate", 24000))
            player = Player(rate, started)
            for chunk in response.iter_bytes():
                player.piece(len(chunk))
        return player.done()

    def whole(self, text: str) -> float:
        started = time.perf_counter()
        with self._create(text, extra_body=self.fields) as response:
            response.read()
        return time.perf_counter() - started

    def close(self) -> None:
        self.openai.close()


def _print(figures: dict[str, Any]) -> None:
    print(
        f"ttsq streaming: {figures['engine']} via {figures['via']}, {figures['request']} per request; "
        f"the engine's own first piece: {figures['floor_first_audio_ms']} ms"
    )
    print("  streams   first audio p50/p95 ms   whole clip p50/p95 ms   RTF    underruns (streams, seconds)")
    for run in figures["runs"]:
        first, whole = run["first_audio_ms"], run["whole_clip_ms"]
        print(
            f"  {run['concurrency']:>7}   {first['p50']:>9} / {first['p95']:<9}   {whole['p50']:>9} / {whole['p95']:<9}"
            f"   {run['rtf']:<6} {run['underruns']} ({run['streams_with_underrun']}, {run['underrun_s']} s)"
        )


def _iter_ints(text: str) -> Iterator[int]:
    for part in text.split(","):
        yield int(part)


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engine", default="espeak", choices=["espeak", "qwen-fast"])
    parser.add_argument("--via", default="client", choices=["client", "gateway"])
    parser.add_argument("--concurrency", type=lambda v: list(_iter_ints(v)), default=[1, 4, 8, 16])
    parser.add_argument("--frames", type=int, default=125, help="codec frames per qwen-fast clip (12.5 a second)")
    parser.add_argument("--doc-chars", type=int, default=8000, help="characters per espeak document")
    parser.add_argument("--model", default="", help="a VoiceDesign checkpoint (qwen-fast); default: a tiny one")
    parser.add_argument("--device", default="auto", help="TTSQ_QWEN_DEVICE of the worker")
    parser.add_argument("--max-batch", type=int, default=8, help="the worker's slots (at least the concurrency)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--redis-bytes", type=int, default=0, help="measure Redis bytes per open stream, N streams")
    parser.add_argument("--clip-s", type=float, default=60.0, help="--redis-bytes: seconds of audio per stream")
    parser.add_argument("--window-s", type=int, default=Settings().stream_window_s, help="--redis-bytes: the window")
    args = parser.parse_args()
    if args.redis_bytes:
        figures = redis_bytes(args)
        print(
            f"ttsq stream memory: {figures['streams']} open streams of {figures['clip_s']:.0f} s "
            f"at {figures['rate']} Hz; "
            f"Redis bytes per stream being made: {figures['windowed_bytes_per_stream']:,} with a "
            f"{figures['window_s']} s window, {figures['whole_bytes_per_stream']:,} kept whole; per ended stream in "
            f"its grace: {figures['windowed_ended_bytes_per_stream']:,} against "
            f"{figures['whole_ended_bytes_per_stream']:,}; after end + grace: "
            f"{figures['windowed_at_rest_bytes']:,} bytes ({figures['windowed_keys_at_rest']} keys) against "
            f"{figures['whole_at_rest_bytes']:,} ({figures['whole_keys_at_rest']} keys)"
        )
    else:
        figures = run(args)
        _print(figures)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
