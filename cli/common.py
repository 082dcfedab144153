"""What every ``ttsq`` command shares: settings from flags and ``TTSQ_*``, one-line errors, result lines."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click
from click.core import ParameterSource

from ttsq.config import ENV_PREFIX, Settings
from ttsq.errors import ConfigError, InvalidRequest, TTSQError
from ttsq.job import FORMATS, JobResult

if TYPE_CHECKING:
    from ttsq.client import Client

F = TypeVar("F", bound=Callable[..., Any])

#: The connection flags of every command, each with its help; its variable is ``TTSQ_<NAME>``.
CONNECTION_FLAGS = (
    ("broker_url", "Celery broker (redis://...)."),
    ("result_backend", "Celery result backend (redis://...)."),
    ("cache_url", "Redis for the cache index."),
    ("storage_url", "s3://bucket/prefix or a local folder."),
)


def connection_options() -> list[click.Option]:
    """The connection flags, made afresh for one command: the group and every command take them, so
    ``ttsq --broker-url X submit`` and ``ttsq submit --broker-url X`` mean the same (the later wins)."""
    return [
        click.Option(
            [f"--{name.replace('_', '-')}"],
            envvar=ENV_PREFIX + name.upper(),
            show_envvar=True,
            expose_value=False,
            callback=_keep_flag,
            help=text,
        )
        for name, text in CONNECTION_FLAGS
    ]


def _keep_flag(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """Keep a connection flag given on the command line as an override of the settings (``ctx.obj``,
    shared by the group and its command). A value click found in the environment is not kept:
    ``Settings.from_env`` reads the same variable, and ``ttsq config`` names it as its source."""
    if param.name and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
        ctx.ensure_object(dict)[param.name] = value
    return value


def one_line_errors(command: F) -> F:
    """Turn ttsq's errors into ``ttsq: error: ...`` and an exit code (2 for bad input or settings)."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except click.ClickException:
            raise  # usage errors: main() prints them as one line
        except BrokenPipeError:
            closed_pipe()
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
        fail(message, code)

    return wrapper  # type: ignore[return-value]


#: The exit status of a command whose stdout reader went away: 128 + SIGPIPE, what a shell reports for
#: ``cat`` or ``grep`` stopped by that signal (``yes | head`` under ``set -o pipefail``).
CLOSED_PIPE_EXIT = 141


def closed_pipe() -> NoReturn:
    """The reader of stdout went away (``ttsq ... | head``): stop quietly, as a Unix tool stopped by
    SIGPIPE does. Stdout is pointed at /dev/null first, so the interpreter's last flush of what is still
    buffered does not fail again (``Exception ignored ... BrokenPipeError``)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout is not a file descriptor (a test runner's buffer)
        pass
    sys.exit(CLOSED_PIPE_EXIT)


#: Output name extensions and the format each names (Ogg Opus files are often named .opus).
OUTPUT_EXTENSIONS: dict[str, str] = {**{fmt: fmt for fmt in FORMATS}, "opus": "ogg"}


def format_of_output(output: Path) -> str | None:
    """The format an output name's extension names; None for a name without one. A usage error for an
    extension that is no format ttsq writes: ``-o x.aac`` would otherwise hold WAV data."""
    suffix = output.suffix.lower().lstrip(".")
    if not suffix:
        return None
    if suffix not in OUTPUT_EXTENSIONS:
        supported = ", ".join(f".{extension}" for extension in OUTPUT_EXTENSIONS)
        raise click.BadParameter(
            f"{output}: .{suffix} is not a format ttsq writes; name the file {supported}",
            param_hint="'-o' / '--output'",
        )
    return OUTPUT_EXTENSIONS[suffix]


def fail(message: str, code: int) -> None:
    """Print one error line and exit."""
    click.echo(f"ttsq: error: {message.splitlines()[0] if message else 'failed'}", err=True)
    sys.exit(code)


def settings_of(ctx: click.Context, **overrides: Any) -> Settings:
    """Settings from ``TTSQ_*``, the connection flags and the command's own flags."""
    return Settings.from_env(**ctx.ensure_object(dict), **overrides)


def sources_of(ctx: click.Context, **overrides: Any) -> dict[str, str]:
    """Where ``settings_of`` with the same flags takes each setting from: ``flag --NAME``,
    ``environment`` or ``default``."""
    sources = Settings.sources(**ctx.ensure_object(dict), **overrides)
    return {
        name: f"flag --{name.replace('_', '-')}" if source == "override" else source for name, source in sources.items()
    }


def pointed_to_documents(exc: InvalidRequest, kind: str, max_text_chars: int) -> InvalidRequest:
    """A text too long for one job: the same error, pointing to -f (a document is split into chunk
    jobs). Here, not in the core: the HTTP gateway and ``send_task`` share that error and have no -f."""
    if kind == "job" and exc.field == "text" and exc.reason.endswith(f"the limit is {max_text_chars}"):
        return InvalidRequest(
            "text", f"{exc.reason}; for a longer text use `ttsq submit -f FILE` ('-f -': stdin), split into chunk jobs"
        )
    return exc


def read_text(data: bytes) -> str:
    """Input bytes (a file, stdin) as text; ``InvalidRequest`` on text that is not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidRequest("text", "is not valid UTF-8") from None


def report(result: JobResult, *, output: Path | None, as_json: bool, client: Client) -> None:
    """Write the audio if asked (read through ttsq's storage, never from the result's URL), then one line
    (or the JSON) about the result."""
    import json

    if output is not None:
        named = format_of_output(output)
        if named is not None and named != result["format"]:  # never a .mp3 file that holds a WAV
            raise click.UsageError(
                f"-o {output} names {named}, but the result is {result['format']}: name the file "
                f".{result['format']}, or submit again with --format {named}"
            )
        output.write_bytes(client.download(result))
    if as_json:
        click.echo(json.dumps(result, ensure_ascii=False))
    elif output is not None:
        click.echo(f"wrote {output}: {summary(result)}")
    else:
        click.echo(f"{summary(result)} {result['url']}")


def summary(result: JobResult) -> str:
    """One line about a result: duration, format, where it came from, its key."""
    source = "cached" if result["cached"] else "synthesized"
    document = result.get("document")
    if isinstance(document, dict):  # a stitched document
        chunks = document["chunks"]
        source = f"{chunks} chunk{'' if chunks == 1 else 's'} ({document['cached_chunks']} from the cache), {source}"
    ignored = f" (ignored: {', '.join(result['ignored'])})" if result["ignored"] else ""
    truncated = " (truncated at the frame cap)" if result["truncated"] else ""
    return (
        f"{result['duration_s']:.2f}s {result['format']} {result['sample_rate']} Hz, {source} "
        f"by {result['engine']}, key {result['key'][:12]}{ignored}{truncated}"
    )
