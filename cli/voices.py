"""``ttsq voices``: reference recordings for voice_clone."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .common import one_line_errors, settings_of


@click.group()
def voices() -> None:
    """Reference voices for voice_clone."""


@voices.command("add")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--text",
    "transcript",
    default="",
    help="What the recording says. Without it the clone uses the speaker embedding only (weaker).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the voice as JSON.")
@click.pass_context
@one_line_errors
def voices_add(ctx: click.Context, file: Path, transcript: str, as_json: bool) -> None:
    """Upload FILE (WAV, FLAC, OGG or MP3; 1-60 s) as a reference voice; print its key."""
    from ttsq.client import Client

    with Client(settings_of(ctx)) as client:
        key = client.add_voice(file.read_bytes(), transcript)
    click.echo(json.dumps({"reference": key, "transcript": bool(transcript)}) if as_json else key)


@voices.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the voices as JSON.")
@click.pass_context
@one_line_errors
def voices_list(ctx: click.Context, as_json: bool) -> None:
    """List the stored reference voices."""
    from ttsq.client import Client
    from ttsq.voices import list_voices

    with Client(settings_of(ctx)) as client:
        found = [voice.summary() for voice in list_voices(client.storage)]
    if as_json:
        click.echo(json.dumps(found))
        return
    if not found:
        click.echo("no voices (`ttsq voices add FILE`)")
    for voice in found:
        click.echo(
            f"{voice['reference']}  {voice['duration_s']} s  {'with' if voice['transcript'] else 'no'} transcript"
        )


@voices.command("delete")
@click.argument("reference")
@click.pass_context
@one_line_errors
def voices_delete(ctx: click.Context, reference: str) -> None:
    """Remove the stored reference REFERENCE (voices/<sha256>.wav) and its transcript."""
    from ttsq.client import Client
    from ttsq.errors import InvalidRequest
    from ttsq.voices import delete_voice

    with Client(settings_of(ctx)) as client:
        if not delete_voice(client.storage, reference):
            raise InvalidRequest("reference", f"no voice {reference} in storage")
    click.echo(f"deleted {reference}")
