"""``ttsq serve`` (the HTTP gateway) and ``ttsq keys`` (its API keys)."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

import click

from .common import one_line_errors, settings_of

if TYPE_CHECKING:
    from ttsq.config import Settings


@click.command()
@click.option(
    "--host",
    envvar="TTSQ_GATEWAY_HOST",
    show_envvar=True,
    default=None,
    help="Address to listen on (default 127.0.0.1).",
)
@click.option(
    "--port",
    envvar="TTSQ_GATEWAY_PORT",
    show_envvar=True,
    type=int,
    default=None,
    help="Port to listen on (default 8080).",
)
@click.option("--log-level", default=None, help="uvicorn's log level (default: TTSQ_LOG_LEVEL).")
@click.option(
    "--embedded",
    is_flag=True,
    help="Start a private Redis and an in-process worker (espeak unless TTSQ_ENGINE says otherwise) with the "
    "gateway, on loopback; print its URL and an API key, as shell lines; Ctrl-C stops them all.",
)
@click.pass_context
@one_line_errors
def serve(ctx: click.Context, host: str | None, port: int | None, log_level: str | None, embedded: bool) -> None:
    """Run the HTTP gateway: OpenAI's speech API, a jobs API and voices, over this deployment's Redis.
    It holds no model; run more of it behind a load balancer to scale."""
    from ttsq.errors import EngineUnavailable

    settings = settings_of(ctx, gateway_host=host, gateway_port=port)
    try:
        import uvicorn

        from ttsq.gateway.app import KEEP_ALIVE_S, create_gateway
    except ImportError as exc:
        raise EngineUnavailable(f"the gateway needs its extra: pip install 'ttsq[gateway]' ({exc})") from exc
    level = (log_level or settings.log_level).lower()
    json_logs = settings.log_format == "json"
    log_config = _json_logging(level) if json_logs else uvicorn.config.LOGGING_CONFIG
    if embedded:
        _serve_embedded(settings, level, log_config)
        return
    uvicorn.run(
        create_gateway(settings),
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_level=level,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_S,
        log_config=log_config,
        # On a terminal uvicorn colours parts of its messages; the log guard (ttsq.logs) would show
        # those escape sequences as text. (The JSON config has no colours to turn off.)
        use_colors=None if json_logs else False,
    )


def _serve_embedded(settings: Settings, level: str, log_config: dict[str, Any]) -> None:
    """``serve --embedded``: the URL and key first, on stdout, as lines another shell can paste; the
    rest (uvicorn's log, the worker's) on stderr. Ctrl-C and SIGTERM stop everything, exit 0."""
    import signal

    from ttsq.ops.embedded import Serving, serve

    def announce(serving: Serving) -> None:
        for line in serving.exports():
            click.echo(line)
        click.echo(
            f"ttsq: serving on {serving.url} with a private Redis and an in-process {settings.engine} worker; "
            "paste the lines above into another shell (OpenAI's SDK, Client() and ttsq read them); "
            "Ctrl-C stops everything",
            err=True,
        )

    # While Redis and the worker start (serve takes both signals over once they are up), a SIGTERM
    # still stops what has started on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    serve(settings, announce=announce, log_level=level, log_config=log_config)


def _json_logging(level: str) -> dict[str, Any]:
    """uvicorn's logging, and the gateway's own, as one JSON object a line (``TTSQ_LOG_FORMAT=json``)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": "ttsq.tracing.JsonFormatter", "fields": {"service": "ttsq-gateway"}}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.access": {"handlers": ["default"], "level": level.upper(), "propagate": False},
        },
        "root": {"handlers": ["default"], "level": level.upper()},
    }


@click.group()
def keys() -> None:
    """API keys of the HTTP gateway (stored hashed in Redis)."""


@keys.command("add")
@click.argument("name")
@click.option(
    "--rate-per-min",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Requests per minute this key may make, across every gateway (0: no limit).",
)
@click.option(
    "--quota-audio-s",
    type=click.FloatRange(0),
    default=0.0,
    show_default=True,
    help="Seconds of audio per UTC day this key may be served (0: no quota).",
)
@click.option(
    "--lane",
    type=click.Choice(["interactive", "bulk"]),
    default=None,
    help="The lane of this key's jobs that name none (docs/scheduling.md). Default: interactive for a job, "
    "bulk for a document.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the key as JSON.")
@click.pass_context
@one_line_errors
def keys_add(
    ctx: click.Context, name: str, rate_per_min: int, quota_audio_s: float, lane: str | None, as_json: bool
) -> None:
    """Create a key named NAME and print its token, once: it is not stored, only its hash."""
    from ttsq.gateway.apikeys import ApiKeys
    from ttsq.records.connection import redis_errors
    from ttsq.records.owner import RedisOwner

    settings = settings_of(ctx)
    with redis_errors(settings.cache_url):
        token, key = ApiKeys(RedisOwner(settings, role="cli").cache).add(
            name, rate_per_min=rate_per_min, quota_audio_s=quota_audio_s, lane=lane or ""
        )
    click.echo(json.dumps({"token": token, **key.summary()}) if as_json else token)


@keys.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the keys as JSON.")
@click.pass_context
@one_line_errors
def keys_list(ctx: click.Context, as_json: bool) -> None:
    """List the keys: name, id, limits, audio served today, revoked or not (never a token)."""
    from ttsq.gateway.apikeys import ApiKeys
    from ttsq.records.connection import redis_errors
    from ttsq.records.owner import RedisOwner

    settings = settings_of(ctx)
    with redis_errors(settings.cache_url):
        store = ApiKeys(RedisOwner(settings, role="cli").cache)
        rows = [key.summary(store.used_today(key)) for key in store.list()]
    if as_json:
        click.echo(json.dumps(rows))
        return
    if not rows:
        click.echo("no keys (`ttsq keys add NAME`)")
    for row in rows:
        revoked = time.strftime("revoked %Y-%m-%d", time.gmtime(row["revoked_at"])) if row["revoked_at"] else "live"
        click.echo(
            f"{row['id']}  {row['name']}  {revoked}  rate {row['rate_per_min'] or '-'}/min  "
            f"quota {row['quota_audio_s'] or '-'} s/day  used today {row['used_today_s']} s"
        )


@keys.command("revoke")
@click.argument("name_or_id")
@click.pass_context
@one_line_errors
def keys_revoke(ctx: click.Context, name_or_id: str) -> None:
    """Revoke the live key with this name or id: every gateway refuses it at once (403)."""
    from ttsq.gateway.apikeys import ApiKeys
    from ttsq.records.connection import redis_errors
    from ttsq.records.owner import RedisOwner

    settings = settings_of(ctx)
    with redis_errors(settings.cache_url):
        key = ApiKeys(RedisOwner(settings, role="cli").cache).revoke(name_or_id)
    click.echo(f"revoked {key.id} ({key.name})")
