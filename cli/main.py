"""``ttsq``: submit speech jobs, look them up, run a worker.

Thin by design: parse flags, build ``Settings``, call ``ttsq``. Errors are one line on stderr and a
non-zero exit (2 for bad input or settings, 1 for everything else), never a traceback.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import click

from ttsq import __version__
from ttsq.config import Settings
from ttsq.errors import ConfigError, InvalidRequest, TTSQError
from ttsq.request import FORMATS, LANGUAGES, JobResult

if TYPE_CHECKING:
    from ttsq.client import Client, Job

F = TypeVar("F", bound=Callable[..., Any])


def _one_line_errors(command: F) -> F:
    """Turn ttsq's errors into ``ttsq: error: ...`` and an exit code."""
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except click.ClickException:
            raise  # usage errors: main() prints them as one line
        except (InvalidRequest, ConfigError) as exc:
            message, code = str(exc), 2
        except TTSQError as exc:
            message, code = str(exc), 1
        except OSError as exc:
            message, code = f"{type(exc).__name__}: {exc}", 1
        except Exception as exc:  # a bug or an unforeseen library error: still one line, still non-zero
            message, code = f"unexpected {type(exc).__name__}: {exc}", 1
        # Exit outside the except block: the traceback (and the Celery objects its frames hold) is
        # released now, not during interpreter shutdown where their finalizers print noise.
        _fail(message, code)
    return wrapper  # type: ignore[return-value]


def _fail(message: str, code: int) -> None:
    click.echo(f"ttsq: error: {message.splitlines()[0] if message else 'failed'}", err=True)
    sys.exit(code)


def _settings(ctx: click.Context, **overrides: Any) -> Settings:
    return Settings.from_env(**ctx.obj, **overrides)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ttsq")
@click.option("--broker-url", envvar="TTSQ_BROKER_URL", help="Celery broker (redis://...). [TTSQ_BROKER_URL]")
@click.option("--result-backend", envvar="TTSQ_RESULT_BACKEND",
              help="Celery result backend (redis://...). [TTSQ_RESULT_BACKEND]")
@click.option("--cache-url", envvar="TTSQ_CACHE_URL", help="Redis for the cache index. [TTSQ_CACHE_URL]")
@click.option("--storage-url", envvar="TTSQ_STORAGE_URL",
              help="s3://bucket/prefix or a local folder. [TTSQ_STORAGE_URL]")
@click.pass_context
def cli(ctx: click.Context, broker_url: str | None, result_backend: str | None, cache_url: str | None,
        storage_url: str | None) -> None:
    """ttsq: distributed text-to-speech on Celery and Redis."""
    ctx.obj = {"broker_url": broker_url, "result_backend": result_backend, "cache_url": cache_url,
               "storage_url": storage_url}


@cli.command()
@click.argument("text", required=False)
@click.option("-f", "--file", "text_file",
              type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=Path),
              default=None,
              help="Read the text from this file ('-': stdin) as one document of any length: it is split into "
                   "chunk jobs and stitched into one audio file, with a progress bar while it runs.")
@click.option("--each-line", is_flag=True,
              help="With -f: one ordinary job per non-blank line instead (many short clips), with a progress bar "
                   "and a summary; --json prints one record per line.")
@click.option("--mode", default="voice_design", show_default=True,
              help="voice_design (a voice described in words), custom_voice (a named speaker) or "
                   "voice_clone (a stored reference voice).")
@click.option("--instruct", default="", help="Voice description, in words (VoiceDesign; style for CustomVoice).")
@click.option("--speaker", default="", help="Speaker name (custom_voice).")
@click.option("--reference", default="", help="Voice key from `ttsq voices add` (voice_clone).")
@click.option("--language", default="auto", show_default=True,
              help=f"One of {', '.join(LANGUAGES)}, or a code like ko, en, ja.")
@click.option("--format", "audio_format", default=None,
              help=f"Output format: {', '.join(FORMATS)}. Default: from the -o extension, else wav.")
