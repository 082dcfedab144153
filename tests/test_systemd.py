"""deploy/systemd: the units pass ``systemd-analyze verify`` (which needs no running systemd), and say what
ttsq's behaviour needs: a plain worker per GPU, no restart loop on bad settings, a stop timeout above the
drain, Flower and the gateway on loopback. Their ExecStart lines run here, with the ttsq binary swapped for a
recorder, or (the gateway) as they are, against real Redis."""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import listening_on, missing_tool, settings_env, stop_process

from ttsq.config import Settings
from ttsq.ops.redis_server import free_port
from ttsq.workers.supervisor import EXIT_CONFIG, Supervisor

ROOT = Path(__file__).parent.parent
UNITS = ROOT / "deploy" / "systemd"
WORKER = UNITS / "ttsq-worker@.service"
FLOWER = UNITS / "ttsq-flower.service"
GATEWAY = UNITS / "ttsq-gateway.service"
TARGET = UNITS / "ttsq.target"
#: Where the units expect ttsq's virtual environment (docs/systemd.md installs it there).
INSTALLED_TTSQ = "/opt/ttsq/venv/bin/ttsq"
#: The ttsq console script of the environment running these tests.
TTSQ = Path(sys.executable).with_name("ttsq")


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values, in order]}}: keys repeat in units (Environment=)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        assert not line.endswith("\\"), f"line {number}: continuation lines are not expected here"
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"line {number}: {line!r}"
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def service(path: Path) -> dict[str, list[str]]:
    return parse_unit(path.read_text(encoding="utf-8"))["Service"]


def one(section: dict[str, list[str]], key: str) -> str:
    (value,) = section[key]
    return value


def environment(section: dict[str, list[str]]) -> dict[str, str]:
    pairs = (item.partition("=") for value in section.get("Environment", []) for item in shlex.split(value))
    return {key: value for key, _, value in pairs}


# --- systemd-analyze verify --------------------------------------------------------------------------


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    if found is None:
        missing_tool("systemd-analyze not found (Debian package: systemd); the units were not verified")
    return found


