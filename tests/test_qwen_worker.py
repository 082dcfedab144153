"""``TTSQ_ENGINE=qwen ttsq worker`` end to end: real Redis, the S3 server, worker processes running the
real qwen-tts path on tiny random-weight checkpoints, and ``ttsq`` commands as subprocesses.

Random weights almost never sample the end token, so each job runs to its frame cap and the stored
WAV's length is known in advance.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import boto3
import pytest
import soundfile
from celery import Celery
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

from ttsq.app import queue_for
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.engines.base import EngineIdentity, frame_cap
from ttsq.errors import InvalidRequest
from ttsq.records.owner import RedisOwner

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["voice_design", "custom_voice", "base"])
def test_each_mode_is_served_end_to_end(
    kind: str,
    settings: Settings,
    qwen_checkpoints: dict[str, Path],
    start_worker: Callable[..., WorkerProcess],
    tmp_path: Path,
) -> None:
    settings = qwen_settings(settings, qwen_checkpoints[kind])
    worker = start_worker(settings, timeout=WORKER_START_S)
    text = "안녕하세요. 반갑습니다."
    args = {
        "voice_design": ["--instruct", "차분한 30대 여성 목소리"],
        "custom_voice": ["--mode", "custom_voice", "--speaker", "Sohee"],
    }.get(kind, [])
    if kind == "base":
        added = run_cli(
            "voices", "add", str(reference_file(tmp_path / "me.wav")), "--text", "This is my voice.", settings=settings
        )
        assert added.returncode == 0, added.stderr
        args = ["--mode", "voice_clone", "--reference", added.stdout.decode().strip()]

    result = submit_cli(settings, text, "--language", "ko", "--seed", "1", *args, output=tmp_path / "out.wav")
    audio, rate = soundfile.read(tmp_path / "out.wav", dtype="float32")
    cap = frame_cap(text, MAX_FRAMES)
    assert rate == 24_000 and result["sample_rate"] == 24_000
    assert audio.size == cap * SAMPLES_PER_FRAME  # ran to its frame cap, and no further
    assert result["truncated"] is True and result["engine"] == "qwen" and result["model"] == kind
    assert f"{settings.storage_url.split('/', 3)[3]}/{result['object_key']}" in s3_keys(settings)

    if kind == "base":  # several jobs with the same reference: one clone prompt in this worker
        with Client(settings) as client:
            jobs = [client.submit(f"Line number {i}.", mode="voice_clone", reference=args[-1]) for i in range(3)]
            assert all(job.wait(240)["truncated"] for job in jobs)
        assert worker.log().count(f"clone prompt computed for {args[-1]}") == 1


def test_bad_clone_requests_are_refused_clearly_and_the_worker_keeps_serving(
    settings: Settings, qwen_checkpoints: dict[str, Path], start_worker: Callable[..., WorkerProcess], tmp_path: Path
) -> None:
    settings = qwen_settings(settings, qwen_checkpoints["base"])
    start_worker(settings, timeout=WORKER_START_S)

    def refused(*args: str) -> str:
        out = run_cli(*args, settings=settings)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        return out.stderr.decode().strip()

    missing = "voices/" + "e" * 64 + ".wav"
    assert refused("submit", "Hi.", "--mode", "voice_clone").startswith(
        "ttsq: error: invalid reference: is required for mode voice_clone"
    )
    assert refused("submit", "Hi.", "--mode", "voice_clone", "--reference", missing).startswith(
        f"ttsq: error: invalid reference: no voice {missing} in storage"
    )
    assert refused("submit", "Hi.", "--mode", "voice_clone", "--reference", "../../secrets.wav").startswith(
        "ttsq: error: invalid reference: expected a voice key"
    )
    (tmp_path / "notes.txt").write_text("not audio at all")
    assert refused("voices", "add", str(tmp_path / "notes.txt"), "--text", "x").startswith(
        "ttsq: error: invalid file: is not audio"
    )
    # The fleet is known (this worker announced voice_clone): another mode is refused at submit time.
    assert refused("submit", "Hi.", "--instruct", "calm").startswith(
        "ttsq: error: invalid mode: no running worker serves voice_design; the workers online serve voice_clone"
    )
    assert run_cli("submit", "Hi.", settings=settings).stderr.decode().count("\n") == 1  # one line, no traceback

    # A raw send_task skips every producer check: the worker refuses it per job and keeps serving.
    bucket, _, prefix = settings.storage_url.removeprefix("s3://").partition("/")
    corrupt = "voices/" + "c" * 64 + ".wav"
    boto3.client("s3", endpoint_url=settings.s3_endpoint_url).put_object(
        Bucket=bucket, Key=f"{prefix}/{corrupt}", Body=b"RIFF but not really a wave file"
    )
    producer = Celery(broker=settings.broker_url, backend=settings.result_backend)
    clone_queue = queue_for(settings.queue, "voice_clone")
    sent = {
        "reference": producer.send_task(
            "ttsq.synthesize", queue=clone_queue, kwargs={"text": "Hi.", "mode": "voice_clone", "reference": corrupt}
        ),
        "mode": producer.send_task(
            "ttsq.synthesize", queue=clone_queue, kwargs={"text": "Hi.", "mode": "custom_voice", "speaker": "vivian"}
        ),
    }
    for field, async_result in sent.items():
        with pytest.raises(InvalidRequest) as raised:
            async_result.get(timeout=240)
        assert raised.value.field == field
    with Client(settings) as client:
        good = client.add_voice(reference_file(tmp_path / "ok.wav").read_bytes(), "Fine.")
        assert client.submit("Still serving.", mode="voice_clone", reference=good).wait(240)["duration_s"] > 0


def test_unknown_speaker_is_refused_at_submit_when_the_fleet_is_known(settings: Settings) -> None:
    RedisOwner(settings, role="test").identities.publish(
        settings.queue,
        EngineIdentity(
            engine="qwen",
            model="Qwen3-TTS-12Hz-1.7B-CustomVoice",
            revision="r",
            sample_rate=24_000,
            modes=("custom_voice",),
            languages=("auto", "korean"),
            speakers=("sohee", "vivian"),
            max_frames=250,
        ).to_dict(),
    )
    # The producer needs no engine setting (its TTSQ_ENGINE is the default here): the fleet names it.
    with Client(settings) as client, pytest.raises(InvalidRequest) as raised:
        client.submit("안녕하세요.", mode="custom_voice", speaker="Nobody")
    assert raised.value.field == "speaker" and "sohee, vivian" in str(raised.value)
    with Client(settings) as client, pytest.raises(InvalidRequest) as raised:
        client.submit("Bonjour.", mode="custom_voice", speaker="sohee", language="french")
    assert raised.value.field == "language"
    # A text far beyond the model's 20 s per job is refused, not returned cut off; so is a larger cap.
    with Client(settings) as client, pytest.raises(InvalidRequest) as raised:
        client.submit("A sentence that goes on. " * 60, mode="custom_voice", speaker="sohee")
    assert raised.value.field == "text" and "limit is 20 s" in str(raised.value)
    with Client(settings) as client, pytest.raises(InvalidRequest) as raised:
        client.submit("Short.", mode="custom_voice", speaker="sohee", max_new_tokens=251)
    assert raised.value.field == "max_new_tokens"


def test_the_cpu_engine_needs_no_qwen_extra(tmp_path: Path) -> None:
    """espeak and the command line import nothing from the qwen extra (blocked here, as if absent)."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in {'torch', 'torchaudio', 'transformers', 'qwen_tts'}:\n"
        "            raise ImportError('not installed: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['ttsq', 'submit', 'No torch here.', '--embedded', '-o', sys.argv[1]]\n"
        "from ttsq.cli.main import main\n"
        "main()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "a.wav")], env=env, capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr.decode()
    assert soundfile.info(io.BytesIO((tmp_path / "a.wav").read_bytes())).duration > 0.5
