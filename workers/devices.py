"""Which devices a host has, and which worker processes ``--devices`` asks for.

Discovery never imports torch (the launcher must stay light and must not touch CUDA before it
starts children): NVML through ``nvidia-ml-py`` when it loads, else ``nvidia-smi``, else no GPU.
An operator's own ``CUDA_VISIBLE_DEVICES`` narrows what ``all`` means, as it would for CUDA.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from ttsq.errors import ConfigError

logger = logging.getLogger(__name__)

_CPU_SPEC = re.compile(r"^cpu(?::(\d+))?$")


@dataclass(frozen=True)
class Slot:
    """One worker process the launcher runs: its name and the device it is pinned to."""

    #: ``gpu<N>`` or ``cpu<N>``: the part of the node name before ``@host``.
    name: str
    #: The value of ``CUDA_VISIBLE_DEVICES`` for the process ("" hides every GPU).
    cuda_visible_devices: str

    @property
    def device(self) -> str:
        """The GPU this slot uses ("" for a CPU slot)."""
        return self.cuda_visible_devices


def discover_gpus(environ: Mapping[str, str]) -> list[str]:
    """GPU ids this process may use: the entries of ``CUDA_VISIBLE_DEVICES`` if set, else every
    GPU that NVML (or ``nvidia-smi``) reports, by index. Empty on a machine without a GPU."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [entry.strip() for entry in visible.split(",") if entry.strip() and entry.strip() != "-1"]
    count = _nvml_count()
    if count is None:
        count = _nvidia_smi_count()
    return [str(index) for index in range(count or 0)]


def plan(spec: str, environ: Mapping[str, str]) -> tuple[list[Slot], str]:
    """The worker processes for a ``--devices`` value, and one line saying what was chosen.

    ``all``: one process per GPU (one CPU process where there is none); ``0,1,3``: those GPUs;
    ``cpu``: one CPU process; ``cpu:N``: N CPU processes (several CPU workers on one host, for
    tests and for CPU engines that scale with processes).
    """
    spec = spec.strip().lower()
    cpu = _CPU_SPEC.match(spec)
    if cpu:
        count = int(cpu.group(1) or 1)
        if not 1 <= count <= 64:
            raise ConfigError("--devices", f"cpu:N needs 1 <= N <= 64, got {count}")
        return [Slot(f"cpu{i}", "") for i in range(count)], f"{count} CPU worker(s) (--devices {spec})"
    available = discover_gpus(environ)
    if spec == "all":
        if not available:
            return [Slot("cpu0", "")], "no GPU found (no NVML, no nvidia-smi): starting one CPU worker"
        return (
            [Slot(f"gpu{device}", device) for device in available],
            f"{len(available)} GPU(s) found: {', '.join(available)}",
        )
    wanted = [entry.strip() for entry in spec.split(",") if entry.strip()]
    if not wanted:
        raise ConfigError("--devices", "expected all, cpu, cpu:N or a list of GPU indexes like 0,1,3")
    for device in wanted:
        if not device.isdigit():
            raise ConfigError("--devices", f"{device!r} is not a GPU index; expected all, cpu, cpu:N or 0,1,3")
        if device not in available:
            found = ", ".join(available) or "none"
            raise ConfigError("--devices", f"GPU {device} is not on this machine (found: {found})")
    if len(set(wanted)) != len(wanted):
        raise ConfigError("--devices", "a GPU is listed twice")
    return [Slot(f"gpu{device}", device) for device in wanted], f"GPU(s) {', '.join(wanted)}"


def _nvml_count() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...: no usable GPU
        logger.debug("NVML: %s", exc)
        return None


def _nvidia_smi_count() -> int | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run(
            [exe, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, timeout=30, check=True
        )
    except (OSError, subprocess.SubprocessError) as exc:
        logger.debug("nvidia-smi: %s", exc)
        return None
    return sum(1 for line in out.stdout.splitlines() if line.strip().isdigit())