@click.option("--seed", type=int, default=None, help="Sampling seed (part of the cache key).")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (engine default if unset).")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling threshold.")
@click.option("--top-k", type=int, default=None, help="Top-k sampling.")
@click.option("--repetition-penalty", type=float, default=None, help="Repetition penalty.")
@click.option("--max-new-tokens", type=int, default=None,
              help="Frame cap (12.5 frames per second of audio); derived from the text if unset.")
@click.option("--deadline-s", type=float, default=None,
              help="Drop the job unsynthesized if it has not started within this many seconds.")
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the result.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the audio to this file (implies --wait).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option("--embedded", is_flag=True,
              help="Start a private Redis and an in-process espeak worker for this one job.")
@click.pass_context
@_one_line_errors
def submit(ctx: click.Context, text: str | None, text_file: Path | None, each_line: bool, mode: str, instruct: str,
           speaker: str, reference: str, language: str,
           audio_format: str | None,
           seed: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
           repetition_penalty: float | None, max_new_tokens: int | None, deadline_s: float | None, wait: bool,
           timeout: float,
           output: Path | None, as_json: bool, embedded: bool) -> None:
    """Synthesize TEXT (or '-' to read it from stdin), or a document with -f FILE."""
    from ttsq.client import Client

    if (text is None) == (text_file is None):
        raise click.UsageError("give TEXT as an argument or a file with -f FILE (one of them)")
    if each_line and text_file is None:
        raise click.UsageError("--each-line reads the lines of -f FILE")
    if each_line and output is not None:
        raise click.UsageError("--each-line makes one file per line: print their URLs with --json instead of -o")
    if text_file is not None:
        text = _read_text(sys.stdin.buffer.read() if str(text_file) == "-" else text_file.read_bytes())
    elif text == "-":
        text = _read_text(sys.stdin.buffer.read())
    text = cast(str, text)  # one of the two was given, checked above
    if audio_format is None:
        suffix = output.suffix.lower().lstrip(".") if output else ""
        audio_format = suffix if suffix in FORMATS else "wav"
    fields: dict[str, Any] = {"mode": mode, "instruct": instruct, "language": language, "format": audio_format}
    fields.update({name: value for name, value in (("speaker", speaker), ("reference", reference)) if value})
    sampling = {"seed": seed, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "repetition_penalty": repetition_penalty, "max_new_tokens": max_new_tokens}
    fields.update({name: value for name, value in sampling.items() if value is not None})
    if deadline_s is not None:
        if deadline_s <= 0:
            raise click.BadParameter("must be above 0", param_hint="--deadline-s")
        fields["deadline"] = time.time() + deadline_s
    settings = _settings(ctx)

    if embedded:
        import signal

        from ttsq.embedded import Embedded

        if not wait:
            raise click.UsageError("--embedded waits for its one job: it cannot be combined with --no-wait")
        # SIGTERM becomes SystemExit, so the private Redis and worker are stopped on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        # Validate before starting anything: bad input costs no Redis and no engine load.
        from ttsq.request import Limits, SynthesisRequest

        limits = Limits.from_settings(settings)
        if text_file is None:
            SynthesisRequest.from_dict({"text": text, **fields}, limits)
        elif not each_line:  # a document may be longer than one job; lines are checked one by one
            from ttsq.document import Document, Options

            Document.parse({"text": text, **fields}, limits=limits, max_document_chars=settings.max_document_chars,
                           default_options=Options.from_settings(settings))
        with Embedded(settings.replace(engine="espeak")) as stack:
            client = Client(stack.settings, app=stack.app)
            if each_line:
                sys.exit(_submit_lines(client, text, fields, wait=True, timeout=timeout, as_json=as_json))
            job = client.submit_document(text, **fields) if text_file is not None else client.submit(text, **fields)
            _report(_wait_with_progress(client, job, timeout), output=output, as_json=as_json)
        return

    client = Client(settings)
    if each_line:
        sys.exit(_submit_lines(client, text, fields, wait=wait, timeout=timeout, as_json=as_json))
    if text_file is not None:
        job = client.submit_document(text, **fields)
        if job.result is None and not wait and output is None:
            click.echo(json.dumps({"id": job.id, "key": job.key, "state": "PENDING", "chunks": job.chunks})
                       if as_json else f"queued {job.id} ({job.chunks} chunks)")
            return
        _report(_wait_with_progress(client, job, timeout), output=output, as_json=as_json)
        return
    job = client.submit(text, **fields)
    if job.result is None and not wait and output is None:
        click.echo(json.dumps({"id": job.id, "key": job.key, "state": "PENDING"}) if as_json
                   else f"queued {job.id}")
        return
    _report(job.wait(timeout), output=output, as_json=as_json)


