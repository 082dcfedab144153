"""The README's first command, exactly as a newcomer runs it: no Redis, no S3, no GPU."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import soundfile as sf
from conftest import run_cli

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
    shutil.copytree(README.parent, copy, ignore=shutil.ignore_patterns(
        ".venv", ".git", "*.egg-info", "__pycache__", ".*_cache", "ttsq-audio", "build"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTSQ_", "VIRTUAL_ENV"))}
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


def redis_servers() -> set[int]:
    pids = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"redis-server" in (entry / "cmdline").read_bytes():
                pids.add(int(entry.name))
        except OSError:
            continue
    return pids


def test_embedded_leaves_no_redis_running(tmp_path: Path) -> None:
    before = redis_servers()
    out = run_cli("submit", "Bye.", "--embedded", "--json", cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout)["url"].startswith(f"file://{tmp_path}/ttsq-audio/")
    assert redis_servers() <= before
