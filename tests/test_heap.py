"""The worker's allocator policy: a small fixed mmap threshold for audio buffers, except under torch on the CPU.

``workers/celery_worker.py`` fixes glibc's mmap threshold at 64 KiB once the engine is loaded (audio
buffers then go back to the OS, and a 10,000-job soak stays flat), unless the engine computes on the
CPU: there every intermediate tensor is a ``malloc``, and a fixed small threshold made each one a fresh
mapping (0.72x of a direct call through the queue instead of 0.99x, docs/benchmarks.md).

Each case runs in a process of its own (``mallopt`` is process-wide and cannot be undone), loads a real
engine, calls ``tune_heap`` as the worker does, and then asks glibc (``mallinfo2``) whether blocks
larger than all the heap's free memory (at least 256 KiB), allocated and freed three times over, were
mapped from the OS: under a fixed threshold every one is; under glibc's adaptive one, the first free
raises the threshold past that size and the next blocks come from the heap.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

GLIBC_VARIABLE = "MALLOC_MMAP_THRESHOLD_"

SCRIPT = r"""
import ctypes, json, sys
from ttsq.config import Settings
from ttsq.engines import create_engine
from ttsq.engines.base import has_cpu_tensors
from ttsq.workers.celery_worker import tune_heap

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def mapped(size):
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    during = libc.mallinfo2().hblkhd
    libc.free(block)
    return during - before >= size

engine = create_engine(Settings(**json.loads(sys.argv[1])))
engine.load()
engine.warmup()
if "history" in sys.argv[2:]:
    # What a library's load may leave behind: a big mapped block freed (glibc's dynamic rule then
    # raises the trim threshold to twice its size) and megabytes of heap freed into the top.
    libc.free(libc.malloc(8 << 20))
    for block in [libc.malloc(1 << 20) for _ in range(6)]:
        libc.free(block)
said = tune_heap(engine)
# Larger than all the heap's free memory (fordblks: free chunks and the top together): no free chunk can
# serve the block, so only the threshold decides between a mapping and growing the heap. (Blocks of a
# fixed 256 KiB came from free chunks whenever the load had left some that large: CI saw it.) Under
# glibc's 32 MiB ceiling for the adaptive threshold.
size = min(max(256 * 1024, libc.mallinfo2().fordblks + (1 << 20)), 30 << 20)
if "small" in sys.argv[2:]:
    size = 256 * 1024  # under an operator's 1 MiB threshold: never mapped, whatever the heap holds
print(json.dumps({"cpu_tensors": has_cpu_tensors(engine), "said": said, "size": size,
                  "mapped": [mapped(size) for _ in range(3)]}))
engine.close()
"""


def tuned(
    tmp_path: Path, env: dict[str, str] | None = None, history: bool = False, small: bool = False, **settings: object
) -> dict[str, object]:
    settings = {"storage_url": str(tmp_path / "audio"), "metrics_port": 0, **settings}
    environment = {k: v for k, v in os.environ.items() if k != GLIBC_VARIABLE} | (env or {})
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            SCRIPT,
            json.dumps(settings),
            *(["history"] if history else []),
            *(["small"] if small else []),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=environment,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("history", [False, True], ids=["fresh", "after-a-big-free"])
def test_an_engine_that_computes_elsewhere_gets_the_fixed_threshold(tmp_path: Path, history: bool) -> None:
    # After a big free the heap's top holds megabytes: the threshold, fixed, still maps what the heap
    # cannot serve from free memory.
    result = tuned(tmp_path, history=history, engine="espeak")
    assert result["cpu_tensors"] is False
    assert "fixed at 64 KiB" in str(result["said"])
    assert result["mapped"] == [True, True, True]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("engine", ["qwen", "qwen-fast"])
def test_torch_on_the_cpu_keeps_the_adaptive_threshold(
    engine: str, qwen_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    result = tuned(
        tmp_path,
        engine=engine,
        qwen_model=str(qwen_checkpoints["voice_design"]),
        qwen_device="cpu",
        qwen_max_frames=16,
    )
    assert result["cpu_tensors"] is True
    assert "left adaptive" in str(result["said"])
    # Freed once, a block of this size raises glibc's threshold past it: the later ones are heap.
    mapped = result["mapped"]
    assert isinstance(mapped, list) and mapped[1:] == [False, False]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_glibcs_own_variable_is_the_operators_choice_and_is_kept(tmp_path: Path) -> None:
    # A threshold above the blocks' size, set by the operator: the worker must not lower it to 64 KiB.
    result = tuned(tmp_path, env={GLIBC_VARIABLE: str(1024 * 1024)}, small=True, engine="espeak")
    assert f"set by {GLIBC_VARIABLE}=1048576" in str(result["said"])
    assert result["mapped"] == [False, False, False]
