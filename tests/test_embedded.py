"""The README's first command, exactly as a newcomer runs it: no Redis, no S3, no GPU."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import numpy as np
import soundfile as sf
from conftest import run_cli

README = Path(__file__).parent.parent / "README.md"


def first_command() -> list[str]:
    """The ttsq invocation in the README's first shell block."""
    block = re.search(r"```(?:bash|sh)\n(.*?)```", README.read_text(encoding="utf-8"), re.S)
    assert block, "README has no shell block"
    line = next(line for line in block.group(1).splitlines() if "ttsq submit" in line)
    command = line.split("ttsq submit", 1)[1]
    import shlex

    return ["submit", *shlex.split(command)]


def test_readme_first_command_speaks(tmp_path: Path) -> None:
    args = first_command()
    assert "--embedded" in args
    out = run_cli(*args, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr.decode()
    output = tmp_path / args[args.index("-o") + 1]
    audio, rate = sf.read(io.BytesIO(output.read_bytes()), dtype="int16")
    assert rate == 22050
    assert 1.0 < len(audio) / rate < 10
    voiced = np.mean(np.abs(audio) > 500)  # speech, not silence or a click
    assert voiced > 0.3
    assert out.stdout.decode().startswith(f"wrote {output.name}:")


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
