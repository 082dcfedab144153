"""Running and watching the fleet: ``ttsq worker``, ``ttsq stats``, ``ttsq flower``, ``ttsq failed``,
``ttsq retry``, ``ttsq dead``, and ``ttsq config`` (the settings a command here would run with)."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from typing import Any

import click

from ttsq.config import ENV_PREFIX

from .common import one_line_errors, settings_of, sources_of

#: A setting whose name says it is a secret is shown as ``***`` whatever its value.
_SECRET_NAME = re.compile(r"password|secret|token|key", re.I)
#: A secret in a URL's query (``redis://host/0?password=...``).
_SECRET_QUERY = re.compile(r"([?&;][^=&;#]*(?:password|secret|token|key)[^=&;#]*=)[^&;#]*", re.I)


@click.command()
@click.option(
    "--engine",
    envvar="TTSQ_ENGINE",
    show_envvar=True,
    default=None,
    help="Engine name (espeak, qwen, qwen-fast) or package.module:Factory.",
)
@click.option("--max-batch", envvar="TTSQ_MAX_BATCH", show_envvar=True, type=int, default=None, help="Largest batch.")
@click.option(
    "--max-wait-ms",
    envvar="TTSQ_MAX_WAIT_MS",
    show_envvar=True,
    type=int,
    default=None,
    help="Longest wait for a batch to fill after its first job.",
)
@click.option(
    "-n",
    "--hostname",
    default=None,
    help="Celery node name (default ENGINE@host); with --devices, the host part of gpuN@HOST.",
)
@click.option(
    "--devices",
    default=None,
    help="Launch one supervised worker process per device: all (every GPU; one CPU worker if "
    "there is none), a GPU list like 0,1,3, cpu, or cpu:N for N CPU workers.",
)
@click.option(
    "--metrics-port",
    envvar="TTSQ_METRICS_PORT",
    show_envvar=True,
    type=int,
    default=None,
    help="Prometheus port; with --devices the Nth worker gets this + N; 0 turns it off.",
)
@click.pass_context
@one_line_errors
def worker(
    ctx: click.Context,
    engine: str | None,
    max_batch: int | None,
    max_wait_ms: int | None,
    hostname: str | None,
    devices: str | None,
    metrics_port: int | None,
) -> None:
    """Run a worker: load the engine, then consume jobs until SIGTERM (which finishes the batch in
    flight first). With --devices, run and supervise one worker per device."""
    settings = settings_of(ctx, engine=engine, max_batch=max_batch, max_wait_ms=max_wait_ms, metrics_port=metrics_port)
    if devices is not None:
        import logging
        import os
        import socket

        from ttsq.workers.devices import plan
        from ttsq.workers.supervisor import Supervisor

        logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s launcher %(name)s: %(message)s")
        slots, chosen = plan(devices, os.environ)
        logging.getLogger("ttsq.launcher").info("%s", chosen)
        host = (hostname or socket.gethostname()).split("@")[-1]
        sys.exit(Supervisor(settings, slots, host=host).run())

    from ttsq.workers.celery_worker import run_worker

    sys.exit(run_worker(settings, hostname=hostname))


@click.command()
@click.option(
    "--minutes",
    type=click.IntRange(1, 120),
    default=5,
    show_default=True,
    help="How far back throughput, the cache hit ratio and the tenants' waits look.",
)
@click.option(
    "--ping-timeout",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds to wait for workers to answer a ping (0: skip the ping).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the statistics as JSON.")
@click.pass_context
@one_line_errors
def stats(ctx: click.Context, minutes: int, ping_timeout: float, as_json: bool) -> None:
    """Queue depths, workers online, throughput, cache hit ratio and the busiest tenants' waits over the
    last minutes."""
    from ttsq.ops.fleet import format_table, snapshot

    snap = snapshot(settings_of(ctx), minutes=minutes, ping_timeout=ping_timeout)
    click.echo(json.dumps(snap) if as_json else format_table(snap))


@click.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "--address",
    default="127.0.0.1",
    show_default=True,
    help="Address Flower listens on (0.0.0.0 for every interface: put TLS and a firewall in front).",
)
@click.option("--port", type=int, default=5555, show_default=True, help="Flower's port.")
@click.option(
    "--basic-auth",
    envvar="FLOWER_BASIC_AUTH",
    show_envvar=True,
    default=None,
    help="user:password for Flower's pages and API.",
)
@click.option("--no-auth", is_flag=True, help="Run without authentication (trusted networks only).")
@click.argument("flower_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
@one_line_errors
def flower(
    ctx: click.Context, address: str, port: int, basic_auth: str | None, no_auth: bool, flower_args: tuple[str, ...]
) -> None:
    """Run Flower on ttsq's broker, with basic auth. Extra arguments go to Flower (--persistent=True, ...)."""
    from ttsq.ops.flower import run_flower

    sys.exit(
        run_flower(
            settings_of(ctx), address=address, port=port, basic_auth=basic_auth, no_auth=no_auth, extra=flower_args
        )
    )


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the parked jobs as JSON.")
@click.pass_context
@one_line_errors
def failed(ctx: click.Context, as_json: bool) -> None:
    """List parked jobs: those that crashed or hung their worker too often (never their text); `ttsq
    retry ID` runs one again. Not here: a job that ran and failed with an error (its state is FAILURE:
    `ttsq status ID`), nor a message no worker would run (`ttsq dead`)."""
    from ttsq.client import Client

    jobs = [job.summary() for job in Client(settings_of(ctx)).parked()]
    if as_json:
        click.echo(json.dumps(jobs))
        return
    if not jobs:
        click.echo("no parked jobs")
    for job in jobs:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(job["parked_at"]))
        click.echo(
            f"{job['id']}  {when}Z  attempts {job['attempts']}  queue {job['queue']}  "
            f"{job['chars']} chars  {job['language']}"
        )


