"""``--devices``: which worker processes the launcher starts, from what the host has."""

from __future__ import annotations

import pytest

from ttsq.errors import ConfigError
from ttsq.workers.devices import Slot, discover_gpus, plan


def test_cpu_specs() -> None:
    assert plan("cpu", {})[0] == [Slot("cpu0", "")]
    slots, line = plan("cpu:3", {})
    assert [s.name for s in slots] == ["cpu0", "cpu1", "cpu2"] and all(s.cuda_visible_devices == "" for s in slots)
    assert "3 CPU worker(s)" in line


def test_all_follows_the_visible_gpus() -> None:
    slots, line = plan("all", {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert slots == [Slot("gpu2", "2"), Slot("gpu3", "3")] and "2 GPU(s)" in line
    assert [s.device for s in slots] == ["2", "3"]


def test_all_without_a_gpu_is_one_cpu_worker() -> None:
    slots, line = plan("all", {"CUDA_VISIBLE_DEVICES": ""})
    assert slots == [Slot("cpu0", "")] and "no GPU found" in line


def test_a_gpu_list() -> None:
    assert plan("0, 3", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"})[0] == [Slot("gpu0", "0"), Slot("gpu3", "3")]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("5", "GPU 5 is not on this machine"),
        ("0,0", "listed twice"),
        ("gpu0", "is not a GPU index"),
        ("cpu:0", "1 <= N <= 64"),
        (",", "expected all, cpu"),
    ],
)
def test_bad_specs_name_the_option(spec: str, reason: str) -> None:
    with pytest.raises(ConfigError) as error:
        plan(spec, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert error.value.variable == "--devices" and reason in error.value.reason


def test_discovery_without_a_gpu_finds_none_and_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, os; os.environ.pop('CUDA_VISIBLE_DEVICES', None); from ttsq.workers.devices import discover_gpus;"
        "discover_gpus(os.environ); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
    assert discover_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
