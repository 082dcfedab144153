"""Measure a deployment the way serving stacks are compared: throughput, latency percentiles, batch fill.

``run`` drives N jobs through a ``Target`` (a ttsq ``Client``, or anything that sends one request and
blocks on its result), either

- **closed loop** at a fixed concurrency: C sender threads, each submits its next job when its last
  one is done; or
- **open loop** at a fixed arrival rate: Poisson arrivals on a schedule that does not wait for the
  system. Latency counts from the scheduled arrival, so an overloaded deployment shows up as growing
  latency, not as a sender that quietly slows down (coordinated omission).

Every job misses the cache by default: a cache hit measures Redis, not synthesis, so each text starts
with an invisible per-job marker (20 zero-width characters) that gives it a content key of its own.
espeak-ng speaks the same audio with or without it (tested); a neural model sees a few more input
tokens, which cost next to nothing next to generating the audio. ``mode="cache-hit"`` is the separate, named bench of
the cache: the corpus is synthesized once, then every timed submit is a producer-side hit.

Batch fill comes from the workers' own reports (each result's ``batch_size``); stage timings from the
result's ``timings`` and the sender's clock, so the report can say where a job's time goes.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from ttsq.errors import InvalidRequest
from ttsq.job import Limits, SynthesisRequest
from ttsq.keys import content_key
from ttsq.ops.corpus import CORPUS, Plan, Sentence, bust_marker, check_corpus, load_corpus, make_requests
from ttsq.ops.report import QUEUE_OVERHEAD_LABEL, STAGES, Outcome, format_report, report

if TYPE_CHECKING:
    from ttsq.client import Client
    from ttsq.config import Settings

#: Re-exported: what a caller of the load generator needs beside ``run`` and ``measure``.
__all__ = [
    "CORPUS",
    "QUEUE_OVERHEAD_LABEL",
    "STAGES",
    "ClientTarget",
    "Outcome",
    "Plan",
    "Sentence",
    "Target",
    "bust_marker",
    "check_corpus",
    "format_report",
    "load_corpus",
    "make_requests",
    "measure",
    "report",
    "run",
]

logger = logging.getLogger(__name__)


class Target(Protocol):
    """Something that sends one request and blocks on its result."""

    def run_one(self, fields: dict[str, Any], timeout_s: float) -> tuple[Mapping[str, Any], dict[str, float]]:
        """The job's result, and seconds spent in sender-side stages (stage name → seconds)."""
        ...


class ClientTarget:
    """Jobs through ``ttsq.client.Client``: validation, cache short-circuit, single flight, Celery."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def run_one(self, fields: dict[str, Any], timeout_s: float) -> tuple[Mapping[str, Any], dict[str, float]]:
        """Submit and wait, timing validation + hashing and publishing separately."""
        # Read from Redis at most every few seconds: not this job's cost.
        identity = self.client.identities().get(str(fields.get("mode", "voice_design")))
        started = time.perf_counter()
        request = SynthesisRequest.from_dict(fields, self.client.limits)
        if identity is not None:
            # submit_request hashes again (microseconds); this one is timed alone.
            content_key(request, identity)
        checked = time.perf_counter()
        job = self.client.submit_request(request)
        published = time.perf_counter()
        result = job.wait(timeout_s)
        return result, {"client_validate_hash": checked - started, "client_publish": published - checked}


def run(
    target: Target,
    corpus: Sequence[Sentence],
    plan: Plan,
    *,
    progress: Callable[[int], None] | None = None,
    run_id: str | None = None,
) -> tuple[list[Outcome], float]:
    """Run the plan; return every timed job's outcome and the wall time of the timed part (seconds)."""
    if not corpus:
        raise InvalidRequest("corpus", "is empty")
    run_id = run_id or secrets.token_hex(8)
    if plan.warmup:
        warm = make_requests(
            corpus,
            plan.warmup,
            mode="synthesize",
            run_id=run_id + "-warmup",
            seed=plan.seed,
            audio_format=plan.audio_format,
        )
        _closed_loop(target, warm, plan, concurrency=min(plan.concurrency, plan.warmup), on_done=None)
    requests = make_requests(
        corpus, plan.jobs, mode=plan.mode, run_id=run_id, seed=plan.seed, audio_format=plan.audio_format
    )
    if plan.mode == "cache-hit":
        # Synthesize (or find) every distinct text once, untimed; every timed submit is then a hit.
        distinct = list({json.dumps(r, sort_keys=True): r for r in requests}.values())
        _closed_loop(target, distinct, plan, concurrency=min(plan.concurrency, len(distinct)), on_done=None)
    lock = threading.Lock()

    def done(count: int = 1) -> None:
        if progress is not None:
            with lock:
                progress(count)

    if plan.rate is None:
        return _closed_loop(target, requests, plan, concurrency=plan.concurrency, on_done=done)
    return _open_loop(target, requests, plan, rate=plan.rate, on_done=done)


