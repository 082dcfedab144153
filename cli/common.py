"""What every ``ttsq`` command shares: settings from flags and ``TTSQ_*``, one-line errors, result lines."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from ttsq.config import Settings
from ttsq.errors import ConfigError, InvalidRequest, TTSQError
from ttsq.request import JobResult

if TYPE_CHECKING:
    from ttsq.client import Client

F = TypeVar("F", bound=Callable[..., Any])


def one_line_errors(command: F) -> F:
    """Turn ttsq's errors into ``ttsq: error: ...`` and an exit code (2 for bad input or settings)."""

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
        fail(message, code)

    return wrapper  # type: ignore[return-value]


def fail(message: str, code: int) -> None:
    """Print one error line and exit."""
    click.echo(f"ttsq: error: {message.splitlines()[0] if message else 'failed'}", err=True)
    sys.exit(code)


def settings_of(ctx: click.Context, **overrides: Any) -> Settings:
    """Settings from ``TTSQ_*``, the group's connection flags and the command's own flags."""
    return Settings.from_env(**ctx.obj, **overrides)


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
        source = f"{document['chunks']} chunks ({document['cached_chunks']} from the cache), {source}"
    ignored = f" (ignored: {', '.join(result['ignored'])})" if result["ignored"] else ""
    truncated = " (truncated at the frame cap)" if result["truncated"] else ""
    return (
        f"{result['duration_s']:.2f}s {result['format']} {result['sample_rate']} Hz, {source} "
        f"by {result['engine']}, key {result['key'][:12]}{ignored}{truncated}"
    )
