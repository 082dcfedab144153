"""``TTSQ_ENGINE=qwen-fast ttsq worker`` end to end, like ``test_qwen_worker.py`` for ``qwen``: real Redis,
the S3 server, a worker process decoding with ttsq's own loop on the tiny random checkpoints.

Random weights almost never sample the end token, so each job runs to its frame cap and the stored
WAV's length is known in advance.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import soundfile
from support import (
    MAX_FRAMES,
    SAMPLES_PER_FRAME,
    WORKER_START_S,
    WorkerProcess,
    qwen_settings,
    reference_file,
    run_cli,
    s3_keys,
    submit_cli,
)

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.engines import create_engine
from ttsq.engines.base import frame_cap
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["voice_design", "base"])
def test_qwen_fast_serves_jobs_end_to_end(
    kind: str,
    settings: Settings,
    qwen_checkpoints: dict[str, Path],
    start_worker: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = qwen_settings(settings, qwen_checkpoints[kind]).replace(engine="qwen-fast", max_batch=3)
    worker = start_worker(settings, timeout=WORKER_START_S)
    fields: dict[str, str] = {"mode": "voice_design"}
    args: list[str] = []
    if kind == "base":
        added = run_cli(
            "voices", "add", str(reference_file(tmp_path / "me.wav")), "--text", "This is my voice.", settings=settings
        )
        assert added.returncode == 0, added.stderr
        fields = {"mode": "voice_clone", "reference": added.stdout.decode().strip()}
        args = ["--mode", "voice_clone", "--reference", fields["reference"]]

    text = "Hello there, world."
    result = submit_cli(settings, text, "--seed", "1", *args, output=tmp_path / "out.wav")
    audio, rate = soundfile.read(tmp_path / "out.wav", dtype="float32")
    assert rate == 24_000 and audio.size == frame_cap(text, MAX_FRAMES) * SAMPLES_PER_FRAME
    assert result["truncated"] is True and result["engine"] == "qwen-fast" and result["model"] == kind
    assert f"{settings.storage_url.split('/', 3)[3]}/{result['object_key']}" in s3_keys(settings)

    # More jobs than slots, of mixed lengths: each gets its own cap, whatever it decoded beside.
    caps = [3, 17, 5, 24, 8, 11, 4]
    with Client(settings) as client:
        jobs = [client.submit(f"Line number {i}.", max_new_tokens=cap, seed=i, **fields) for i, cap in enumerate(caps)]
        results = [job.wait(240) for job in jobs]
    for cap, done in zip(caps, results, strict=True):
        assert done["engine"] == "qwen-fast" and done["truncated"] is True
        assert done["duration_s"] == pytest.approx(cap * SAMPLES_PER_FRAME / 24_000)
    assert "Traceback" not in worker.log()


@pytest.mark.parametrize("engine", ["qwen-fast", "qwen"])
def test_int8_weights_serve_jobs_through_the_queue_under_their_own_keys(
    engine: str,
    settings: Settings,
    qwen_checkpoints: dict[str, Path],
    start_worker: Callable[..., WorkerProcess],
) -> None:
    """``TTSQ_QWEN_QUANT=int8`` end to end: the worker announces a revision of its own, so the keys a
    producer predicts are not full precision's, and the runaway guard still cuts every row."""
    settings = qwen_settings(settings, qwen_checkpoints["voice_design"]).replace(
        engine=engine, max_batch=3, qwen_quant="int8"
    )
    worker = start_worker(settings, timeout=WORKER_START_S)
    full = create_engine(settings.replace(qwen_quant="none")).identity
    caps = [5, 12, 7, 9]
    with Client(settings) as client:
        jobs = [client.submit(f"Line number {i}.", max_new_tokens=cap, seed=i) for i, cap in enumerate(caps)]
        results = [job.wait(240) for job in jobs]
        again = client.submit("Line number 1.", max_new_tokens=12, seed=1).wait(60)
    for cap, done in zip(caps, results, strict=True):
        assert done["engine"] == engine and done["model_revision"] == full.revision + ".int8"
        assert done["truncated"] is True and done["cached"] is False
        assert done["duration_s"] == pytest.approx(cap * SAMPLES_PER_FRAME / 24_000)
    request = SynthesisRequest(text="Line number 1.", mode="voice_design", max_new_tokens=12, seed=1)
    assert results[1]["key"] != content_key(request, full)  # never the full-precision key
    assert again["cached"] is True and again["key"] == results[1]["key"]
    log = worker.log()
    assert "int8 weights for" in log and "MB saved" in log and "Traceback" not in log
