"""The command line as a new user meets it (issue 17): help that names its variables, ``ttsq config``,
flags after the command, messages that say what to do, outputs that agree with themselves.

Real parts throughout: subprocesses of ``ttsq``, the suite's redis-server and S3 server, real
``ttsq worker`` processes with espeak.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner
from support import WorkerProcess, published_states, queue_length, run_cli, settings_env

from ttsq.cli.main import cli
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.redis_server import free_port

StartWorker = Callable[..., WorkerProcess]
CONNECTION = ("broker_url", "result_backend", "cache_url", "storage_url")


def flat(text: str) -> str:
    """Help text with its line wrapping undone."""
    return " ".join(text.split())


# --- 1. help names the variables; ttsq config ----------------------------------------------------


@pytest.mark.parametrize(
    ("args", "variables"),
    [
        ([], ["TTSQ_BROKER_URL", "TTSQ_RESULT_BACKEND", "TTSQ_CACHE_URL", "TTSQ_STORAGE_URL"]),
        (["submit"], ["TTSQ_BROKER_URL", "TTSQ_STORAGE_URL"]),
        (["worker"], ["TTSQ_ENGINE", "TTSQ_MAX_BATCH", "TTSQ_MAX_WAIT_MS", "TTSQ_METRICS_PORT", "TTSQ_BROKER_URL"]),
        (["bench"], ["TTSQ_ENGINE", "TTSQ_MAX_BATCH", "TTSQ_MAX_WAIT_MS", "TTSQ_CACHE_URL"]),
        (["serve"], ["TTSQ_GATEWAY_HOST", "TTSQ_GATEWAY_PORT", "TTSQ_CACHE_URL"]),
        (["keys", "add"], ["TTSQ_CACHE_URL"]),
    ],
)
def test_help_names_the_variable_of_every_option_that_has_one(args: list[str], variables: list[str]) -> None:
    result = CliRunner().invoke(cli, [*args, "--help"])
    assert result.exit_code == 0, result.output
    for variable in variables:
        assert f"env var: {variable}" in flat(result.output), (variable, result.output)


def test_config_prints_the_effective_settings_where_each_came_from_and_masks_secrets() -> None:
    env = {
        "TTSQ_CACHE_URL": "redis://:hunter2@cache-host:6379/2?password=hunter3",
        "TTSQ_MAX_BATCH": "16",
    }
    flags = ["--broker-url", "redis://ops:s3cret@broker-host:6379/0"]
    text = run_cli(*flags, "config", env=env)
    assert text.returncode == 0, text.stderr
    lines = {line.split("=", 1)[0]: line for line in text.stdout.decode().splitlines()}
    assert "hunter" not in text.stdout.decode() and "s3cret" not in text.stdout.decode()
    assert lines["TTSQ_BROKER_URL"].split()[0] == "TTSQ_BROKER_URL=redis://ops:***@broker-host:6379/0"
    assert lines["TTSQ_BROKER_URL"].endswith("# flag --broker-url")
    assert lines["TTSQ_CACHE_URL"].endswith("# environment")
    assert lines["TTSQ_MAX_BATCH"].split()[0] == "TTSQ_MAX_BATCH=16"
    assert lines["TTSQ_ENGINE"].split() == ["TTSQ_ENGINE=espeak", "#", "default"]
    assert len(lines) == len(Settings.__dataclass_fields__)

    as_json = run_cli("config", *flags, "--json", env=env)  # the flag after the command, too
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    assert "hunter" not in as_json.stdout.decode() and "s3cret" not in as_json.stdout.decode()
    assert data["broker_url"] == {
        "variable": "TTSQ_BROKER_URL",
        "value": "redis://ops:***@broker-host:6379/0",
        "source": "flag --broker-url",
    }
    assert data["max_batch"] == {"variable": "TTSQ_MAX_BATCH", "value": 16, "source": "environment"}
    assert data["result_backend"]["source"] == "default"
    assert data["cache_url"]["value"] == "redis://:***@cache-host:6379/2?password=***"

    bad = run_cli("config", env={"TTSQ_MAX_BATCH": "0"})
    assert bad.returncode == 2 and bad.stderr.decode().strip() == "ttsq: error: TTSQ_MAX_BATCH: must be 1..256"


# --- 2. the global options after the subcommand --------------------------------------------------


def test_connection_flags_work_after_the_subcommand_and_the_later_one_wins(
    settings: Settings, start_worker: StartWorker
) -> None:
    start_worker(settings)
    down = f"redis://127.0.0.1:{free_port()}"
    # The environment points at a Redis that is not there: only the flags reach the real one.
    env = {"TTSQ_BROKER_URL": f"{down}/0", "TTSQ_RESULT_BACKEND": f"{down}/1", "TTSQ_CACHE_URL": f"{down}/2"}
    real = [arg for name in CONNECTION for arg in (f"--{name.replace('_', '-')}", getattr(settings, name))]
    wrong = [arg for name in CONNECTION[:3] for arg in (f"--{name.replace('_', '-')}", f"{down}/0")]
    out = run_cli("submit", *real, "Flags after the command.", "--json", settings=settings, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["format"] == "wav"
    queued = run_cli(*wrong, "submit", "Both places.", *real, "--no-wait", "--json", settings=settings, env=env)
    assert queued.returncode == 0, queued.stderr
    job_id = json.loads(queued.stdout)["id"]
    result = run_cli(*wrong, "result", job_id, *real, "--json", settings=settings, env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["duration_s"] > 0


# --- 3. a text over the limit points to -f -------------------------------------------------------


def test_a_text_over_the_job_limit_points_to_documents(settings: Settings) -> None:
    out = run_cli("submit", "Long sentence here. " * 300, "--timeout", "2", settings=settings)
    message = out.stderr.decode().strip()
    assert out.returncode == 2 and len(message.splitlines()) == 1, message
    assert message.startswith("ttsq: error: invalid text: is 5999 characters; the limit is 5000")
    assert "ttsq submit -f FILE" in message
    assert queue_length(settings) == 0
    # The core error, shared with the HTTP gateway and send_task, says nothing about a flag.
    from ttsq.errors import InvalidRequest

    with Client(settings) as client, pytest.raises(InvalidRequest) as info:
        client.submit("Long sentence here. " * 300)
    assert "-f" not in str(info.value)


# --- 4. a document's state never goes back to STARTED while it is stitched -----------------------


def test_a_document_being_stitched_keeps_its_progress(settings: Settings, start_worker: StartWorker) -> None:
    chunked = settings.replace(doc_target_chars=1)
    start_worker(chunked)
    with published_states(chunked) as messages, Client(chunked) as client:
        job = client.submit_document(" ".join(f"Stitch sentence {n}." for n in range(5)))
        assert job.wait(timeout=120)["document"]["chunks"] == 5  # type: ignore[typeddict-item]
    states = [(m["status"], m["result"]) for m in messages if m.get("task_id") == job.id]
    names = [state for state, _ in states]
    assert names[-1] == "SUCCESS" and "PROGRESS" in names, names
    after = names[names.index("PROGRESS") :]
    assert set(after) == {"PROGRESS", "SUCCESS"}, names  # never back to STARTED
    last = states[-2][1]
    assert last["phase"] == "stitching" and last["chunks_done"] == last["chunks_total"] == 5, states
    phases = [result["phase"] for state, result in states if state == "PROGRESS"]
    assert phases[0] == "synthesizing" and phases == sorted(phases, key=["synthesizing", "stitching"].index)

    # What `ttsq status` prints in that state (recorded as the worker stored it, on an id of this test's).
    from ttsq.app import make_app

    app = make_app(chunked)
    try:
        app.backend.store_result("papercut-stitching", last, "PROGRESS")
    finally:
        app.close()
    out = run_cli("status", "papercut-stitching", settings=chunked)
    assert out.stdout.decode() == f"PROGRESS 5/5 chunks, {last['audio_s']:.1f} s of audio, stitching\n", out


# --- 5. -o and --format that disagree ------------------------------------------------------------


def test_output_extension_and_format_that_disagree_are_a_usage_error(settings: Settings, tmp_path: Path) -> None:
    target = tmp_path / "x.flac"
    out = run_cli("submit", "Which one?", "-o", str(target), "--format", "mp3", "--timeout", "2", settings=settings)
    message = out.stderr.decode().strip()
    assert out.returncode == 2 and len(message.splitlines()) == 1, message
    assert "--format mp3" in message and f"-o {target}" in message
    assert not target.exists() and queue_length(settings) == 0


def test_result_refuses_to_write_a_wav_result_into_an_mp3_name(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    queued = run_cli("submit", "A WAV result.", "--no-wait", "--json", settings=settings)
    job_id = json.loads(queued.stdout)["id"]
    target = tmp_path / "x.mp3"
    out = run_cli("result", job_id, "-o", str(target), settings=settings)
    message = out.stderr.decode().strip()
    assert out.returncode == 2 and "the result is wav" in message and "--format mp3" in message, message
    assert not target.exists()
    wav = tmp_path / "x.wav"
    assert run_cli("result", job_id, "-o", str(wav), settings=settings).returncode == 0
    assert wav.read_bytes()[:4] == b"RIFF"


# --- 6. only documents draw a chunks bar ---------------------------------------------------------


@pytest.mark.slow
def test_only_a_document_draws_a_chunks_bar(settings: Settings, start_worker: StartWorker, tmp_path: Path) -> None:
    start_worker(settings)
    single = run_cli("submit", "One short job.", "-o", str(tmp_path / "one.wav"), settings=settings)
    assert single.returncode == 0, single.stderr
    assert re.fullmatch(rb"ttsq: job \S+ accepted; waiting for it\n", single.stderr), single.stderr  # no bar
    # A document that fits one chunk is one job too: no bar (it drew "chunks 1/1" before).
    short = tmp_path / "short.txt"
    short.write_text("One sentence. Another one.", encoding="utf-8")
    out = run_cli("submit", "-f", str(short), "-o", str(tmp_path / "short.wav"), settings=settings)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(rb"ttsq: job \S+ accepted \(1 chunk\); waiting for it\n", out.stderr), out.stderr
    assert "1 chunk (0 from the cache)" in out.stdout.decode()
    # Several chunks (200 characters each by default): the bar counts them.
    document = tmp_path / "doc.txt"
    document.write_text(" ".join(f"Sentence number {i} of a document with several chunks." for i in range(12)))
    out = run_cli("submit", "-f", str(document), "-o", str(tmp_path / "doc.wav"), settings=settings)
    assert out.returncode == 0, out.stderr
    # The count, as plain lines here: stderr is a pipe (a terminal gets click's bar).
    assert re.search(r"^\d+/\d+ chunks", out.stderr.decode(), re.M), out.stderr


# --- 7. ttsq bench starts with its report --------------------------------------------------------


def test_bench_output_starts_with_its_report(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    out = subprocess.run(
        [sys.executable, "-m", "ttsq.cli.main", "bench", "--embedded", "-n", "4"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # what a terminal shows: both streams
        timeout=120,
    )
    lines = out.stdout.decode().splitlines()
    assert out.returncode == 0, lines[-20:]
    assert lines[0].startswith("ttsq bench: synthesize, 4 jobs"), lines[:3]


# --- 8. ttsq stats: the table and its JSON name the same device ----------------------------------


def test_stats_table_and_json_name_the_same_device(settings: Settings, start_worker: StartWorker) -> None:
    worker = start_worker(settings)
    data = json.loads(run_cli("stats", "--json", "--ping-timeout", "0", settings=settings).stdout)
    (entry,) = [w for w in data["workers"] if w["node"] == worker.hostname]
    assert entry["device"] == "cpu"  # this test's worker sees no GPU (CUDA_VISIBLE_DEVICES unset)
    table = run_cli("stats", "--ping-timeout", "0", settings=settings).stdout.decode()
    (row,) = [line for line in table.splitlines() if line.startswith(worker.hostname)]
    assert row.split()[2] == entry["device"]


# --- 9. ignored lists only the fields the user set -----------------------------------------------


@pytest.mark.slow
def test_a_document_reports_only_the_ignored_fields_the_user_set(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    document = tmp_path / "doc.txt"
    document.write_text("One sentence. Another one.", encoding="utf-8")
    plain = run_cli("submit", "-f", str(document), "--json", settings=settings)
    assert plain.returncode == 0, plain.stderr
    assert json.loads(plain.stdout)["ignored"] == []
    line = run_cli("submit", "-f", str(document), "--format", "ogg", settings=settings).stdout.decode()
    assert "ignored" not in line, line
    seeded = run_cli("submit", "-f", str(document), "--seed", "7", "--instruct", "calm", "--json", settings=settings)
    assert seeded.returncode == 0, seeded.stderr
    assert json.loads(seeded.stdout)["ignored"] == ["instruct", "seed"]


# --- 10. a closed pipe ends quietly (issue 26) ---------------------------------------------------


@pytest.mark.parametrize("args", [["config"], ["submit", "Into a closed pipe.", "--json"]])
def test_a_closed_stdout_pipe_ends_quietly_with_the_sigpipe_status(
    settings: Settings, start_worker: StartWorker, tmp_path: Path, args: list[str]
) -> None:
    if args[0] == "submit":
        start_worker(settings)
    errors = tmp_path / "stderr"
    with errors.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "ttsq.cli.main", *args],
            env=settings_env(settings),
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
        assert process.stdout is not None
        process.stdout.close()  # the reader goes away (`| head -c 10`) before ttsq prints anything
        code = process.wait(timeout=120)
    # No traceback, no "Exception ignored", no error line: for submit, only the job's id, said before the wait.
    assert re.fullmatch(rb"(ttsq: job \S+ accepted; waiting for it\n)?", errors.read_bytes()), errors.read_bytes()
    assert code == 141  # 128 + SIGPIPE, as a shell reports `cat` or `grep` stopped by it


# --- 11. -o with an extension that names no format -----------------------------------------------


@pytest.mark.slow
def test_an_output_name_that_names_no_format_is_a_usage_error(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    target = tmp_path / "x.aac"
    for extra in ([], ["--format", "mp3"], ["--no-wait"]):
        out = run_cli("submit", "Which format?", "-o", str(target), *extra, "--timeout", "2", settings=settings)
        message = out.stderr.decode().strip()
        assert out.returncode == 2 and len(message.splitlines()) == 1, message
        assert "'-o' / '--output'" in message and ".aac" in message, message
        assert all(f".{extension}" in message for extension in ("wav", "flac", "ogg", "opus", "mp3")), message
    assert not target.exists() and queue_length(settings) == 0

    start_worker(settings)
    queued = run_cli("submit", "A WAV result.", "--no-wait", "--json", settings=settings)
    job_id = json.loads(queued.stdout)["id"]
    out = run_cli("result", job_id, "-o", str(target), settings=settings)
    assert out.returncode == 2 and ".aac" in out.stderr.decode() and not target.exists(), out.stderr
    # The extensions that name a format still pick it; .opus is Ogg Opus.
    for name, magic in (("x.mp3", (b"ID3", b"\xff")), ("x.opus", (b"OggS",)), ("x.FLAC", (b"fLaC",))):
        out = run_cli("submit", "A named format.", "-o", str(tmp_path / name), settings=settings)
        assert out.returncode == 0, out.stderr
        assert (tmp_path / name).read_bytes().startswith(magic), name


# --- 12. --each-line --output-dir ----------------------------------------------------------------


@pytest.mark.slow
def test_each_line_saves_its_audio_in_the_output_dir(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\n\nThird line.\n" + "Too long. " * 600 + "\nFifth line.\n", encoding="utf-8")
    refused = run_cli("submit", "One job.", "--output-dir", str(tmp_path / "out"), settings=settings)
    assert refused.returncode == 2 and "--each-line" in refused.stderr.decode(), refused.stderr

    start_worker(settings)
    folder = tmp_path / "out" / "clips"  # created, parents too
    out = run_cli(
        "submit", "-f", str(lines), "--each-line", "--output-dir", str(folder), "--format", "mp3", "--json",
        settings=settings,
    )  # fmt: skip
    assert out.returncode == 1, out.stderr  # line 4 is over the job limit: it fails alone
    records = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert [(r["line"], r["state"]) for r in records] == [(1, "done"), (3, "done"), (4, "failed"), (5, "done")]
    assert sorted(path.name for path in folder.iterdir()) == ["0001.mp3", "0003.mp3", "0005.mp3"]
    saved = [str(folder / name) if name else None for name in ("0001.mp3", "0003.mp3", None, "0005.mp3")]
    assert [r.get("file") for r in records] == saved
    assert all(path.read_bytes().startswith((b"ID3", b"\xff")) for path in folder.iterdir())

    # --output-dir waits for its files even with --no-wait (as -o does).
    again = run_cli(
        "submit", "-f", str(lines), "--each-line", "--output-dir", str(tmp_path / "again"), "--no-wait",
        settings=settings,
    )  # fmt: skip
    assert again.returncode == 1, again.stderr
    assert sorted(path.name for path in (tmp_path / "again").iterdir()) == ["0001.wav", "0003.wav", "0005.wav"]


# --- 13. ttsq cancel -----------------------------------------------------------------------------


@pytest.mark.slow
def test_cancel_calls_off_a_queued_job_and_names_the_outcome(settings: Settings, start_worker: StartWorker) -> None:
    queued = run_cli("submit", "Never spoken.", "--no-wait", "--json", settings=settings)  # no worker yet
    job_id = json.loads(queued.stdout)["id"]
    out = run_cli("cancel", job_id, settings=settings)
    assert out.returncode == 0 and out.stdout.decode() == f"cancelled {job_id}\n", out
    assert run_cli("status", job_id, settings=settings).stdout.decode().split()[0] == "REVOKED"

    unknown = run_cli("cancel", "no-such-job", settings=settings)
    message = unknown.stderr.decode().strip()
    assert unknown.returncode == 1 and len(message.splitlines()) == 1, message
    assert message.startswith("ttsq: error: unknown job ID 'no-such-job'"), message

    start_worker(settings)
    done = json.loads(run_cli("submit", "Spoken at once.", "--no-wait", "--json", settings=settings).stdout)["id"]
    assert run_cli("result", done, settings=settings).returncode == 0
    finished = run_cli("cancel", done, "--json", settings=settings)
    # Not cancelled: exit 1 (issue 43), and the state it had says why.
    assert finished.returncode == 1 and json.loads(finished.stdout) == {"id": done, "state": "SUCCESS"}
    line = run_cli("cancel", done, settings=settings).stderr.decode()
    assert line == f"ttsq: not cancelled: job {done} had already finished (SUCCESS)\n"
    never = run_cli("result", job_id, "--timeout", "10", settings=settings)
    assert never.returncode == 1 and "cancel" in never.stderr.decode(), never.stderr


# --- 14. Ctrl-C while ttsq submit waits ----------------------------------------------------------


def test_ctrl_c_while_waiting_names_the_job_and_how_to_reattach_or_cancel(
    settings: Settings,
    start_worker: StartWorker,
    faulty_engine: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events, hold = tmp_path / "events", tmp_path / "hold"
    hold.touch()  # the engine holds the job until the test has interrupted the command
    monkeypatch.setenv("FAULTY_ENGINE_EVENTS", str(events))
    monkeypatch.setenv("FAULTY_ENGINE_HOLD", str(hold))
    settings = settings.replace(engine=faulty_engine)
    start_worker(settings)
    # `ttsq submit` as `python -m ttsq.cli.main` runs it from a terminal: Ctrl-C raises KeyboardInterrupt.
    # A suite started in the background (`pytest &`, as a CI runner may) has SIGINT ignored, and every
    # process it starts inherits that (Python leaves an ignored SIGINT ignored): the command would
    # rightly not hear the interrupt. Every thread's stack is dumped on SIGUSR1, if it outlives it.
    launch = (
        "import faulthandler, runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "faulthandler.register(signal.SIGUSR1, all_threads=True); "
        "sys.argv[0] = 'ttsq'; runpy.run_module('ttsq.cli.main', run_name='__main__')"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", launch, "submit", "A held job [held]."],
        env=settings_env(settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert process.stderr is not None
    try:
        accepted = process.stderr.readline().decode().strip()  # the command waits (the worker may be first)
        deadline = time.monotonic() + 60
        while not (events.exists() and events.read_text()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert events.read_text(), "the job never reached the engine"
        with open(f"/proc/{process.pid}/status") as status:  # its signal masks, said if it fails
            masks = [line.strip() for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))]
        process.send_signal(signal.SIGINT)  # what Ctrl-C sends, while the engine holds the job
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGUSR1)
            time.sleep(1)
            process.kill()
            stdout, stderr = process.communicate()
            raise AssertionError(
                f"still running 60 s after SIGINT; {masks}; {accepted!r}:\n{stderr.decode()}"
            ) from None
    finally:
        hold.unlink()
    lines = stderr.decode().strip().splitlines()
    assert process.returncode == 130 and stdout == b"" and len(lines) == 1, (
        process.returncode,
        masks,
        accepted,
        stdout,
        stderr,
    )
    (message,) = lines
    match = re.fullmatch(r"ttsq: interrupted; job (\S+) keeps running: `ttsq result \1` waits for it again, "
                         r"`ttsq cancel \1` cancels it", message)  # fmt: skip
    assert match, message
    assert accepted == f"ttsq: job {match.group(1)} accepted; waiting for it"  # named before the wait, too
    # It did keep running: re-attaching gets its result.
    again = run_cli("result", match.group(1), "--json", settings=settings)
    assert again.returncode == 0 and json.loads(again.stdout)["duration_s"] > 0, again.stderr


# --- 15. the job id first; plain progress lines off a terminal (issue 26) ------------------------


@pytest.mark.slow
def test_submit_names_the_job_on_stderr_before_its_result_and_keeps_stdout_parseable(
    settings: Settings, start_worker: StartWorker
) -> None:
    """Across a Redis restart: tests/test_cli_outage.py."""
    start_worker(settings)
    out = run_cli("submit", "Named before it is done.", "--json", settings=settings)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # stdout is the result's JSON alone
    match = re.fullmatch(r"ttsq: job (\S+) accepted; waiting for it", out.stderr.decode().strip())
    assert match, out.stderr
    status = run_cli("status", match.group(1), "--json", settings=settings)
    assert status.returncode == 0 and json.loads(status.stdout)["result"]["key"] == result["key"], status.stderr
    # Answered from the cache: there is no job to name, and nothing but the result is printed.
    again = run_cli("submit", "Named before it is done.", "--json", settings=settings)
    assert again.returncode == 0 and again.stderr == b"" and json.loads(again.stdout)["cached"], again.stderr


def test_document_progress_off_a_terminal_is_plain_lines_one_per_change(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings.replace(max_batch=1))  # chunk after chunk: the count moves step by step
    document = tmp_path / "doc.txt"
    document.write_text(" ".join(f"Sentence number {i} of a document with several chunks." for i in range(24)))
    out = run_cli("submit", "-f", str(document), "--json", settings=settings)  # stderr is a pipe here
    assert out.returncode == 0, out.stderr
    chunks = json.loads(out.stdout)["document"]["chunks"]
    assert chunks >= 4
    accepted, *lines = out.stderr.decode().splitlines()
    assert re.fullmatch(rf"ttsq: job \S+ accepted \({chunks} chunks\); waiting for it", accepted), accepted
    assert "\r" not in out.stderr.decode() and "[" not in out.stderr.decode()  # no bar, no redraws
    counts = []
    for line in lines:
        match = re.fullmatch(rf"(\d+)/{chunks} chunks(, stitching)?", line)
        assert match, lines
        counts.append((int(match.group(1)), bool(match.group(2))))
    assert counts and len(counts) == len(set(counts)), lines  # at most one line per change
    assert counts == sorted(counts), lines  # and they only go forward
