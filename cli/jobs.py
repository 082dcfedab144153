"""``ttsq submit``: put jobs in (one text, a document, or a file of lines), and wait for their audio.
``ttsq status``, ``ttsq result`` and ``ttsq cancel`` follow a job afterwards (``follow.py``).

Why one file over 400 lines: it is one command, whose thirty options and three paths (a text, a
document, a file of lines, each also embedded) share the option checks, the wait with its progress and
the Ctrl-C message; split by path, one command's behaviour would live in four files."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import click

from ttsq.errors import InvalidRequest, TTSQError
from ttsq.job import FORMATS, LANGUAGES, JobResult

from .common import (
    OUTPUT_EXTENSIONS,
    fail,
    format_of_output,
    one_line_errors,
    pointed_to_documents,
    read_text,
    report,
    settings_of,
    summary,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    from ttsq.client import AudioStream, Client, DocumentStream, Job
    from ttsq.config import Settings


@click.command()
@click.argument("text", required=False)
@click.option(
    "-f",
    "--file",
    "text_file",
    type=click.Path(exists=True, dir_okay=False, allow_dash=True, path_type=Path),
    default=None,
    help="Read the text from this file ('-': stdin) as one document of any length: it is split into "
    "chunk jobs and stitched into one audio file, with a progress bar while it runs.",
)
@click.option(
    "--each-line",
    is_flag=True,
    help="With -f: one ordinary job per non-blank line instead (many short clips), with a progress bar "
    "and a summary; --json prints one record per line.",
)
@click.option(
    "--mode",
    default="voice_design",
    show_default=True,
    help="voice_design (a voice described in words), custom_voice (a named speaker) or "
    "voice_clone (a stored reference voice).",
)
@click.option("--instruct", default="", help="Voice description, in words (VoiceDesign; style for CustomVoice).")
@click.option("--speaker", default="", help="Speaker name (custom_voice).")
@click.option("--reference", default="", help="Voice key from `ttsq voices add` (voice_clone).")
@click.option(
    "--language", default="auto", show_default=True, help=f"One of {', '.join(LANGUAGES)}, or a code like ko, en, ja."
)
@click.option(
    "--format",
    "audio_format",
    default=None,
    help=f"Output format: {', '.join(FORMATS)} (opus: Ogg Opus, as ogg). Default: from the -o extension, else wav.",
)
@click.option("--seed", type=int, default=None, help="Sampling seed (part of the cache key).")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (engine default if unset).")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling threshold.")
@click.option("--top-k", type=int, default=None, help="Top-k sampling.")
@click.option("--repetition-penalty", type=float, default=None, help="Repetition penalty.")
@click.option(
    "--max-new-tokens",
    type=int,
    default=None,
    help="Frame cap (12.5 frames per second of audio); derived from the text if unset.",
)
@click.option(
    "--deadline-s",
    type=float,
    default=None,
    help="Drop the job unsynthesized if it has not started within this many seconds.",
)
@click.option(
    "--lane",
    type=click.Choice(["interactive", "bulk"]),
    default=None,
    help="The lane the job waits in (docs/scheduling.md). Default: interactive for a job or a stream, "
    "bulk for a document (-f) or --each-line.",
)
@click.option(
    "--tenant",
    default=None,
    help="Whose work this is, for fair shares between tenants (a name: letters, digits, . _ : @ -).",
)
@click.option("--wait/--no-wait", default=True, show_default=True, help="Wait for the result.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the audio to this file (implies --wait); its extension (.wav, .flac, .ogg or .opus, .mp3) "
    "picks the format unless --format does.",
)
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="With --each-line: save each line's audio in this directory (created if missing) as its line "
    "number, zero-padded to 4 digits, and the format's extension: 0007.wav (implies --wait).",
)
@click.option(
    "--stream",
    is_flag=True,
    help="Write the audio as the worker makes it, as WAV: to stdout (pipe it to a player: "
    "| ffplay -nodisp -, | aplay) or to -o FILE.wav (written aside as .FILE.wav.part, moved into place once "
    "whole: a broken stream leaves no FILE.wav); the result goes to stderr.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--captions",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write captions of the audio to this file, SubRip (.srt) or WebVTT (.vtt), from word "
    "timestamps (asks for them; implies --wait; docs/timestamps.md).",
)
@click.option(
    "--embedded", is_flag=True, help="Start a private Redis and an in-process espeak worker for this one job."
)
@click.option(
    "--wait-for-worker",
    is_flag=True,
    help="Queue the job and wait (up to --timeout) even when no worker has announced itself; without it, a "
    "waiting submit with no worker to serve it fails at once, naming the mode and the queue.",
)
@click.pass_context
@one_line_errors
def submit(
    ctx: click.Context,
    text: str | None,
    text_file: Path | None,
    each_line: bool,
    mode: str,
    instruct: str,
    speaker: str,
    reference: str,
    language: str,
    audio_format: str | None,
    seed: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    repetition_penalty: float | None,
    max_new_tokens: int | None,
    deadline_s: float | None,
    lane: str | None,
    tenant: str | None,
    wait: bool,
    timeout: float,
    output: Path | None,
    output_dir: Path | None,
    stream: bool,
    as_json: bool,
    captions: Path | None,
    embedded: bool,
    wait_for_worker: bool,
) -> None:
    """Synthesize TEXT (or '-' to read it from stdin), or a document with -f FILE."""
    if (text is None) == (text_file is None):
        raise click.UsageError("give TEXT as an argument or a file with -f FILE (one of them)")
    if each_line and text_file is None:
        raise click.UsageError("--each-line reads the lines of -f FILE")
    if each_line and output is not None:
        raise click.UsageError("--each-line makes one file per line: save them with --output-dir DIR instead of -o")
    if output_dir is not None and not each_line:
        raise click.UsageError("--output-dir saves the lines of --each-line: for one file use -o FILE")
    if embedded and not wait:
        raise click.UsageError("--embedded waits for its one job: it cannot be combined with --no-wait")
    if stream:
        _check_stream_flags(each_line, output, audio_format, wait=wait)
    text = _input_text(text, text_file)
    fields = _request_fields(
        mode=mode,
        instruct=instruct,
        speaker=speaker,
        reference=reference,
        language=language,
        audio_format=audio_format,
        output=output,
        deadline_s=deadline_s,
        sampling={
            "seed": seed,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "repetition_penalty": repetition_penalty,
            "max_new_tokens": max_new_tokens,
        },
    )
    kind = "lines" if each_line else "document" if text_file is not None else "job"
    if captions is not None:
        _captions_format(captions, kind=kind, stream=stream, embedded=embedded)
        fields["timestamps"] = "word"
        wait = True
    # Many short clips at once are bulk work, like a document (which is bulk unless streamed: its default).
    lane = lane or ("bulk" if each_line else None)
    fields.update({name: value for name, value in (("lane", lane), ("tenant", tenant)) if value is not None})
    settings = settings_of(ctx)
    try:
        if embedded:
            _submit_embedded(
                settings,
                kind,
                text,
                fields,
                timeout=timeout,
                output=output,
                output_dir=output_dir,
                as_json=as_json,
                stream=stream,
            )
            return
        from ttsq.client import Client

        client = Client(settings)
        if not wait_for_worker and (wait or output is not None or output_dir is not None or stream):
            # Asked once a job is checked and not in the cache, just before it would be queued.
            mode = str(fields.get("mode", "voice_design"))
            client.admit = lambda queue: _require_worker(client, mode, queue)
        if stream:
            _stream(client, kind, text, fields, timeout=timeout, output=output, as_json=as_json)
            return
        _submit(
            client,
            kind,
            text,
            fields,
            wait=wait,
            timeout=timeout,
            output=output,
            output_dir=output_dir,
            as_json=as_json,
            captions=captions,
        )
    except InvalidRequest as exc:
        raise pointed_to_documents(exc, kind, settings.max_text_chars) from None


def _require_worker(client: Client, mode: str, queue: str) -> None:
    """A submit that waits for its audio fails at once, queueing nothing, when no worker of the deployment
    has announced itself (none heard from in ``IDENTITY_MAX_AGE_S``: one that is restarting still
    counts), instead of waiting out --timeout in silence. ``--no-wait`` queues for later, and
    ``--wait-for-worker`` waits."""
    from ttsq.constants import IDENTITY_MAX_AGE_S

    if not client.identities():
        fail(
            f"no worker serves {mode} on queue {queue}: none has announced itself "
            f"in the last {IDENTITY_MAX_AGE_S:.0f} s. Start one (ttsq worker), or run everything in one command "
            "(ttsq submit --embedded, ttsq serve --embedded); --wait-for-worker queues the job and waits for one",
            1,
        )


def _check_stream_flags(each_line: bool, output: Path | None, audio_format: str | None, *, wait: bool) -> None:
    """--stream plays one text or document as it is made: flags that mean something else are refused."""
    if each_line:
        raise click.UsageError("--stream plays one text or one document (-f) as it is made, not --each-line")
    if not wait:
        raise click.UsageError("--stream waits for its audio: it cannot be combined with --no-wait")
    if output is not None and format_of_output(output) not in (None, "wav"):
        raise click.UsageError(f"--stream writes WAV as it comes: name the file .wav, not {output.name}")
    if audio_format is not None and audio_format.lower() != "wav":
        raise click.UsageError("--stream writes WAV as it comes (16-bit PCM): drop --format")
    if output is None and sys.stdout.isatty():
        raise click.UsageError(
            "--stream writes audio to stdout: pipe it to a player (| ffplay -nodisp -, | aplay) or use -o FILE.wav"
        )


def _stream(
    client: Client,
    kind: str,
    text: str,
    fields: dict[str, Any],
    *,
    timeout: float,
    output: Path | None,
    as_json: bool,
    keeps_running: bool = True,
) -> None:
    """Play one job or document as it is made: a WAV whose header says "until the data ends", then its
    samples as they arrive, flushed piece by piece; a file has its sizes set once the last piece is in.
    ``keeps_running``: as for ``_submit``."""
    from ttsq.audio import wav_header

    stream: AudioStream | DocumentStream
    if kind == "document":
        stream = client.stream_document(text, timeout=timeout, **fields)
    else:
        stream = client.stream(text, timeout=timeout, **fields)
    if stream.job.result is None and stream.job.id is not None and keeps_running:
        _accepted(stream.job, kind)
    _show_waits_on_redis()
    # A file is written aside and moved into place once whole: a stream that breaks (its worker died, a
    # stall, Ctrl-C) leaves no short WAV that looks complete, and no earlier FILE.wav is overwritten by one.
    partial = output.with_name(f".{output.name}.part") if output is not None else None
    sink = open(partial, "wb") if partial is not None else sys.stdout.buffer  # noqa: SIM115 (closed below)
    written, rate, whole = 0, 0, False
    try:
        try:
            for piece in stream:
                if not rate:
                    rate = piece.sample_rate
                    sink.write(wav_header(rate))
                sink.write(piece.pcm)
                sink.flush()
                written += len(piece.pcm)
        except BrokenPipeError:  # the player was closed: the job goes on, and is cached
            # Python flushes stdout once more at exit: point it at nothing, or that flush fails too.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return
        except KeyboardInterrupt:
            if stream.job.id is None or not keeps_running:
                raise
            _interrupted([stream.job.id])
        if partial is not None and rate:
            sink.seek(0)
            sink.write(wav_header(rate, written))
        whole = True
    finally:
        if partial is not None and output is not None:
            sink.close()
            if whole:
                os.replace(partial, output)
            else:
                partial.unlink(missing_ok=True)
    if stream.result is not None:
        # stdout carries the audio, unless it went to a file: then the result goes to stderr.
        line = json.dumps(stream.result, ensure_ascii=False) if as_json else summary(stream.result)
        if output is not None and not as_json:
            line = f"wrote {output}: {line}"
        click.echo(line, err=output is None)


def _input_text(text: str | None, text_file: Path | None) -> str:
    """The text to speak: the argument, stdin for '-', or the file's contents."""
    if text_file is not None:
        return read_text(sys.stdin.buffer.read() if str(text_file) == "-" else text_file.read_bytes())
    if text == "-":
        return read_text(sys.stdin.buffer.read())
    assert text is not None  # submit checked that one of the two was given
    return text


