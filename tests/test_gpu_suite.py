"""The GPU suite (benchmarks/gpu/) is ready to run in one call of the device machine, checked here where
there is no GPU: its install recipe against the image's package list, and every step in a dry run.

The recipe check downloads the carried wheels with the suite's own script (the device notes' pip flags)
and reads their metadata: every requirement of every wheel, evaluated for CPython 3.12 on Linux x86-64,
is met by another carried wheel (its version checked) or by the image (benchmarks/gpu/image_packages.txt,
by version where the list knows it), or is left out in wheels.txt with a reason. What the image itself
does at run time (imports, CUDA) only the device can show: the suite's install step checks it there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from packaging import tags
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
GPU = ROOT / "benchmarks" / "gpu"
#: The carried wheels' share of the 64 MiB that travels with a call, leaving the rest to the repository.
WHEEL_BUDGET_BYTES = 40 * 2**20
TRAVEL_LIMIT_BYTES = 64 * 2**20
#: The device's interpreter, as markers see it.
DEVICE = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "implementation_version": "3.12.3",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "platform_release": "",
    "platform_version": "",
    "os_name": "posix",
}
#: The platforms of the device notes' pip download command.
PLATFORMS = [
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]
STEPS = ["install", "build", "qwen_fast", "quant", "streaming", "queue"]


def pins() -> dict[str, Version]:
    """wheels.txt: one NAME==VERSION a line, each name once."""
    found: dict[str, Version] = {}
    for line in (GPU / "wheels.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            assert canonicalize_name(name) not in found, f"{name} is pinned twice"
            found[canonicalize_name(name)] = Version(version)
    return found


def left_out() -> set[str]:
    """The names wheels.txt leaves out on purpose (``# left-out: NAME  why``), each with its reason."""
    names = set()
    for line in (GPU / "wheels.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith("# left-out:"):
            name, _, why = line.removeprefix("# left-out:").strip().partition(" ")
            assert len(why.strip()) > 20, f"{name} is left out without a reason"
            names.add(canonicalize_name(name))
    return names


def image() -> dict[str, Version | None]:
    """image_packages.txt: name -> version, None where the list does not know it."""
    found: dict[str, Version | None] = {}
    for line in (GPU / "image_packages.txt").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            found[canonicalize_name(name)] = Version(version) if version else None
    return found


def requirements(wheel: Path, extras: frozenset[str] = frozenset()) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the device: markers evaluated there, extras only when asked."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(name).decode("utf-8"))
    return [r for line in metadata.get_all("Requires-Dist") or [] if applies(r := Requirement(line), extras)]


def applies(requirement: Requirement, extras: frozenset[str]) -> bool:
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**DEVICE, "extra": extra}) for extra in {"", *extras})


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The wheels of wheels.txt, downloaded by benchmarks/gpu/fetch_wheels.sh: name -> file."""
    folder = tmp_path_factory.mktemp("wheels")
    out = subprocess.run(
        ["bash", str(GPU / "fetch_wheels.sh"), str(folder)],
        env={**os.environ, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    found: dict[str, Path] = {}
    for path in sorted(folder.glob("*.whl")):
        name = canonicalize_name(parse_wheel_filename(path.name)[0])
        assert name not in found, f"two versions of {name}: {found[name].name} and {path.name}"
        found[name] = path
    return found


def test_the_wheels_are_the_pins_and_install_on_the_device(wheels: dict[str, Path]) -> None:
    pinned = pins()
    assert {name: parse_wheel_filename(path.name)[1] for name, path in wheels.items()} == pinned
    assert pinned[canonicalize_name("transformers")] == Version("4.57.3")
    assert pinned[canonicalize_name("qwen-tts")] == Version("0.1.1")
    device = {*tags.cpython_tags((3, 12), platforms=PLATFORMS), *tags.compatible_tags((3, 12), "cp312", PLATFORMS)}
    for path in wheels.values():
        assert parse_wheel_filename(path.name)[3] & device, f"{path.name} does not install on CPython 3.12 x86-64"
    total = sum(path.stat().st_size for path in wheels.values())
    assert total < WHEEL_BUDGET_BYTES, f"{total / 2**20:.1f} MiB of wheels"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    repository = sum((ROOT / name).stat().st_size for name in tracked.decode().split("\0") if (ROOT / name).is_file())
    assert repository + total < TRAVEL_LIMIT_BYTES


def test_every_requirement_is_met_on_the_device(wheels: dict[str, Path]) -> None:
    """Every wheel's requirements, and ttsq's own (pyproject.toml: its dependencies and the qwen extra, with
    the extras they name followed into the wheels), are carried, in the image, or left out on purpose."""
    import tomllib  # Python 3.11+

    carried = {name: parse_wheel_filename(path.name)[1] for name, path in wheels.items()}
    there, skipped = image(), left_out()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = [
        ("ttsq", Requirement(line))
        for line in [*project["dependencies"], *project["optional-dependencies"]["qwen"]]
        if applies(Requirement(line), frozenset())
    ]
    for name, path in wheels.items():
        wanted += [(name, r) for r in requirements(path)]
    index, followed = 0, set()
    while index < len(wanted):  # an extra named on the way adds that wheel's requirements under it
        _, requirement = wanted[index]
        key = (canonicalize_name(requirement.name), frozenset(requirement.extras))
        if requirement.extras and key[0] in wheels and key not in followed:
            followed.add(key)
            wanted += [(key[0], r) for r in requirements(wheels[key[0]], key[1])]
        index += 1

    unmet = []
    for by, requirement in wanted:
        name = canonicalize_name(requirement.name)
        if name in carried:
            ok = requirement.specifier.contains(carried[name], prereleases=True)
        elif name in there:
            version = there[name]
            ok = version is None or requirement.specifier.contains(version, prereleases=True)
        else:
            ok = name in skipped
        if not ok:
            unmet.append(f"{by} needs {requirement}")
    assert unmet == []

    # A wheel is carried where the image has the package only when the image's known version is refused
    # (the image's unknown versions may be carried as a hedge, and wheels.txt says so).
    refused = {
        name
        for _, requirement in wanted
        if (name := canonicalize_name(requirement.name)) in carried
        and (version := there.get(name)) is not None
        and not requirement.specifier.contains(version, prereleases=True)
    }
    assert {name for name in carried if there.get(name) is not None} == refused
    assert refused >= {canonicalize_name(n) for n in ("transformers", "accelerate", "huggingface-hub", "tokenizers")}
    # What is left out is needed by something, neither carried nor in the image: else the line is stale.
    assert skipped <= {canonicalize_name(r.name) for _, r in wanted} - set(carried) - set(there)


def suite_module() -> Any:
    """benchmarks/gpu/suite.py, imported from its file (benchmarks/ is not an installed package)."""
    spec = importlib.util.spec_from_file_location("gpu_suite", GPU / "suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_suite(
    *args: str, tmp_path: Path, timeout: float = 280
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "out"
    command = ["bash", str(GPU / "run.sh"), *args, "--out", str(out), "--work", str(tmp_path / "work")]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_") and k != "OUT"}
    ran = subprocess.run(
        command, env={**env, "PYTHON": sys.executable}, cwd=tmp_path, capture_output=True, text=True, timeout=timeout
    )
    report = json.loads((out / "suite.json").read_text(encoding="utf-8"))
    return ran, report


def test_the_dry_run_runs_every_step(tmp_path: Path) -> None:
    ran, report = run_suite("--dry-run", tmp_path=tmp_path)
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    assert report["mode"] == "dry-run" and list(report["steps"]) == STEPS
    steps = report["steps"]
    quant = (ROOT / "benchmarks" / "quant.py").exists()
    assert {name: step["status"] for name, step in steps.items()} == {
        **dict.fromkeys(STEPS, "ok"),
        "quant": "ok" if quant else "skipped",
    }, {name: step.get("reason") for name, step in steps.items()}
    for step in steps.values():
        assert 0 < step["limit_s"] <= report["budget_s"] and step["seconds"] <= step["limit_s"] + 15

    assert steps["install"]["figures"]["versions"]["transformers"] == "4.57.3"
    assert steps["build"]["figures"]["size"] == "tiny"
    fast = steps["qwen_fast"]["figures"]
    assert [row["batch"] for row in fast["rows"]] == [1, 2]
    for row in fast["rows"]:
        assert row["stock_audio_s_per_s"] > 0 and row["fast_audio_s_per_s"] > 0 and row["fast_ms_per_frame"] > 0
    # What the suite keeps of a run killed before its JSON: the rows it printed, read back as the JSON has them.
    printed = suite_module().printed_rows((tmp_path / "work" / "logs" / "qwen_fast.log").read_text(encoding="utf-8"))
    assert printed == [{key: row[key] for key in printed[0]} for row in fast["rows"]]
    assert set(fast["mixed"]) == {"stock", "fast"}
    if quant:
        assert steps["quant"]["figures"]["speed"]
    else:
        assert steps["quant"]["reason"] == "benchmarks/quant.py not present"
    streaming = steps["streaming"]["figures"]
    assert streaming["engine"] == "qwen-fast" and streaming["floor_first_audio_ms"] > 0
    assert [run["concurrency"] for run in streaming["runs"]] == [1, 2]
    assert all(run["first_audio_ms"]["p50"] > 0 and run["audio_s"] > 0 for run in streaming["runs"])
    queue = steps["queue"]["figures"]
    bench = queue["bench"]
    assert queue["settings"]["engine"] == "qwen-fast" and queue["settings"]["storage"] == "local folder"
    assert bench["jobs"] == {**bench["jobs"], "sent": 6, "ok": 6, "errors": 0}
    assert bench["throughput"]["audio_s_per_s"] > 0 and queue["worker_exit"] == 0

    # What comes back from the device: three files, the table with a row for every step.
    out = tmp_path / "out"
    assert sorted(path.name for path in out.iterdir()) == ["suite.json", "suite.log", "suite.md"]
    table = (out / "suite.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| step")]
    assert {line.split(" | ")[0].removeprefix("| ") for line in rows} >= set(STEPS)
    assert "| queue | ok | qwen-fast |" in table and "| qwen_fast | ok | qwen-fast | 2 |" in table
    assert "| streaming | ok | qwen-fast, 2 streams | 2 |" in table


def test_a_step_past_its_limit_is_killed_and_the_suite_goes_on(tmp_path: Path) -> None:
    """The install step's import check (torch, qwen-tts) takes seconds: at a one-second limit it is killed,
    recorded as a timeout, and every step that needs it is recorded as skipped."""
    ran, report = run_suite("--dry-run", "--limit", "install=1", tmp_path=tmp_path, timeout=120)
    assert ran.returncode == 1
    install = report["steps"]["install"]
    assert install["status"] == "timeout" and "killed at its time limit" in install["reason"]
    assert install["seconds"] < 15
    assert [step["status"] for step in report["steps"].values()][1:] == ["skipped"] * (len(STEPS) - 1)
    assert "| install | timeout |" in (tmp_path / "out" / "suite.md").read_text(encoding="utf-8")


def test_the_gpu_run_refuses_wheels_that_are_not_the_pins(tmp_path: Path) -> None:
    """Without the carried wheels the GPU run says how to get them, installs nothing, and measures nothing."""
    (tmp_path / "wheels").mkdir()
    ran, report = run_suite(
        "--wheels", str(tmp_path / "wheels"), "--site", str(tmp_path / "site"), tmp_path=tmp_path, timeout=120
    )
    assert ran.returncode == 1
    install = report["steps"]["install"]
    assert install["status"] == "failed" and "fetch_wheels.sh" in install["reason"]
    assert not (tmp_path / "site").exists()
    assert [step["status"] for step in report["steps"].values()][1:] == ["skipped"] * (len(STEPS) - 1)
