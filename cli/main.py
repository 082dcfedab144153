"""``ttsq``: submit speech jobs, look them up, run a worker.

Thin by design: parse flags, build ``Settings``, call ``ttsq``. Errors are one line on stderr and a
non-zero exit (2 for bad input or settings, 1 for everything else), never a traceback. The commands
live by family: ``jobs`` (submit), ``follow`` (status, result, cancel), ``voices``, ``fleet`` (worker, stats, flower,
failed, retry, dead, config) and ``bench``; this module is the group and the entry point. The connection
flags (``--broker-url`` ...) are the group's and every command's: before or after the command's name.
"""

from __future__ import annotations

import sys

import click

from ttsq import __version__
from ttsq.logs import guard_logs

from .bench import bench
from .common import closed_pipe, connection_options, fail
from .fleet import config, dead, failed, flower, retry, stats, worker
from .follow import cancel, result, status
from .gateway import keys, serve
from .jobs import submit
from .voices import voices


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="ttsq")
@click.pass_context
def cli(ctx: click.Context) -> None:
    """ttsq: distributed text-to-speech on Celery and Redis."""
    ctx.ensure_object(dict)  # the connection flags given on the command line (``common.settings_of``)


def _take_connection_flags(command: click.Command) -> None:
    """Give ``command`` (every command of a group) the connection flags the group takes."""
    if isinstance(command, click.Group):
        for sub in command.commands.values():
            _take_connection_flags(sub)
    else:
        command.params.extend(connection_options())


_COMMANDS = (
    submit,
    status,
    result,
    cancel,
    voices,
    failed,
    retry,
    dead,
    worker,
    serve,
    keys,
    bench,
    stats,
    flower,
    config,
)
cli.params.extend(connection_options())
for _command in _COMMANDS:
    _take_connection_flags(_command)
    cli.add_command(_command)


def main() -> None:
    """Console entry point: click's usage errors become one line too."""
    # Every process ttsq starts comes through here (workers, the launcher and its workers, the gateway,
    # Flower, each command): the log guard first, before any library logs (ttsq.logs).
    guard_logs()
    try:
        code = cli.main(prog_name="ttsq", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as exc:  # bare `ttsq`: the help, not an error
        click.echo(exc.ctx.get_help() if exc.ctx else "")
        code = 0
    except click.UsageError as exc:
        fail(exc.format_message(), 2)
    except click.Abort:
        fail("aborted", 130)
    except BrokenPipeError:  # stdout's reader went away outside a command (`ttsq --help | head -1`)
        closed_pipe()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
