"""``ttsq status``, ``ttsq result``, ``ttsq cancel``: follow a job submitted earlier, get its audio, or
call it off."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .common import format_of_output, one_line_errors, report, settings_of, summary


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
@click.pass_context
@one_line_errors
def status(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Show the state of job JOB_ID (exit 0 whatever its state; 1 for an id ttsq never accepted, a result it
    cannot read, or Redis unreachable)."""
    from ttsq.client import Client

    info = Client(settings_of(ctx)).status(job_id)
    if as_json:
        click.echo(json.dumps(info))
    elif "error" in info:
        click.echo(f"{info['state']} {info['error']}")
    elif "result" in info:
        click.echo(f"{info['state']} {summary(info['result'])}")
    elif "progress" in info:
        progress = info["progress"]
        stitching = ", stitching" if progress.get("phase") == "stitching" else ""
        click.echo(
            f"{info['state']} {progress['chunks_done']}/{progress['chunks_total']} chunks, "
            f"{progress['audio_s']:.1f} s of audio{stitching}"
        )
    elif "note" in info:
        click.echo(f"{info['state']} ({info['note']})")
    else:
        click.echo(info["state"])


@click.command()
@click.argument("job_id")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait.")
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Write the audio to this file.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.pass_context
@one_line_errors
def result(ctx: click.Context, job_id: str, timeout: float, output: Path | None, as_json: bool) -> None:
    """Wait for job JOB_ID and print its result with a freshly signed URL."""
    from ttsq.client import Client

    if output is not None:
        format_of_output(output)  # a name no format has: refused before the wait, not after
    client = Client(settings_of(ctx))
    report(client.wait(job_id, timeout=timeout), output=output, as_json=as_json, client=client)


@click.command()
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON: id and state.")
@click.pass_context
@one_line_errors
def cancel(ctx: click.Context, job_id: str, as_json: bool) -> None:
    """Cancel job JOB_ID unless its worker has its outcome: a queued job (or document) never runs; a job
    in its engine call runs to the end of that call, its audio cached, and ends REVOKED. Prints the state
    the job ends in; exit 1 for an id ttsq never accepted, and for a job that had already finished
    (nothing was cancelled)."""
    from ttsq.client import Client

    state = Client(settings_of(ctx)).cancel(job_id)
    if as_json:
        click.echo(json.dumps({"id": job_id, "state": state}))
    elif state == "REVOKED":
        click.echo(f"cancelled {job_id}")
    else:
        click.echo(f"ttsq: not cancelled: job {job_id} had already finished ({state})", err=True)
    if state != "REVOKED":
        sys.exit(1)
