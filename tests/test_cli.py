"""The command line: CliRunner for the edges, real subprocesses for the whole path."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import soundfile as sf
from bad_inputs import BAD_CLI_REQUESTS
from click.testing import CliRunner
from support import WorkerProcess, queue_length, run_cli, settings_env

from ttsq.cli.main import cli
from ttsq.config import Settings
from ttsq.ops.redis_server import free_port

StartWorker = Callable[..., WorkerProcess]


def cli_args(request: dict[str, Any]) -> tuple[list[str], bytes | None]:
    """argv for ``ttsq submit`` (text through stdin when argv cannot carry it), and stdin."""
    text = str(request.get("text", ""))
    stdin = text.encode() if "\x00" in text else None
    args = ["submit", "-" if stdin is not None else text]
    for name, value in request.items():
        if name != "text":
            args += [f"--{name.replace('_', '-')}", str(value)]
    return args, stdin


@pytest.mark.parametrize(("data", "field"), BAD_CLI_REQUESTS)
def test_bad_input_is_one_line_naming_the_field_and_nothing_is_queued(
    settings: Settings, redis_client: redis.Redis, data: dict[str, Any], field: str
) -> None:
    args, stdin = cli_args(data) if "text" in data else (["submit"], None)
    out = run_cli(*args, settings=settings, input=stdin)
    lines = out.stderr.decode().strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1 and lines[0].startswith("ttsq: error: ")
    # ttsq names the field; click, for a value that is not even a number, names the flag
    flag = field.replace("_", "-")
    assert f"invalid {field}:" in lines[0] or f"'--{flag}'" in lines[0] or (field == "text" and "TEXT" in lines[0])
    assert queue_length(settings) == 0
    assert redis_client.dbsize() == 0 and redis.Redis.from_url(settings.cache_url).dbsize() == 0


def test_invalid_utf8_from_argv_and_stdin(settings: Settings) -> None:
    for args, stdin in (([b"submit", b"caf\xe9 \xff"], None), (["submit", "-"], b"\xff\xfe broken")):
        out = run_cli(*args, settings=settings, input=stdin)  # type: ignore[arg-type]
        assert out.returncode == 2
        assert out.stderr.decode().strip() == "ttsq: error: invalid text: is not valid UTF-8"
    assert queue_length(settings) == 0


@pytest.mark.parametrize("cache_down", [True, False])
def test_broker_down_is_one_line_not_a_traceback(settings: Settings, cache_down: bool) -> None:
    down = f"redis://127.0.0.1:{free_port()}"
    cache = ["--cache-url", f"{down}/2"] if cache_down else []
    out = run_cli(
        "--broker-url",
        f"{down}/0",
        "--result-backend",
        f"{down}/1",
        *cache,
        "submit",
        "hello",
        "--wait-for-worker",  # past the check for a worker (the cache database may be up): to the broker
        settings=settings,
        timeout=60,
    )
    assert out.returncode == 1
    assert out.stderr.decode().startswith("ttsq: error: cannot ")
    assert len(out.stderr.decode().strip().splitlines()) == 1
    assert queue_length(settings) == 0


def test_storage_down_is_one_line(settings: Settings, start_worker: StartWorker, tmp_path: Path) -> None:
    start_worker(settings)
    out = run_cli(
        "submit",
        "storage test",
        "-o",
        str(tmp_path / "x.wav"),
        "--timeout",
        "20",
        settings=settings.replace(s3_endpoint_url=f"http://127.0.0.1:{free_port()}"),
    )
    # The worker stores fine; this producer's own endpoint is down, so the download (through ttsq's
    # storage, with its retries) fails.
    # The job id first (accepted), then the error: one line.
    lines = out.stderr.decode().strip().splitlines()
    assert out.returncode == 1 and len(lines) <= 2, lines
    assert len(lines) == 1 or re.fullmatch(r"ttsq: job \S+ accepted; waiting for it", lines[0]), lines
    assert lines[-1].startswith("ttsq: error: s3 get_object") and "gave up after 2 tries" in lines[-1]


def test_timeout_is_one_line(settings: Settings) -> None:
    out = run_cli("submit", "nobody listens", "--timeout", "1", "--wait-for-worker", settings=settings)
    lines = out.stderr.decode().strip().splitlines()
    assert out.returncode == 1 and len(lines) == 2, lines
    assert re.fullmatch(r"ttsq: job \S+ accepted; waiting for it", lines[0]), lines
    assert lines[1].startswith("ttsq: error: job ") and lines[1].endswith("not done after 1.0s")


def test_submit_output_status_and_result_through_real_processes(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    target = tmp_path / "hello.flac"
    out = run_cli(
        "submit",
        "안녕하세요, 반갑습니다.",
        "--language",
        "ko",
        "--instruct",
        "차분한 목소리",
        "-o",
        str(target),
        settings=settings,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.decode().startswith(f"wrote {target}:")
    info = sf.info(io.BytesIO(target.read_bytes()))
    assert info.format == "FLAC" and info.duration > 0.8  # the format follows the extension

    queued = run_cli("submit", "-", "--no-wait", "--json", settings=settings, input=b"From stdin.")
    assert queued.returncode == 0, queued.stderr
    job_id = json.loads(queued.stdout)["id"]
    result = run_cli("result", job_id, "--json", settings=settings)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["format"] == "wav"
    status = run_cli("status", job_id, settings=settings)
    assert status.stdout.decode().startswith("SUCCESS ")


def test_json_result_reports_ignored_fields(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings)
    result = CliRunner().invoke(
        cli, ["submit", "Hello", "--instruct", "a warm voice", "--json"], env=settings_env(settings)
    )
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["ignored"] == ["instruct"]


def test_submit_help_never_imports_torch() -> None:
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in {"torch", "transformers", "qwen_tts", "torchaudio"}:
                    raise ImportError("blocked heavy import: " + name)
        sys.meta_path.insert(0, Block())
        from click.testing import CliRunner
        from ttsq.cli.main import cli
        result = CliRunner().invoke(cli, ["submit", "--help"])
        assert result.exit_code == 0, result.output
        assert "--instruct" in result.output
        heavy = [m for m in sys.modules if m.split(".")[0] in {"torch", "transformers", "qwen_tts"}]
        assert not heavy, heavy
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_producer_never_imports_numpy() -> None:
    """The command line's Redis commands and a web backend's Client only send requests and read results:
    numpy (0.07 s of every ``ttsq status``, a tenth of its start) stays with the worker's audio."""
    code = "import sys, ttsq.cli.main, ttsq.client, ttsq.document\nprint('numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


