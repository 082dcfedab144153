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
from ttsq.engines.base import frame_cap


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