@cli.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
@_one_line_errors
def status(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Show the state of job JOB_ID (exit 0 whatever the state; 1 only if Redis is unreachable)."""
    from ttsq.client import Client

    info = Client(_settings(ctx)).status(job_id)
    if as_json:
        click.echo(json.dumps(info))
    elif "error" in info:
        click.echo(f"{info['state']} {info['error']}")
    elif "result" in info:
        click.echo(f"{info['state']} {_summary(info['result'])}")
    elif "progress" in info:
        progress = info["progress"]
        click.echo(f"{info['state']} {progress['chunks_done']}/{progress['chunks_total']} chunks, "
                   f"{progress['audio_s']:.1f} s of audio")
    else:
        click.echo(info["state"])


@cli.command()
@click.argument("job_id")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the audio to this file.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
@_one_line_errors
def result(ctx: click.Context, job_id: str, timeout: float, output: Path | None, as_json: bool) -> None:
    """Wait for job JOB_ID and print its result with a freshly signed URL."""
    from ttsq.client import Client

    client = Client(_settings(ctx))
    _report(client.wait(job_id, timeout=timeout), output=output, as_json=as_json)


@cli.group()
def voices() -> None:
    """Reference voices for voice_clone."""


@voices.command("add")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--text", "transcript", default="",
              help="What the recording says. Without it the clone uses the speaker embedding only (weaker).")
@click.option("--json", "as_json", is_flag=True, help="Print the voice as JSON.")
@click.pass_context
@_one_line_errors
def voices_add(ctx: click.Context, file: Path, transcript: str, as_json: bool) -> None:
    """Upload FILE (WAV, FLAC, OGG or MP3; 1-60 s) as a reference voice; print its key."""
    from ttsq.client import Client

    with Client(_settings(ctx)) as client:
        key = client.add_voice(file.read_bytes(), transcript)
    click.echo(json.dumps({"reference": key, "transcript": bool(transcript)}) if as_json else key)


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the parked jobs as JSON.")
@click.pass_context
@_one_line_errors
def failed(ctx: click.Context, as_json: bool) -> None:
    """List parked jobs: those that crashed or hung their worker too often (never their text)."""
    from ttsq.client import Client

    jobs = [job.summary() for job in Client(_settings(ctx)).parked()]
    if as_json:
        click.echo(json.dumps(jobs))
        return
    if not jobs:
        click.echo("no parked jobs")
    for job in jobs:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["parked_at"]))
        click.echo(f"{job['id']}  {when}Z  attempts {job['attempts']}  queue {job['queue']}  "
                   f"{job['chars']} chars  {job['language']}")


@cli.command()
@click.argument("job_id")
@click.pass_context
@_one_line_errors
def retry(ctx: click.Context, job_id: str) -> None:
    """Re-queue parked job JOB_ID under its own id, with its attempts cleared."""
    from ttsq.client import Client

    click.echo(f"queued {Client(_settings(ctx)).retry(job_id)}")


@cli.command()
@click.option("--engine", default=None,
              help="Engine name (espeak, qwen, qwen-fast) or package.module:Factory. [TTSQ_ENGINE]")
@click.option("--max-batch", type=int, default=None, help="Largest batch. [TTSQ_MAX_BATCH]")
@click.option("--max-wait-ms", type=int, default=None,
              help="Longest wait for a batch to fill after its first job. [TTSQ_MAX_WAIT_MS]")
@click.option("-n", "--hostname", default=None,
              help="Celery node name (default ENGINE@host); with --devices, the host part of gpuN@HOST.")
@click.option("--devices", default=None,
              help="Launch one supervised worker process per device: all (every GPU; one CPU worker if "
                   "there is none), a GPU list like 0,1,3, cpu, or cpu:N for N CPU workers.")
@click.option("--metrics-port", type=int, default=None,
              help="Prometheus port; with --devices the Nth worker gets this + N; 0 turns it off. "
                   "[TTSQ_METRICS_PORT]")
@click.pass_context
@_one_line_errors
def worker(ctx: click.Context, engine: str | None, max_batch: int | None, max_wait_ms: int | None,
           hostname: str | None, devices: str | None, metrics_port: int | None) -> None:
    """Run a worker: load the engine, then consume jobs until SIGTERM (which finishes the batch in
    flight first). With --devices, run and supervise one worker per device."""
    settings = _settings(ctx, engine=engine, max_batch=max_batch, max_wait_ms=max_wait_ms,
                         metrics_port=metrics_port)
    if devices is not None:
        import logging
        import os
        import socket

        from ttsq.devices import plan
        from ttsq.supervisor import Supervisor

        logging.basicConfig(level=settings.log_level,
                            format="%(asctime)s %(levelname)s launcher %(name)s: %(message)s")
        slots, chosen = plan(devices, os.environ)
        logging.getLogger("ttsq.launcher").info("%s", chosen)
        host = (hostname or socket.gethostname()).split("@")[-1]
        sys.exit(Supervisor(settings, slots, host=host).run())

    from ttsq.workers.celery_worker import run_worker

    sys.exit(run_worker(settings, hostname=hostname))


@cli.command()
@click.option("-n", "--jobs", type=int, default=200, show_default=True, help="Timed jobs to run.")
@click.option("-c", "--concurrency", type=int, default=None,
              help="Closed loop: jobs in flight at once. Default: twice the max batch.")
@click.option("--rate", type=float, default=None,
              help="Open loop instead: mean arrivals per second, Poisson; latency counts from each arrival.")
@click.option("--mode", type=click.Choice(["synthesize", "cache-hit"]), default="synthesize", show_default=True,
              help="synthesize: every job misses the cache. cache-hit: time submits of already cached requests.")
@click.option("--corpus", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Sentences, one a line: text, LANGUAGE<TAB>text, or a JSON object of request fields. "
                   "Default: short, medium and long sentences in seven languages.")
@click.option("--format", "audio_format", type=click.Choice(FORMATS), default="wav", show_default=True,
              help="Output format of every job.")
@click.option("--warmup", type=int, default=0, show_default=True, help="Untimed jobs sent first.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for each job.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the corpus order and arrivals.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
              default=None, help="Also write the figures as JSON to this file ('-': JSON on stdout, no table).")
@click.option("--embedded", is_flag=True,
              help="Bench a private Redis and an in-process worker started for the run (audio in a temporary "
                   "folder unless --storage-url is given).")
@click.option("--engine", default=None, help="Engine: of the embedded worker (default espeak), else the one "
                                             "whose workers the producer expects. [TTSQ_ENGINE]")
@click.option("--max-batch", type=int, default=None, help="Embedded worker's largest batch. [TTSQ_MAX_BATCH]")
@click.option("--max-wait-ms", type=int, default=None,
              help="Embedded worker's longest wait for a batch to fill. [TTSQ_MAX_WAIT_MS]")
@click.pass_context
@_one_line_errors
def bench(ctx: click.Context, jobs: int, concurrency: int | None, rate: float | None, mode: str,
          corpus: Path | None, audio_format: str, warmup: int, timeout: float, seed: int, json_path: Path | None,
          embedded: bool, engine: str | None, max_batch: int | None, max_wait_ms: int | None) -> None:
    """Measure throughput and latency: N jobs at a fixed concurrency or arrival rate."""
    from ttsq import bench as benchmark
    from ttsq.request import Limits

    if concurrency is not None and rate is not None:
        raise click.UsageError("--concurrency and --rate exclude each other: choose a closed or an open loop")
    if embedded and engine is None:
        engine = "espeak"  # like `submit --embedded`: a fresh machine has no GPU model
    settings = _settings(ctx, engine=engine, max_batch=max_batch, max_wait_ms=max_wait_ms)
    plan = benchmark.Plan(jobs=jobs, concurrency=concurrency or settings.concurrency, rate=rate,
                          mode="cache-hit" if mode == "cache-hit" else "synthesize", timeout_s=timeout, seed=seed,
                          audio_format=audio_format, warmup=warmup)
    sentences = benchmark.load_corpus(corpus) if corpus else list(benchmark.CORPUS)
    benchmark.check_corpus(sentences, plan, Limits.from_settings(settings))  # before the progress bar shows
    with click.progressbar(length=jobs, label="ttsq bench", file=sys.stderr) as bar:
        figures = benchmark.measure(settings, plan, sentences, embedded=embedded,
                                    temporary_storage=embedded and ctx.obj["storage_url"] is None,
                                    corpus_name=str(corpus) if corpus else "built-in", progress=bar.update)
    encoded = json.dumps(figures, indent=2, ensure_ascii=False)
    if json_path is not None and str(json_path) == "-":
        click.echo(encoded)
    else:
        click.echo(benchmark.format_report(figures))
        if json_path is not None:
            json_path.write_text(encoded + "\n", encoding="utf-8")
    if not figures["jobs"]["ok"]:
        sys.exit(1)


@cli.command()
@click.option("--minutes", type=click.IntRange(1, 120), default=5, show_default=True,
              help="How far back throughput and the cache hit ratio look.")
@click.option("--ping-timeout", type=float, default=1.0, show_default=True,
              help="Seconds to wait for workers to answer a ping (0: skip the ping).")
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@click.pass_context
@_one_line_errors
def stats(ctx: click.Context, minutes: int, ping_timeout: float, as_json: bool) -> None:
    """Queue depths, workers online, throughput and cache hit ratio over the last minutes."""
    from ttsq.stats import format_table, snapshot

    snap = snapshot(_settings(ctx), minutes=minutes, ping_timeout=ping_timeout)
    click.echo(json.dumps(snap) if as_json else format_table(snap))


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--address", default="0.0.0.0", show_default=True, help="Address Flower listens on.")
@click.option("--port", type=int, default=5555, show_default=True, help="Flower's port.")
@click.option("--basic-auth", envvar="FLOWER_BASIC_AUTH", default=None,
              help="user:password for Flower's pages and API. [FLOWER_BASIC_AUTH]")
@click.option("--no-auth", is_flag=True, help="Run without authentication (trusted networks only).")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@_one_line_errors
def flower(ctx: click.Context, address: str, port: int, basic_auth: str | None, no_auth: bool,
           flower_args: tuple[str, ...]) -> None:
    """Run Flower on ttsq's broker, with basic auth. Extra arguments go to Flower (--persistent=True, ...)."""
    from ttsq.flower import run_flower

    sys.exit(run_flower(_settings(ctx), address=address, port=port, basic_auth=basic_auth, no_auth=no_auth,
                        extra=flower_args))


def _read_text(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("text", "is not valid UTF-8") from None


def _wait_with_progress(client: Client, job: Job, timeout: float) -> JobResult:
    """Wait for a document, with a progress bar of its chunks on stderr (read from its PROGRESS state)."""
    if job.result is not None or job.id is None:
        return job.wait(timeout)
    deadline = time.monotonic() + timeout
    total = max(job.chunks, 1)
    with click.progressbar(length=total, label="chunks", file=sys.stderr, show_pos=True) as bar:
        shown = 0
        while time.monotonic() < deadline:
            info = client.status(job.id)
            progress = info.get("progress")
            if progress:
                bar.length = total = int(progress["chunks_total"])  # repeated chunks run once
                done = int(progress["chunks_done"])
                bar.label = f"chunks ({progress['audio_s']:.0f} s of audio)"
                bar.update(done - shown)
                shown = done
            if info["state"] in ("SUCCESS", "FAILURE", "REVOKED"):
                bar.update(total - shown)
                break
            time.sleep(0.3)
    return job.wait(max(0.1, deadline - time.monotonic()))


def _submit_lines(client: Client, text: str, fields: dict[str, Any], *, wait: bool, timeout: float,
                  as_json: bool) -> int:
    """One job per non-blank line; a bad line fails alone. Exit status 1 if any line failed."""
    records: list[dict[str, Any]] = []
    jobs: list[tuple[dict[str, Any], Job]] = []
    # The file's own lines (\n or \r\n): str.splitlines would also split at U+2028, form feeds and
    # the like, and the failures would name the wrong line numbers.
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        record: dict[str, Any] = {"line": number}
        records.append(record)
        try:
            job = client.submit(line, **fields)
        except InvalidRequest as exc:
            record.update(state="failed", error=str(exc))
            continue
        if job.result is not None:  # the producer answered it from the cache: nothing was queued
            record.update(id=job.id, key=job.key, state="cached", url=job.result["url"],
                          duration_s=job.result["duration_s"])
            continue
        record.update(id=job.id, key=job.key, state="queued")
        jobs.append((record, job))
    deadline = time.monotonic() + timeout
    if wait:
        with click.progressbar(jobs, label="lines", file=sys.stderr, show_pos=True) as bar:
            for record, job in bar:
                try:
                    result = job.wait(max(0.1, deadline - time.monotonic()))
                except TTSQError as exc:
                    record.update(state="failed", error=str(exc))
                    continue
                record.update(state="cached" if result["cached"] else "done", key=result["key"],
                              url=result["url"], duration_s=result["duration_s"])
    counts = {state: sum(1 for r in records if r["state"] == state) for state in ("done", "cached", "failed", "queued")}
    if as_json:
        for record in records:
            click.echo(json.dumps(record, ensure_ascii=False))
    else:
        click.echo(f"{'lines':>7} {'done':>7} {'cached':>7} {'failed':>7}" + (f" {'queued':>7}" if not wait else ""))
        click.echo(f"{len(records):>7} {counts['done']:>7} {counts['cached']:>7} {counts['failed']:>7}"
                   + (f" {counts['queued']:>7}" if not wait else ""))
        for record in records:
            if record["state"] == "failed":
                click.echo(f"line {record['line']}: {record['error']}")
    return 1 if counts["failed"] else 0


def _report(result: JobResult, *, output: Path | None, as_json: bool) -> None:
    if output is not None:
        output.write_bytes(_fetch(result["url"]))
    if as_json:
        click.echo(json.dumps(result, ensure_ascii=False))
    elif output is not None:
        click.echo(f"wrote {output}: {_summary(result)}")
    else:
        click.echo(f"{_summary(result)} {result['url']}")


def _summary(result: JobResult) -> str:
    source = "cached" if result["cached"] else "synthesized"
    document = result.get("document")
    if isinstance(document, dict):  # a stitched document
        source = f"{document['chunks']} chunks ({document['cached_chunks']} from the cache), {source}"
    ignored = f" (ignored: {', '.join(result['ignored'])})" if result["ignored"] else ""
    truncated = " (truncated at the frame cap)" if result["truncated"] else ""
    return (f"{result['duration_s']:.2f}s {result['format']} {result['sample_rate']} Hz, {source} "
            f"by {result['engine']}, key {result['key'][:12]}{ignored}{truncated}")


def _fetch(url: str) -> bytes:
    if not url.startswith(("http://", "https://", "file://")):
        raise TTSQError(f"cannot download from a {url.split(':', 1)[0]} URL")
    with urllib.request.urlopen(url, timeout=60) as response:
        data: bytes = response.read()
        return data


def main() -> None:
    """Console entry point: click's usage errors become one line too."""
    try:
        code = cli.main(prog_name="ttsq", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `ttsq`: the help, not an error
        click.echo(exc.ctx.get_help() if exc.ctx else "")
        code = 0
    except click.UsageError as exc:
        _fail(exc.format_message(), 2)
    except click.Abort:
        _fail("aborted", 130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