@click.command()
@click.argument("job_id")
@click.pass_context
@one_line_errors
def retry(ctx: click.Context, job_id: str) -> None:
    """Re-queue parked job JOB_ID (one `ttsq failed` lists) under its own id, with its attempts cleared.
    A job that failed with an error is submitted again instead; a dead message cannot be retried."""
    from ttsq.client import Client

    click.echo(f"queued {Client(settings_of(ctx)).retry(job_id)}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the dead letters as JSON.")
@click.option(
    "--purge", is_flag=True, help="Drop the dead letters listed (not those that arrive meanwhile) and say how many."
)
@click.pass_context
@one_line_errors
def dead(ctx: click.Context, as_json: bool, purge: bool) -> None:
    """List messages workers refused to run (malformed envelopes, unknown tasks), newest first: when,
    queue, why and task id, never their text. Not here: jobs that ran and failed (`ttsq status ID`), nor
    jobs parked after crashing their worker (`ttsq failed`); a dead message is not retried. They are
    kept raw in Redis (the last 1000). The ids and names come from the messages: control characters in
    them are shown as escapes."""
    from ttsq.records.connection import redis_errors
    from ttsq.records.owner import RedisOwner
    from ttsq.redaction import printable

    settings = settings_of(ctx)
    owner = RedisOwner(settings, role="cli")
    try:
        with redis_errors(settings.broker_url):
            store = owner.dead_letters
            listed = store.letters()
            purged = store.purge(listed) if purge else 0
    finally:
        owner.close()
    letters = [letter.summary() for letter in listed]
    if as_json:
        click.echo(json.dumps(letters))
    elif not letters:
        click.echo("no dead letters")
    for letter in [] if as_json else letters:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(letter["at"]))
        click.echo(
            f"{when}Z  {printable(letter['queue'] or '-')}  {printable(letter['id'] or '(no id)')}  "
            f"{printable(letter['task'] or '-')}  {letter['bytes']} bytes  "
            f"{printable(letter['reason'])}: {printable(letter['detail'], 200)}"
        )
    if purge and not as_json:
        click.echo(f"purged {purged}")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the settings as JSON.")
@click.pass_context
@one_line_errors
def config(ctx: click.Context, as_json: bool) -> None:
    """Print the effective settings (TTSQ_<NAME>=value, passwords masked) and where each came from: a
    flag, the environment or the default. Connects to nothing; a malformed value fails as at start."""
    settings = settings_of(ctx)
    sources = sources_of(ctx)
    rows = [
        (field.name, ENV_PREFIX + field.name.upper(), _shown(field.name, getattr(settings, field.name)))
        for field in dataclasses.fields(settings)
    ]
    if as_json:
        click.echo(
            json.dumps(
                {
                    name: {"variable": variable, "value": value, "source": sources[name]}
                    for name, variable, value in rows
                }
            )
        )
        return
    lines = [(f"{variable}={value}", sources[name]) for name, variable, value in rows]
    width = max(len(line) for line, _ in lines)
    for line, source in lines:
        click.echo(f"{line:<{width}}  # {source}")


def _shown(name: str, value: Any) -> Any:
    """A setting as ``ttsq config`` shows it: passwords in URLs and secrets masked."""
    if not isinstance(value, str) or not value:
        return value
    if _SECRET_NAME.search(name):
        return "***"
    from ttsq.redaction import redact_url

    return _SECRET_QUERY.sub(r"\1***", redact_url(value)) if "://" in value else value
