"""``ttsq voices``: reference recordings for voice_clone, and named voices (``ttsq voices named``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from .common import one_line_errors, settings_of


@click.group()
def voices() -> None:
    """Reference voices for voice_clone, and named voices."""


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
        named = 0 if found or as_json else len(client.redis.named_voices.list())
    if as_json:
        click.echo(json.dumps(found))
        return
    if not found:
        also = f"; {named} named voice{'s' if named != 1 else ''}: `ttsq voices named list`" if named else ""
        click.echo(f"no stored reference voices (`ttsq voices add FILE`){also}")
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


@voices.group("named")
def named() -> None:
    """Named voices: a voice kept under a name (a description, a language and a seed), used as `voice`."""


@named.command("add")
@click.argument("name")
@click.option("--instruct", default="", help="The voice, described in words (required for voice_design).")
@click.option("--language", default="auto", show_default=True, help="The voice's language: korean, english, ko, ...")
@click.option("--seed", type=int, default=None, help="Fixes the voice the description makes. Default: one drawn now.")
@click.option(
    "--mode",
    type=click.Choice(["voice_design", "custom_voice", "voice_clone"]),
    default="voice_design",
    show_default=True,
    help="voice_design (--instruct), custom_voice (--speaker) or voice_clone (--reference).",
)
@click.option("--speaker", default="", help="custom_voice: a speaker of the fleet's model.")
@click.option("--reference", default="", help="voice_clone: a key from `ttsq voices add`.")
@click.option("--json", "as_json", is_flag=True, help="Print the voice as JSON.")
@click.pass_context
@one_line_errors
def named_add(
    ctx: click.Context,
    name: str,
    instruct: str,
    language: str,
    seed: int | None,
    mode: str,
    speaker: str,
    reference: str,
    as_json: bool,
) -> None:
    """Keep a voice as NAME (a-z, 0-9, _ and -; up to 40); print it. A name taken already is refused."""
    from ttsq.errors import InvalidRequest
    from ttsq.job import Limits
    from ttsq.records.connection import redis_errors
    from ttsq.records.named_voices import NamedVoice
    from ttsq.records.owner import RedisOwner

    settings = settings_of(ctx)
    given = {"instruct": instruct, "speaker": speaker, "reference": reference}
    body = {"name": name, "mode": mode, "language": language, "seed": seed, **{k: v for k, v in given.items() if v}}
    voice = NamedVoice.create(body, limits=Limits.from_settings(settings))
    with redis_errors(settings.cache_url):
        if not RedisOwner(settings, role="cli").named_voices.add(voice):
            raise InvalidRequest("name", f"a voice named {voice.name!r} exists; delete it first")
    click.echo(json.dumps(voice.summary(), ensure_ascii=False) if as_json else _line(voice.summary()))


@named.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the voices as JSON.")
@click.pass_context
@one_line_errors
def named_list(ctx: click.Context, as_json: bool) -> None:
    """List the named voices (a record that is not what ttsq writes is listed with its error)."""
    from ttsq.records.connection import redis_errors
    from ttsq.records.named_voices import NamedVoice
    from ttsq.records.owner import RedisOwner

    settings = settings_of(ctx)
    with redis_errors(settings.cache_url):
        found = RedisOwner(settings, role="cli").named_voices.list()
    rows: list[dict[str, Any]] = [
        voice.summary() if isinstance(voice, NamedVoice) else {"id": name, "type": "named", "error": str(voice)}
        for name, voice in found.items()
    ]
    if as_json:
        click.echo(json.dumps(rows, ensure_ascii=False))
        return
    if not rows:
        click.echo("no named voices (`ttsq voices named add NAME --instruct ...`)")
    for row in rows:
        click.echo(f"{row['id']}  corrupt: {row['error']}" if "error" in row else _line(row))


@named.command("delete")
@click.argument("name")
@click.pass_context
@one_line_errors
def named_delete(ctx: click.Context, name: str) -> None:
    """Remove the named voice NAME. Audio made with it stays cached (its key is its fields', not its name's)."""
    from ttsq.errors import InvalidRequest
    from ttsq.records.connection import redis_errors
    from ttsq.records.owner import RedisOwner

    settings = settings_of(ctx)
    with redis_errors(settings.cache_url):
        if not RedisOwner(settings, role="cli").named_voices.delete(name):
            raise InvalidRequest("name", f"no named voice {name[:60]!r}")
    click.echo(f"deleted {name.strip().lower()}")


def _line(voice: dict[str, Any]) -> str:
    """A named voice on one line: its name, mode, language and seed, then what makes the voice."""
    made_of = voice.get("instruct") or voice.get("speaker") or voice.get("reference") or ""
    return f"{voice['id']}  {voice['mode']}  {voice['language']}  seed {voice['seed']}  {made_of}"