def _one(
    target: Target, index: int, fields: dict[str, Any], timeout_s: float, *, scheduled: float | None = None
) -> Outcome:
    started = time.perf_counter()
    client: dict[str, float] = {}
    if scheduled is not None:
        client["send_delay"] = max(0.0, started - scheduled)
    since = started if scheduled is None else min(started, scheduled)
    try:
        result, stages = target.run_one(fields, timeout_s)
    except Exception as exc:
        now = time.perf_counter()
        return Outcome(index, now - since, error=f"{type(exc).__name__}: {str(exc)[:200]}", client=client)
    return Outcome(index, time.perf_counter() - since, result=result, client={**client, **stages})


def _closed_loop(
    target: Target, requests: list[dict[str, Any]], plan: Plan, *, concurrency: int, on_done: Callable[[], None] | None
) -> tuple[list[Outcome], float]:
    outcomes: list[Outcome | None] = [None] * len(requests)
    indices = itertools.count()  # next() on a count is atomic under the GIL
    origin = time.perf_counter()

    def sender() -> None:
        while (index := next(indices)) < len(requests):
            outcomes[index] = _one(target, index, requests[index], plan.timeout_s)
            if on_done is not None:
                on_done()

    threads = [threading.Thread(target=sender, name=f"ttsq-bench-{n}", daemon=True) for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - origin
    return [o for o in outcomes if o is not None], wall


def _open_loop(
    target: Target, requests: list[dict[str, Any]], plan: Plan, *, rate: float, on_done: Callable[[], None]
) -> tuple[list[Outcome], float]:
    rng = random.Random(plan.seed ^ 0x5EED)
    arrivals = list(itertools.accumulate(rng.expovariate(rate) for _ in requests))
    arrivals = [at - arrivals[0] for at in arrivals]  # the first job arrives at once
    with ThreadPoolExecutor(max_workers=plan.max_in_flight, thread_name_prefix="ttsq-bench") as pool:
        origin = time.perf_counter()
        futures = []
        for index, (fields, at) in enumerate(zip(requests, arrivals, strict=True)):
            delay = origin + at - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            future = pool.submit(_one, target, index, fields, plan.timeout_s, scheduled=origin + at)
            future.add_done_callback(lambda _: on_done())
            futures.append(future)
        outcomes = [future.result() for future in futures]
    return outcomes, time.perf_counter() - origin


def measure(
    settings: Settings,
    plan: Plan,
    corpus: Sequence[Sentence],
    *,
    embedded: bool = False,
    temporary_storage: bool = False,
    corpus_name: str = "built-in",
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Run ``plan`` against the deployment ``settings`` point at, or an embedded one; return the report.

    ``temporary_storage`` (embedded only) keeps the audio in a folder removed afterwards.
    """
    import tempfile
    from contextlib import ExitStack

    from ttsq.client import Client
    from ttsq.redaction import redact_url

    check_corpus(corpus, plan, Limits.from_settings(settings))
    with ExitStack() as stack:
        if embedded:
            from ttsq.ops.embedded import Embedded

            if temporary_storage:
                folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-bench-"))
                settings = settings.replace(storage_url=folder)
            # Quiet worker: the bench prints its own figures, per-job log lines would only cost time.
            deployment = stack.enter_context(Embedded(settings.replace(log_level="WARNING")))
            # The client's own (producer) app: a worker's app does not listen for results.
            settings, owner = deployment.settings, deployment.owner
            target = (
                f"embedded: private Redis, in-process {settings.engine} worker "
                f"(max batch {settings.max_batch}, max wait {settings.max_wait_ms} ms), "
                f"storage {'temporary folder' if temporary_storage else settings.storage_url}"
            )
        else:
            target = f"broker {redact_url(settings.broker_url)}, queue {settings.queue}, engine {settings.engine}"
            owner = None
        client = Client(settings, redis=owner)
        stack.callback(client.close)
        if not embedded and not client.identities():
            logger.warning(
                "no worker of queue %s has announced itself on this cache: jobs may wait for one", settings.queue
            )
        outcomes, wall = run(ClientTarget(client), corpus, plan, progress=progress)
        languages = sorted({s.language for s in corpus})
        return report(
            outcomes,
            wall,
            plan,
            max_batch=settings.max_batch if embedded else None,
            config={
                "target": target,
                "corpus": f"{corpus_name}: {len(corpus)} sentences, languages {', '.join(languages)}",
            },
        )