def verify(units: Path) -> list[str]:
    """Run ``systemd-analyze verify`` on the units in a folder; return its complaints about them.

    verify exits non-zero only for some errors (a missing executable); an unknown key or a value it
    cannot parse is a warning it ignores, with exit status 0. Both count here."""
    worker = units / WORKER.name
    out = subprocess.run(
        [
            systemd_analyze(),
            "verify",
            "--man=no",
            "--generators=no",
            # the template as a real instance, so that %i is expanded as it will be
            f"{worker}:ttsq-worker@0.service",
            str(units / FLOWER.name),
            str(units / GATEWAY.name),
            str(units / TARGET.name),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=units,
    )
    complaints = [line for line in out.stderr.splitlines() if "ttsq" in line]
    if out.returncode != 0:
        complaints.append(f"exit status {out.returncode}: {out.stderr.strip()}")
    return complaints


def installable_copy(tmp_path: Path, edit: tuple[str, str, str] | None = None) -> Path:
    """The units in a folder of their own, pointing at this environment's ttsq (verify checks that
    ExecStart's program exists); ``edit`` replaces text in one of them."""
    assert TTSQ.exists(), TTSQ
    folder = tmp_path / "units"
    folder.mkdir()
    for unit in (WORKER, FLOWER, GATEWAY, TARGET):
        text = unit.read_text(encoding="utf-8").replace(INSTALLED_TTSQ, str(TTSQ))
        if edit is not None and edit[0] == unit.name:
            assert text.count(edit[1]) == 1, edit
            text = text.replace(edit[1], edit[2])
        (folder / unit.name).write_text(text, encoding="utf-8")
    return folder


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    assert verify(installable_copy(tmp_path)) == []


def test_every_unit_in_the_folder_is_verified() -> None:
    """A unit added to deploy/systemd without a place in ``verify`` would never be checked."""
    assert {path.name for path in UNITS.glob("ttsq*.service")} | {TARGET.name} == {
        unit.name for unit in (WORKER, FLOWER, GATEWAY, TARGET)
    }


@pytest.mark.parametrize(
    "edit",
    [
        (WORKER.name, "\nKillMode=mixed\n", "\nKillMode=mixed\nKillModee=mixed\n"),  # an unknown key: a warning
        (WORKER.name, "\nKillMode=mixed\n", "\nKillMode=gently\n"),  # a value systemd cannot parse: a warning
        # the typo that would quietly bring back the restart loop
        (WORKER.name, "\nRestartPreventExitStatus=2\n", "\nRestartPreventExitStatus=two\n"),
        (FLOWER.name, "\nRestartSec=5s\n", "\nRestartSec=soon\n"),
        (GATEWAY.name, "\nTimeoutStopSec=30\n", "\nTimeoutStopSec=half a minute\n"),
        (TARGET.name, "\n[Install]\n", "\n[Instal]\n"),  # an unknown section
    ],
    ids=["unknown key", "bad value", "bad exit status", "bad time", "bad gateway time", "unknown section"],
)
def test_verify_catches_a_broken_unit(tmp_path: Path, edit: tuple[str, str, str]) -> None:
    assert verify(installable_copy(tmp_path, edit)) != []


@pytest.mark.parametrize("unit", [FLOWER, GATEWAY], ids=["flower", "gateway"])
def test_verify_catches_a_missing_program(tmp_path: Path, unit: Path) -> None:
    folder = installable_copy(tmp_path)
    copy = folder / unit.name
    copy.write_text(copy.read_text(encoding="utf-8").replace(str(TTSQ), INSTALLED_TTSQ + "-missing"))
    assert any("not executable" in line for line in verify(folder))


# --- what the worker unit says -----------------------------------------------------------------------


def test_a_worker_that_exits_2_is_not_restarted() -> None:
    worker = service(WORKER)
    assert one(worker, "Restart") == "on-failure"
    assert str(EXIT_CONFIG) in one(worker, "RestartPreventExitStatus").split()
    assert EXIT_CONFIG == 2
    # ... and 2 is what ttsq exits with on bad settings (here, before anything connects or loads)
    out = subprocess.run(
        [str(TTSQ), "worker"], env={**os.environ, "TTSQ_MAX_BATCH": "0"}, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == EXIT_CONFIG, out.stderr
    assert "max_batch" in out.stderr.lower() and "Traceback" not in out.stderr


def test_stopping_a_worker_is_a_warm_shutdown_with_time_to_drain() -> None:
    worker = service(WORKER)
    assert one(worker, "KillSignal") == "SIGTERM"  # Celery's warm shutdown
    assert one(worker, "KillMode") == "mixed"  # SIGTERM to the worker alone; SIGKILL to all at the end
    timeout_s = int(one(worker, "TimeoutStopSec"))
    # Above the launcher's drain and its SIGQUIT-to-SIGKILL grace too, should the launcher run here.
    kill_grace_s = inspect.signature(Supervisor).parameters["kill_grace_s"].default
    assert timeout_s > Settings().drain_timeout_s + kill_grace_s


def test_each_instance_sees_only_its_own_gpu() -> None:
    worker = service(WORKER)
    env = environment(worker)
    assert env["CUDA_VISIBLE_DEVICES"] == "%i"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"  # %i is the index nvidia-smi shows
    assert one(worker, "EnvironmentFile") == "/etc/ttsq/ttsq.env"
    assert one(worker, "User") == "ttsq"
    # Nothing that hides /dev/nvidia* or breaks CUDA's JIT (PrivateDevices=no would be fine, but is noise).
    for key in (
        "PrivateDevices",
        "DevicePolicy",
        "DeviceAllow",
        "ProtectClock",
        "MemoryDenyWriteExecute",
        "ProcSubset",
    ):
        assert key not in worker, key
    assert one(worker, "ProtectSystem") == "strict" and one(worker, "NoNewPrivileges") == "yes"


def expand(command: str, *, instance: str, host: str) -> list[str]:
    """ExecStart as systemd hands it to exec: the specifiers this unit uses, then ``$$`` as ``$``."""
    assert set(re.findall(r"%.", command)) <= {"%i", "%H"}, command
    assert "$" not in command.replace("$$", ""), "a lone $ is systemd's own variable expansion"
    return shlex.split(command.replace("%i", instance).replace("%H", host).replace("$$", "$"))


def recorder(tmp_path: Path) -> Path:
    """A stand-in for ttsq that prints its arguments as JSON."""
    script = tmp_path / "record-args"
    script.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


@pytest.mark.parametrize(
    ("instance", "metrics_port", "expected_port"),
    [("0", None, "9191"), ("3", None, "9194"), ("1", "9300", "9301"), ("2", "0", "0")],
)
def test_the_worker_command_is_a_plain_worker_named_for_its_gpu(
    tmp_path: Path, instance: str, metrics_port: str | None, expected_port: str
) -> None:
    command = expand(one(service(WORKER), "ExecStart"), instance=instance, host="gpuhost")
    assert INSTALLED_TTSQ in command[-1]
    command[-1] = command[-1].replace(INSTALLED_TTSQ, str(recorder(tmp_path)))
    env = {"PATH": os.environ["PATH"]} | ({"TTSQ_METRICS_PORT": metrics_port} if metrics_port else {})
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    args = json.loads(out.stdout)
    # node gpuN@host and metrics port TTSQ_METRICS_PORT + N, as the launcher names its children
    assert args == ["worker", "-n", f"gpu{instance}@gpuhost", "--metrics-port", expected_port]
    # and ttsq accepts exactly these options
    check = subprocess.run([str(TTSQ), *args, "--help"], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "Usage: ttsq worker" in check.stdout, check.stderr


# --- Flower, the target, the environment file --------------------------------------------------------


def test_flower_listens_on_loopback_with_basic_auth() -> None:
    flower = service(FLOWER)
    command = shlex.split(one(flower, "ExecStart"))
    assert command[:2] == [INSTALLED_TTSQ, "flower"]
    assert command[command.index("--address") + 1] == "127.0.0.1"
    assert "--no-auth" not in command
    assert one(flower, "EnvironmentFile") == "/etc/ttsq/ttsq.env"
    assert str(EXIT_CONFIG) in one(flower, "RestartPreventExitStatus").split()
    # Without FLOWER_BASIC_AUTH, `ttsq flower` refuses to start with exit status 2: no restart loop.
    env = {k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"}
    out = subprocess.run([str(TTSQ), *command[1:]], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == EXIT_CONFIG and "FLOWER_BASIC_AUTH" in out.stderr, out.stderr


def test_the_target_groups_the_units() -> None:
    target = parse_unit(TARGET.read_text(encoding="utf-8"))
    assert target["Install"]["WantedBy"] == ["multi-user.target"]
    for unit in (WORKER, FLOWER, GATEWAY):
        sections = parse_unit(unit.read_text(encoding="utf-8"))
        assert sections["Unit"]["PartOf"] == [TARGET.name], unit.name
        assert sections["Install"]["WantedBy"] == [TARGET.name], unit.name
        assert "network-online.target" in sections["Unit"]["After"][0].split(), unit.name
        assert "network-online.target" in sections["Unit"]["Wants"][0].split(), unit.name


def test_the_example_environment_file_holds_valid_settings() -> None:
    lines = (UNITS / "ttsq.env.example").read_text(encoding="utf-8").splitlines()
    env = dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))
    settings = Settings.from_env({k: v for k, v in env.items() if k.startswith("TTSQ_")})
    assert settings.broker_url != Settings().broker_url and settings.engine == "qwen"
    assert not settings.qwen_model.startswith("/home/")  # ProtectHome=yes hides /home
    assert set(env) - {k for k in env if k.startswith("TTSQ_")} == {
        "HF_HUB_OFFLINE",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "FLOWER_BASIC_AUTH",
    }
    assert env["FLOWER_BASIC_AUTH"].count(":") == 1


# --- the gateway ---------------------------------------------------------------------------------------


def test_the_gateway_unit_runs_ttsq_serve_on_loopback_unless_the_environment_file_says_otherwise(
    settings: Settings, tmp_path: Path
) -> None:
    import httpx

    gateway = service(GATEWAY)
    command = shlex.split(one(gateway, "ExecStart"))
    # No --host: TTSQ_GATEWAY_HOST in the environment file decides, and without it the default is loopback.
    assert command == [INSTALLED_TTSQ, "serve"]
    assert one(gateway, "EnvironmentFile") == "/etc/ttsq/ttsq.env" and one(gateway, "User") == "ttsq"
    assert Settings().gateway_host == "127.0.0.1"
    # The command as the unit runs it, with the suite's Redis and S3 and no TTSQ_GATEWAY_HOST anywhere.
    port = free_port()
    env = {k: v for k, v in settings_env(settings).items() if k != "TTSQ_GATEWAY_HOST"}
    env["TTSQ_GATEWAY_PORT"] = str(port)
    with (tmp_path / "gateway.log").open("wb") as log:
        process = subprocess.Popen([str(TTSQ), *command[1:]], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "gateway.log").read_text()
            time.sleep(0.1)
        assert listening_on(port) == {"127.0.0.1"}
    finally:
        # SIGTERM, the unit's KillSignal: uvicorn shuts down gracefully, then ends by the signal itself,
        # which systemd counts as a clean exit (no restart, no failed state), like status 0.
        assert stop_process(process) in (0, -signal.SIGTERM)
    # Within the unit's stop timeout, and no restart loop on settings that never heal.
    assert one(gateway, "KillSignal") == "SIGTERM" and int(one(gateway, "TimeoutStopSec")) >= 10
    assert one(gateway, "Restart") == "on-failure"
    assert str(EXIT_CONFIG) in one(gateway, "RestartPreventExitStatus").split()
    bad = subprocess.run(
        [str(TTSQ), *command[1:]], env={**env, "TTSQ_GATEWAY_PORT": "99999"}, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == EXIT_CONFIG and "TTSQ_GATEWAY_PORT" in bad.stderr, bad.stderr