def _request_fields(
    *,
    mode: str,
    instruct: str,
    speaker: str,
    reference: str,
    language: str,
    audio_format: str | None,
    output: Path | None,
    deadline_s: float | None,
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """The request fields the flags give (validated later, at the edge, like any other input)."""
    named = format_of_output(output) if output is not None else None
    if audio_format is not None:  # `--format opus` is Ogg Opus, as a .opus name is
        audio_format = OUTPUT_EXTENSIONS.get(audio_format.lower(), audio_format)
    if audio_format is None:
        audio_format = named or "wav"
    elif named is not None and named != audio_format.lower():
        raise click.UsageError(
            f"--format {audio_format} and -o {output} disagree: drop --format (the extension decides) "
            f"or name the file .{audio_format.lower()}"
        )
    fields: dict[str, Any] = {"mode": mode, "instruct": instruct, "language": language, "format": audio_format}
    fields.update({name: value for name, value in (("speaker", speaker), ("reference", reference)) if value})
    fields.update({name: value for name, value in sampling.items() if value is not None})
    if deadline_s is not None:
        if deadline_s <= 0:
            raise click.BadParameter("must be above 0", param_hint="--deadline-s")
        fields["deadline"] = time.time() + deadline_s
    return fields


def _submit(
    client: Client,
    kind: str,
    text: str,
    fields: dict[str, Any],
    *,
    wait: bool,
    timeout: float,
    output: Path | None,
    output_dir: Path | None,
    as_json: bool,
    keeps_running: bool = True,
    captions: Path | None = None,
) -> None:
    """Submit one job, one document, or one job per line, and report as the flags ask. ``keeps_running``:
    the job outlives this command (not so with --embedded), so Ctrl-C says how to find it again."""
    if kind == "lines":
        sys.exit(
            _submit_lines(
                client,
                text,
                fields,
                wait=wait or output_dir is not None,
                timeout=timeout,
                output_dir=output_dir,
                as_json=as_json,
                keeps_running=keeps_running,
            )
        )
    job = client.submit_document(text, **fields) if kind == "document" else client.submit(text, **fields)
    if job.result is None and not wait and output is None:
        queued: dict[str, Any] = {"id": job.id, "key": job.key, "state": "PENDING"}
        if kind == "document":
            queued["chunks"] = job.chunks
        if as_json:
            click.echo(json.dumps(queued))
            return
        # The id alone on stdout, as the docs promise, so that `id=$(ttsq submit ... --no-wait)` holds it.
        if kind == "document":
            click.echo(f"ttsq: document queued ({job.chunks} chunks)", err=True)
        click.echo(job.id)
        return
    try:  # from the moment the job is accepted: a Ctrl-C before the wait begins names it too
        if job.result is None and job.id is not None and keeps_running:
            _accepted(job, kind)
        _show_waits_on_redis()
        result = _wait_with_progress(client, job, timeout) if kind == "document" else job.wait(timeout)
    except KeyboardInterrupt:
        if not keeps_running or job.id is None:
            raise
        _interrupted([job.id])
    report(result, output=output, as_json=as_json, client=client)
    if captions is not None:
        _write_captions(result, captions)


def _captions_format(path: Path, *, kind: str, stream: bool, embedded: bool) -> None:
    """Refuse a ``--captions PATH`` that names no caption format (.srt, .vtt), or flags it cannot go with."""
    from ttsq.captions import CAPTION_FORMATS

    caption_format = path.suffix.lower().lstrip(".")
    if caption_format not in CAPTION_FORMATS:
        raise click.UsageError(f"--captions writes SubRip or WebVTT: name the file .srt or .vtt, not {path.name}")
    if kind == "lines" or stream or embedded:
        raise click.UsageError(
            "--captions goes with one text or one document (-f), not --each-line, --stream or --embedded"
        )


def _write_captions(result: JobResult, path: Path) -> None:
    """Write the result's words as captions; say so on stderr (stdout keeps the result alone)."""
    from ttsq.alignment import parse_words
    from ttsq.captions import captions, make_cues

    words = parse_words(result.get("words"))
    path.write_text(captions(words, path.suffix.lower().lstrip("."), duration_s=result["duration_s"]), encoding="utf-8")
    click.echo(f"ttsq: wrote {len(make_cues(words, duration_s=result['duration_s']))} captions to {path}", err=True)


def _accepted(job: Job, kind: str) -> None:
    """Name the job as soon as it is accepted, before the wait: whatever ends the wait (Ctrl-C, a timeout,
    Redis gone for longer than the wait rides out), ``ttsq result ID`` finds it again. On stderr, like
    every message: stdout keeps only the result (its one line, or its JSON) for scripts to read."""
    chunks = f" ({job.chunks} chunk{'' if job.chunks == 1 else 's'})" if kind == "document" else ""
    joined = ", joining the identical job already running" if job.joined else ""
    click.echo(f"ttsq: job {job.id} accepted{chunks}{joined}; waiting for it", err=True)


class _Said(logging.Handler):
    """A library warning as one ``ttsq: ...`` line on stderr (wherever stderr is at the time: click's)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"ttsq: {record.getMessage()}", err=True)


def _show_waits_on_redis() -> None:
    """While a wait rides out an unreachable Redis, say so (one line per outage): the client logs it, and
    this command shows that one logger's warnings (the library itself never prints)."""
    waits = logging.getLogger("ttsq.client")
    if not any(isinstance(handler, _Said) for handler in waits.handlers):
        waits.addHandler(_Said(logging.WARNING))


def _interrupted(job_ids: list[str]) -> NoReturn:
    """Ctrl-C while waiting: the jobs were accepted and keep running; say how to re-attach or cancel."""
    if len(job_ids) == 1:
        (job_id,) = job_ids
        message = (
            f"interrupted; job {job_id} keeps running: `ttsq result {job_id}` waits for it again, "
            f"`ttsq cancel {job_id}` cancels it"
        )
    else:
        message = (
            f"interrupted; {len(job_ids)} jobs keep running ({' '.join(job_ids)}): `ttsq result ID` waits "
            "for one again, `ttsq cancel ID` cancels it"
        )
    after_caret = "\n" if sys.stderr.isatty() else ""  # a terminal shows ^C where the cursor was
    click.echo(f"{after_caret}ttsq: {message}", err=True)
    sys.exit(130)


def _submit_embedded(
    settings: Settings,
    kind: str,
    text: str,
    fields: dict[str, Any],
    *,
    timeout: float,
    output: Path | None,
    output_dir: Path | None,
    as_json: bool,
    stream: bool = False,
) -> None:
    """The same, through a private Redis and an in-process espeak worker started for this one run
    (``stream``: played as it is made, as ``--stream`` does)."""
    import signal

    from ttsq.client import Client
    from ttsq.job import Limits, SynthesisRequest
    from ttsq.ops.embedded import Embedded

    # SIGTERM becomes SystemExit, so the private Redis and worker are stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # Validate before starting anything: bad input costs no Redis and no engine load.
    limits = Limits.from_settings(settings)
    if kind == "job":
        SynthesisRequest.from_dict({"text": text, **fields}, limits)
    elif kind == "document":  # a document may be longer than one job; lines are checked one by one
        from ttsq.document import Document, Options

        Document.parse(
            {"text": text, **fields},
            limits=limits,
            max_document_chars=settings.max_document_chars,
            default_options=Options.from_settings(settings),
        )
    with Embedded(settings.replace(engine="espeak")) as stack:
        client = Client(stack.settings, redis=stack.owner)
        if stream:
            _stream(client, kind, text, fields, timeout=timeout, output=output, as_json=as_json, keeps_running=False)
            return
        _submit(
            client,
            kind,
            text,
            fields,
            wait=True,
            timeout=timeout,
            output=output,
            output_dir=output_dir,
            as_json=as_json,
            keeps_running=False,
        )


def _wait_with_progress(client: Client, job: Job, timeout: float) -> JobResult:
    """Wait for a document, showing its chunks on stderr (read from its PROGRESS state): a bar on a
    terminal, else one plain ``N/M chunks`` line each time the count changes (a log, a CI job, a pipe
    read by a program). Redis unreachable for a while is ridden out as ``Client.wait`` rides it out."""
    if job.result is not None or job.id is None or job.chunks <= 1:
        return job.wait(timeout)  # one chunk is one job: a bar of 0/1 then 1/1 says nothing
    deadline = time.monotonic() + timeout
    if sys.stderr.isatty():
        with click.progressbar(length=job.chunks, label="chunks", file=sys.stderr, show_pos=True) as bar:
            shown = 0
            for progress, final in _progress(client, job.id, job.chunks, deadline):
                bar.length = int(progress["chunks_total"])  # job.chunks (an older worker counted jobs)
                stitching = ", stitching" if progress.get("phase") == "stitching" else ""
                bar.label = f"chunks ({progress['audio_s']:.0f} s of audio{stitching})"
                done = int(progress["chunks_total"]) if final else int(progress["chunks_done"])
                bar.update(done - shown)
                shown = done
    else:
        said = ""
        for progress, final in _progress(client, job.id, job.chunks, deadline):
            if final:
                break  # the result line says it is done; a last "M/M" would repeat it
            stitching = ", stitching" if progress.get("phase") == "stitching" else ""
            line = f"{progress['chunks_done']}/{progress['chunks_total']} chunks{stitching}"
            if line != said:
                click.echo(line, err=True)
                said = line
    return job.wait(max(0.1, deadline - time.monotonic()))


def _progress(client: Client, job_id: str, chunks: int, deadline: float) -> Iterator[tuple[dict[str, Any], bool]]:
    """A document's progress (chunks done and total, audio seconds, phase) every 0.3 s until its state is
    final (then once more, with True) or the deadline passes. Redis unreachable is waited out for as long
    as ``Client.wait`` waits it out."""
    from ttsq.client import WAIT_PATIENCE_S

    progress: dict[str, Any] = {"chunks_done": 0, "chunks_total": chunks, "audio_s": 0.0}
    while (left := deadline - time.monotonic()) > 0:
        info = client.status(job_id, patience_s=min(WAIT_PATIENCE_S, left))
        progress = info.get("progress") or progress
        if info["state"] in ("SUCCESS", "FAILURE", "REVOKED"):
            yield progress, True
            return
        yield progress, False
        time.sleep(0.3)


def _submit_lines(
    client: Client,
    text: str,
    fields: dict[str, Any],
    *,
    wait: bool,
    timeout: float,
    output_dir: Path | None,
    as_json: bool,
    keeps_running: bool,
) -> int:
    """One job per non-blank line; a bad line fails alone. Exit status 1 if any line failed. With
    ``output_dir``, each line's audio is saved there as ``<line number, 4 digits or more>.<format>``."""
    records: list[dict[str, Any]] = []
    jobs: list[tuple[dict[str, Any], Job]] = []
    # The file's own lines (\n or \r\n): str.splitlines would also split at U+2028, form feeds and
    # the like, and the failures would name the wrong line numbers.
    lines = text.split("\n")
    width = max(4, len(str(len(lines))))  # one width for the whole file: the names sort by line
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)

    def save(record: dict[str, Any], result: JobResult) -> None:
        if output_dir is None:
            return
        path = output_dir / f"{record['line']:0{width}d}.{result['format']}"
        try:
            path.write_bytes(client.download(result))
        except (TTSQError, OSError) as exc:
            record.update(state="failed", error=f"cannot save {path}: {exc}")
            return
        record["file"] = str(path)

    for number, line in enumerate(lines, start=1):
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
            record.update(
                id=job.id, key=job.key, state="cached", url=job.result["url"], duration_s=job.result["duration_s"]
            )
            save(record, job.result)
            continue
        record.update(id=job.id, key=job.key, state="queued")
        jobs.append((record, job))
    deadline = time.monotonic() + timeout
    if wait:
        try:
            with click.progressbar(jobs, label="lines", file=sys.stderr, show_pos=True) as bar:
                for record, job in bar:
                    try:
                        result = job.wait(max(0.1, deadline - time.monotonic()))
                    except TTSQError as exc:
                        record.update(state="failed", error=str(exc))
                        continue
                    record.update(
                        state="cached" if result["cached"] else "done",
                        key=result["key"],
                        url=result["url"],
                        duration_s=result["duration_s"],
                    )
                    save(record, result)
        except KeyboardInterrupt:
            running = [job.id for record, job in jobs if record["state"] == "queued" and job.id is not None]
            if not keeps_running or not running:
                raise
            _interrupted(running)
    counts = {state: sum(1 for r in records if r["state"] == state) for state in ("done", "cached", "failed", "queued")}
    if as_json:
        for record in records:
            click.echo(json.dumps(record, ensure_ascii=False))
    else:
        click.echo(f"{'lines':>7} {'done':>7} {'cached':>7} {'failed':>7}" + (f" {'queued':>7}" if not wait else ""))
        click.echo(
            f"{len(records):>7} {counts['done']:>7} {counts['cached']:>7} {counts['failed']:>7}"
            + (f" {counts['queued']:>7}" if not wait else "")
        )
        for record in records:
            if record["state"] == "failed":
                click.echo(f"line {record['line']}: {record['error']}")
    return 1 if counts["failed"] else 0
