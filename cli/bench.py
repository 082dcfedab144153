"""``ttsq bench``: throughput and latency of a deployment, or of an embedded one started for the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from click.core import ParameterSource

from ttsq.job import FORMATS

from .common import one_line_errors, settings_of, sources_of


@click.command()
@click.option("-n", "--jobs", type=int, default=200, show_default=True, help="Timed jobs to run.")
@click.option(
    "-c",
    "--concurrency",
    type=int,
    default=None,
    help="Closed loop: jobs in flight at once. Default: twice the max batch.",
)
@click.option(
    "--rate",
    type=float,
    default=None,
    help="Open loop instead: mean arrivals per second, Poisson; latency counts from each arrival.",
)
@click.option(
    "--mode",
    type=click.Choice(["synthesize", "cache-hit"]),
    default="synthesize",
    show_default=True,
    help="synthesize: every job misses the cache. cache-hit: time submits of already cached requests.",
)
@click.option(
    "--corpus",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    help="Sentences, one a line: text, LANGUAGE<TAB>text, or a JSON object of request fields. "
    "Default: short, medium and long sentences in seven languages.",
)
@click.option(
    "--format",
    "audio_format",
    type=click.Choice(FORMATS),
    default="wav",
    show_default=True,
    help="Output format of every job.",
)
@click.option("--warmup", type=int, default=0, show_default=True, help="Untimed jobs sent first.")
@click.option("--timeout", type=float, default=300.0, show_default=True, help="Seconds to wait for each job.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the corpus order and arrivals.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, allow_dash=True, path_type=Path),
    default=None,
    help="Also write the figures as JSON to this file ('-': JSON on stdout, no table).",
)
@click.option(
    "--embedded",
    is_flag=True,
    help="Bench a private Redis and an in-process worker started for the run (audio in a temporary "
    "folder unless --storage-url is given).",
)
@click.option(
    "--engine",
    envvar="TTSQ_ENGINE",
    show_envvar=True,
    default=None,
    help="Engine: of the embedded worker (espeak unless this flag says otherwise: not from the variable), "
    "else the one whose workers the producer expects.",
)
@click.option(
    "--max-batch",
    envvar="TTSQ_MAX_BATCH",
    show_envvar=True,
    type=int,
    default=None,
    help="Embedded worker's largest batch.",
)
@click.option(
    "--max-wait-ms",
    envvar="TTSQ_MAX_WAIT_MS",
    show_envvar=True,
    type=int,
    default=None,
    help="Embedded worker's longest wait for a batch to fill.",
)
@click.pass_context
@one_line_errors
def bench(
    ctx: click.Context,
    jobs: int,
    concurrency: int | None,
    rate: float | None,
    mode: str,
    corpus: Path | None,
    audio_format: str,
    warmup: int,
    timeout: float,
    seed: int,
    json_path: Path | None,
    embedded: bool,
    engine: str | None,
    max_batch: int | None,
    max_wait_ms: int | None,
) -> None:
    """Measure throughput and latency: N jobs at a fixed concurrency or arrival rate."""
    from ttsq.job import Limits
    from ttsq.ops import bench as benchmark

    if concurrency is not None and rate is not None:
        raise click.UsageError("--concurrency and --rate exclude each other: choose a closed or an open loop")
    if embedded and ctx.get_parameter_source("engine") is not ParameterSource.COMMANDLINE:
        engine = "espeak"  # like `submit --embedded`: a fresh machine has no GPU model
    settings = settings_of(ctx, engine=engine, max_batch=max_batch, max_wait_ms=max_wait_ms)
    plan = benchmark.Plan(
        jobs=jobs,
        concurrency=concurrency or settings.concurrency,
        rate=rate,
        mode="cache-hit" if mode == "cache-hit" else "synthesize",
        timeout_s=timeout,
        seed=seed,
        audio_format=audio_format,
        warmup=warmup,
    )
    sentences = benchmark.load_corpus(corpus) if corpus else list(benchmark.CORPUS)
    benchmark.check_corpus(sentences, plan, Limits.from_settings(settings))  # before the progress bar shows
    # A bar on a terminal only, erased once done: the report's own first line says what ran (off a
    # terminal, click would print the bare label as a line of its own).
    on_terminal = sys.stderr.isatty()
    with click.progressbar(length=jobs, label="ttsq bench", file=sys.stderr, hidden=not on_terminal) as bar:
        figures = benchmark.measure(
            settings,
            plan,
            sentences,
            embedded=embedded,
            temporary_storage=embedded and sources_of(ctx)["storage_url"] == "default",
            corpus_name=str(corpus) if corpus else "built-in",
            progress=bar.update,
        )
    if on_terminal:
        click.echo("\x1b[1A\x1b[2K", file=sys.stderr, nl=False)  # up to the finished bar's line, and clear it
    encoded = json.dumps(figures, indent=2, ensure_ascii=False)
    if json_path is not None and str(json_path) == "-":
        click.echo(encoded)
    else:
        click.echo(benchmark.format_report(figures))
        if json_path is not None:
            json_path.write_text(encoded + "\n", encoding="utf-8")
    if not figures["jobs"]["ok"]:
        sys.exit(1)
