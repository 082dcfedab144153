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
