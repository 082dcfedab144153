"""``ttsq``: submit speech jobs, look them up, run a worker.

Thin by design: parse flags, build ``Settings``, call ``ttsq``. Errors are one line on stderr and a
non-zero exit (2 for bad input or settings, 1 for everything else), never a traceback. The commands
live by family: ``jobs`` (submit, status, result), ``voices``, ``fleet`` (worker, stats, flower,
failed, retry) and ``bench``; this module is the group and the entry point.
"""

from __future__ import annotations

import sys

import click

from ttsq import __version__

from .bench import bench
from .common import fail
from .fleet import dead, failed, flower, retry, stats, worker
from .gateway import keys, serve
from .jobs import result, status, submit
from .voices import voices


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ttsq")
@click.option("--broker-url", envvar="TTSQ_BROKER_URL", help="Celery broker (redis://...). [TTSQ_BROKER_URL]")
@click.option(
    "--result-backend", envvar="TTSQ_RESULT_BACKEND", help="Celery result backend (redis://...). [TTSQ_RESULT_BACKEND]"
)
@click.option("--cache-url", envvar="TTSQ_CACHE_URL", help="Redis for the cache index. [TTSQ_CACHE_URL]")
@click.option(
    "--storage-url", envvar="TTSQ_STORAGE_URL", help="s3://bucket/prefix or a local folder. [TTSQ_STORAGE_URL]"
)
@click.pass_context
def cli(
    ctx: click.Context,
    broker_url: str | None,
    result_backend: str | None,
    cache_url: str | None,
    storage_url: str | None,
) -> None:
    """ttsq: distributed text-to-speech on Celery and Redis."""
    ctx.obj = {
        "broker_url": broker_url,
        "result_backend": result_backend,
        "cache_url": cache_url,
        "storage_url": storage_url,
    }


for _command in (submit, status, result, voices, failed, retry, dead, worker, serve, keys, bench, stats, flower):
    cli.add_command(_command)


def main() -> None:
    """Console entry point: click's usage errors become one line too."""
    try:
        code = cli.main(prog_name="ttsq", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `ttsq`: the help, not an error
        click.echo(exc.ctx.get_help() if exc.ctx else "")
        code = 0
    except click.UsageError as exc:
        fail(exc.format_message(), 2)
    except click.Abort:
        fail("aborted", 130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