def test_version() -> None:
    from ttsq import __version__

    assert CliRunner().invoke(cli, ["--version"]).output.strip() == f"ttsq, version {__version__}"


@pytest.mark.parametrize(
    ("env", "code", "message"),
    [
        ({"TTSQ_MAX_BATCH": "0"}, 2, "ttsq: error: TTSQ_MAX_BATCH: must be 1..256"),
        ({"TTSQ_ENGINE": "qwen"}, 2, "ttsq: error: TTSQ_QWEN_MODEL: is required for TTSQ_ENGINE=qwen"),
        ({"TTSQ_ENGINE": "qwen", "TTSQ_QWEN_MODEL": "/"}, 2, "ttsq: error: TTSQ_QWEN_MODEL: / is not a checkpoint"),
        ({"TTSQ_ENGINE": "qwen", "TTSQ_QWEN_DEVICE": "tpu"}, 2, "ttsq: error: TTSQ_QWEN_DEVICE: must be auto"),
        ({"TTSQ_ENGINE": "festival"}, 2, "ttsq: error: TTSQ_ENGINE: unknown engine 'festival'"),
    ],
)
def test_worker_that_cannot_start_says_why_in_one_line(
    settings: Settings, env: dict[str, str], code: int, message: str
) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ttsq.cli.main", "worker"],
        env={**settings_env(settings), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == code
    assert out.stderr.strip().splitlines()[-1].startswith(message)
    assert "Traceback" not in out.stderr


def test_deadline_flag_is_checked_and_carried_in_the_job(settings: Settings) -> None:
    import base64
    import time

    out = run_cli("submit", "Too late.", "--deadline-s", "0", settings=settings)
    assert out.returncode == 2 and b"--deadline-s" in out.stderr and queue_length(settings) == 0
    out = run_cli("submit", "Wanted soon.", "--deadline-s", "30", "--no-wait", "--json", settings=settings)
    assert out.returncode == 0, out.stderr
    (raw,) = redis.Redis.from_url(settings.broker_url).lrange(settings.queue, 0, -1)
    _, kwargs, _ = json.loads(base64.b64decode(json.loads(raw)["body"]))  # kombu's envelope, then Celery's body
    assert 0 < kwargs["deadline"] - time.time() <= 30
