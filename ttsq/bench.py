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

import hashlib
import itertools
import json
import logging
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from ttsq.errors import InvalidRequest
from ttsq.keys import content_key
from ttsq.request import Limits, SynthesisRequest

if TYPE_CHECKING:
    from ttsq.client import Client
    from ttsq.config import Settings

logger = logging.getLogger(__name__)

BenchMode = Literal["synthesize", "cache-hit"]
MODES: tuple[BenchMode, ...] = ("synthesize", "cache-hit")
#: Version of the JSON report's shape.
REPORT_VERSION = 1


@dataclass(frozen=True)
class Sentence:
    """One corpus entry: text, its language, its size class, and any other request fields."""

    text: str
    language: str = "auto"
    size: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)


def _mix(language: str, short: str, medium: str, long: str) -> tuple[Sentence, ...]:
    return (Sentence(short, language, "short"), Sentence(medium, language, "medium"),
            Sentence(long, language, "long"))


#: The built-in mix: a short, a medium and a long sentence in each of seven languages.
CORPUS: tuple[Sentence, ...] = (
    *_mix("english", "Hello, and welcome.",
          "The train to the airport leaves every twenty minutes from the second platform.",
          "When the storm finally passed, the villagers walked down to the harbour to count the boats, and to "
          "their surprise every one of them was still there, rocking gently against the old stone wall as if "
          "nothing had happened at all."),
    *_mix("korean", "안녕하세요, 반갑습니다.",
          "오늘 오후에는 전국적으로 비가 내리고 저녁부터 기온이 크게 떨어지겠습니다.",
          "지난주에 새로 문을 연 동네 도서관은 주말마다 어린이를 위한 그림책 읽기 모임을 열고 있는데, 부모들 사이에서 "
          "입소문이 나면서 벌써 다음 달 예약까지 모두 찼다고 합니다."),
    *_mix("japanese", "おはようございます。",
          "次の電車は十時十五分に三番線から発車します。",
          "週末に友人と山へ出かけたのですが、頂上に着く頃には霧がすっかり晴れて、遠くの海まで見渡すことができ、"
          "持ってきたおにぎりがいつもよりずっと美味しく感じられました。"),
    *_mix("chinese", "你好，欢迎光临。",
          "明天上午九点，我们会在三楼会议室讨论新的项目计划。",
          "这家小餐馆开了二十多年，老板每天清晨五点就开始准备食材，所以无论什么时候来，客人总能吃到新鲜又热乎的饭菜，"
          "这也是街坊们一直愿意光顾的原因。"),
    *_mix("german", "Guten Morgen!",
          "Der Zug nach München hat heute leider etwa zwanzig Minuten Verspätung.",
          "Als wir am Abend endlich die Hütte erreichten, war das Feuer schon angezündet, und der Wirt stellte "
          "uns ohne ein Wort zwei dampfende Teller Suppe auf den Tisch, die nach einem langen Tag im Schnee "
          "besser schmeckte als jedes Festessen."),
    *_mix("french", "Bonjour à tous.",
          "La bibliothèque municipale sera fermée lundi prochain pour des travaux.",
          "Chaque été, ma grand-mère préparait des confitures avec les abricots du jardin, et toute la maison "
          "sentait le sucre chaud pendant des jours, si bien que les voisins passaient toujours nous rendre "
          "visite à ce moment-là."),
    *_mix("spanish", "¡Buenos días!",
          "El museo abre sus puertas a las diez de la mañana, de martes a domingo.",
          "Cuando llegamos al pueblo ya era de noche, pero la plaza seguía llena de gente que bailaba al ritmo "
          "de una pequeña orquesta, y un señor muy amable nos invitó a sentarnos con su familia a compartir la "
          "cena."),
)


def load_corpus(path: Path) -> list[Sentence]:
    """A corpus file, one entry per line: plain text, ``LANGUAGE<TAB>text``, or a JSON object of
    request fields (``{"text": ..., "language": ..., "instruct": ...}``). Blank lines and lines
    starting with ``#`` are skipped."""
    sentences = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InvalidRequest("corpus", f"line {number}: not valid JSON ({exc.msg})") from None
            if not isinstance(data, dict) or not isinstance(data.get("text"), str):
                raise InvalidRequest("corpus", f"line {number}: a JSON line needs a \"text\" string")
            extra = {k: v for k, v in data.items() if k not in ("text", "language")}
            sentences.append(Sentence(data["text"], str(data.get("language", "auto")), fields=extra))
        elif "\t" in line:
            language, text = line.split("\t", 1)
            sentences.append(Sentence(text.strip(), language.strip()))
        else:
            sentences.append(Sentence(line))
    if not sentences:
        raise InvalidRequest("corpus", f"{path} holds no sentences")
    return sentences


# Zero-width characters (format characters, not whitespace: normalization keeps them). Put before the
# text they change its content key but not what espeak-ng says; after the text espeak adds a pause.
_MARKER_SYMBOLS = ("\u200b", "\u200c", "\u200d", "\u2060")
_MARKER_LENGTH = 20  # 40 bits: two jobs of one run share a key with odds below 1e-4 at 10^4 jobs


def bust_marker(run_id: str, index: int) -> str:
    """An invisible prefix unique to one job of one run, so the job misses the cache."""
    value = int.from_bytes(hashlib.sha256(f"{run_id}:{index}".encode()).digest()[:8], "big")
    return "".join(_MARKER_SYMBOLS[(value >> (2 * i)) & 3] for i in range(_MARKER_LENGTH))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to run: how many jobs, how they arrive, which path they take."""

    jobs: int
    #: Closed loop: jobs in flight at once. Ignored when ``rate`` is set.
    concurrency: int = 16
    #: Open loop: mean arrivals per second (Poisson). None for a closed loop.
    rate: float | None = None
    mode: BenchMode = "synthesize"
    timeout_s: float = 300.0
    seed: int = 0
    #: Open loop: most jobs in flight; past it arrivals wait for a sender (and that wait counts).
    max_in_flight: int = 256
    audio_format: str = "wav"
    #: Untimed jobs sent first (cache misses), so connections and first calls are paid before timing.
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.jobs < 1:
            raise InvalidRequest("jobs", "must be at least 1")
        if self.concurrency < 1:
            raise InvalidRequest("concurrency", "must be at least 1")
        if self.rate is not None and not self.rate > 0:
            raise InvalidRequest("rate", "must be above 0 jobs/s")
        if self.mode not in MODES:
            raise InvalidRequest("mode", f"expected one of {', '.join(MODES)}")
        if self.timeout_s <= 0:
            raise InvalidRequest("timeout", "must be above 0")
        if self.max_in_flight < 1:
            raise InvalidRequest("max_in_flight", "must be at least 1")
        if self.warmup < 0:
            raise InvalidRequest("warmup", "must be 0 or more")


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


@dataclass
class Outcome:
    """One timed job."""

    index: int
    latency_s: float
    result: Mapping[str, Any] | None = None
    error: str | None = None
    #: Sender-side stage seconds (validation, publish, and in an open loop the wait for a sender).
    client: dict[str, float] = field(default_factory=dict)


def make_requests(corpus: Sequence[Sentence], count: int, *, mode: BenchMode, run_id: str, seed: int,
                  audio_format: str) -> list[dict[str, Any]]:
    """``count`` request dicts cycling through the corpus in a shuffled order.

    In ``synthesize`` mode each text carries a marker unique to (run, position): a miss.
    """
    rng = random.Random(seed)
    order: list[Sentence] = []
    while len(order) < count:
        cycle = list(corpus)
        rng.shuffle(cycle)
        order.extend(cycle)
    requests = []
    for position, sentence in enumerate(order[:count]):
        text = sentence.text if mode == "cache-hit" else bust_marker(run_id, position) + sentence.text
        requests.append(_fields(sentence, text, audio_format))
    return requests


def _fields(sentence: Sentence, text: str, audio_format: str) -> dict[str, Any]:
    return {"format": audio_format, **sentence.fields, "text": text, "language": sentence.language}


def run(target: Target, corpus: Sequence[Sentence], plan: Plan, *,
        progress: Callable[[int], None] | None = None, run_id: str | None = None) -> tuple[list[Outcome], float]:
    """Run the plan; return every timed job's outcome and the wall time of the timed part (seconds)."""
    if not corpus:
        raise InvalidRequest("corpus", "is empty")
    run_id = run_id or secrets.token_hex(8)
    if plan.warmup:
        warm = make_requests(corpus, plan.warmup, mode="synthesize", run_id=run_id + "-warmup", seed=plan.seed,
                             audio_format=plan.audio_format)
        _closed_loop(target, warm, plan, concurrency=min(plan.concurrency, plan.warmup), on_done=None)
    requests = make_requests(corpus, plan.jobs, mode=plan.mode, run_id=run_id, seed=plan.seed,
                             audio_format=plan.audio_format)
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


def _one(target: Target, index: int, fields: dict[str, Any], timeout_s: float, *,
         scheduled: float | None = None) -> Outcome:
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


def _closed_loop(target: Target, requests: list[dict[str, Any]], plan: Plan, *, concurrency: int,
                 on_done: Callable[[], None] | None) -> tuple[list[Outcome], float]:
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


def _open_loop(target: Target, requests: list[dict[str, Any]], plan: Plan, *, rate: float,
               on_done: Callable[[], None]) -> tuple[list[Outcome], float]:
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


#: Stages of one job, in the order it meets them: (report key, what it covers). They add up to the
#: end-to-end latency: the broker's share is what the others leave.
STAGES: tuple[tuple[str, str], ...] = (
    ("send_delay", "bench: arrival waited for a sender thread"),
    ("client_validate_hash", "client: validate + content key"),
    ("client_publish", "client: cache look-up, claim, publish"),
    ("broker_round_trip", "broker: to a worker thread, result back"),
    ("batch_wait", "worker: batch wait"),
    ("synthesis", "worker: synthesis (whole batch)"),
    ("encode", "worker: encode"),
    ("upload", "worker: upload"),
    ("index_write", "worker: index write"),
    ("worker_other", "worker: validate, cache re-check, sign URL"),
)


_NOT_QUEUE_OVERHEAD = frozenset({"send_delay", "batch_wait", "synthesis"})
QUEUE_OVERHEAD_LABEL = "queue's own cost (not synthesis, batch wait)"


def job_stages(outcome: Outcome) -> dict[str, float] | None:
    """Seconds per stage of one finished job, adding up to its latency.

    None if the result carries no stage timings (a target that is not ttsq). The broker round trip
    is the remainder: the time between the publish call returning and the task starting, plus the
    time from the task's return to the producer holding the result. (The worker's own queue-wait
    figure starts at a header stamped before the publish call, so it overlaps the publish.)
    """
    result = outcome.result
    timings = result.get("timings") if result is not None else None
    if not isinstance(timings, Mapping) or "worker_s" not in timings:
        return None
    stages = {name: outcome.client.get(name, 0.0) for name in ("send_delay", "client_validate_hash",
                                                                "client_publish")}
    stages.update(batch_wait=timings["batch_wait_s"], synthesis=timings["synthesis_s"], encode=timings["encode_s"],
                  upload=timings["upload_s"], index_write=timings["index_s"])
    worker_parts = sum(stages[name] for name in ("batch_wait", "synthesis", "encode", "upload", "index_write"))
    stages["worker_other"] = max(0.0, timings["worker_s"] - worker_parts)
    stages["broker_round_trip"] = outcome.latency_s - sum(stages.values())
    return {name: stages[name] for name, _ in STAGES}


def _distribution(values: Iterable[float]) -> dict[str, float | None]:
    data = np.asarray(list(values), dtype=float)
    if data.size == 0:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    return {"mean": float(data.mean()), "p50": float(np.percentile(data, 50)), "p95": float(np.percentile(data, 95)),
            "p99": float(np.percentile(data, 99)), "max": float(data.max())}


def report(outcomes: Sequence[Outcome], wall_s: float, plan: Plan, *,
           config: Mapping[str, Any] | None = None, max_batch: int | None = None) -> dict[str, Any]:
    """The figures of one run as plain JSON (what ``format_report`` prints)."""
    ok = [o for o in outcomes if o.result is not None]
    results = [o.result for o in ok if o.result is not None]
    cached = [r for r in results if r.get("cached")]
    synthesized = [r for r in results if not r.get("cached")]
    audio_s = sum(float(r.get("duration_s", 0.0)) for r in results)
    fresh_timings = [r["timings"] for r in synthesized if isinstance(r.get("timings"), Mapping)]
    # Each job of a batch of b reports b; summing 1/b over jobs counts batches, so this is the mean
    # per batch, not the job-weighted mean that overstates fill.
    sizes = [int(r["batch_size"]) for r in synthesized if int(r.get("batch_size", 0)) > 0]
    batches = sum(1.0 / size for size in sizes)
    mean_batch = len(sizes) / batches if batches else None
    errors: dict[str, dict[str, Any]] = {}
    for outcome in outcomes:
        if outcome.error is not None:
            kind = outcome.error.split(":", 1)[0]
            entry = errors.setdefault(kind, {"count": 0, "example": outcome.error})
            entry["count"] += 1
    per_job = [stages for o in ok if (stages := job_stages(o)) is not None]
    stage_figures = {}
    for name, label in STAGES:
        values = [stages[name] * 1000 for stages in per_job]
        if name == "send_delay" and plan.rate is None:
            continue
        figures = _distribution(values)
        stage_figures[name] = {"label": label, "mean_ms": figures["mean"], "p50_ms": figures["p50"],
                               "p95_ms": figures["p95"]}
    # What the queue itself costs a job: everything but the model's work and the batching policy's wait.
    own = _distribution(1000 * sum(v for k, v in stages.items() if k not in _NOT_QUEUE_OVERHEAD)
                        for stages in per_job)
    return {
        "ttsq_bench": REPORT_VERSION,
        "config": {"mode": plan.mode, "jobs": plan.jobs,
                   "loop": "closed" if plan.rate is None else "open",
                   "concurrency": plan.concurrency if plan.rate is None else None,
                   "rate_per_s": plan.rate, "warmup": plan.warmup, "format": plan.audio_format, "seed": plan.seed,
                   "max_batch": max_batch, **(config or {})},
        "jobs": {"sent": len(outcomes), "ok": len(ok), "errors": len(outcomes) - len(ok), "cached": len(cached),
                 "synthesized": len(synthesized)},
        "wall_s": wall_s,
        "throughput": {
            "jobs_per_s": len(ok) / wall_s if wall_s > 0 else None,
            "audio_s_per_s": audio_s / wall_s if wall_s > 0 else None,
            "audio_s": audio_s,
            # Wall time per second of audio delivered: below 1 is faster than real time.
            "real_time_factor": wall_s / audio_s if audio_s > 0 else None,
        },
        "latency_s": _distribution(o.latency_s for o in ok),
        "queue_wait_s": _distribution(float(t["queue_wait_s"]) for t in fresh_timings),
        "batch_wait_s": _distribution(float(t["batch_wait_s"]) for t in fresh_timings if "batch_wait_s" in t),
        "synthesis_s": _distribution(float(t["synthesis_s"]) for t in fresh_timings),
        "batch": {"mean_size": mean_batch, "batches": round(batches) if sizes else 0,
                  "max_size_seen": max(sizes, default=None),
                  "fill": mean_batch / max_batch if mean_batch is not None and max_batch else None},
        "cache_hit_ratio": len(cached) / len(results) if results else None,
        "stages_ms": stage_figures,
        "queue_overhead_ms": {"label": QUEUE_OVERHEAD_LABEL, "mean_ms": own["mean"], "p50_ms": own["p50"],
                              "p95_ms": own["p95"]},
        "stage_jobs": len(per_job),
        "errors": errors,
    }


def _fmt(value: Any, unit: str = "", digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}{unit}"
    return f"{value}{unit}"


def format_report(data: Mapping[str, Any]) -> str:
    """The report as an aligned text table."""
    config, jobs, throughput, batch = data["config"], data["jobs"], data["throughput"], data["batch"]
    loop = (f"closed loop, concurrency {config['concurrency']}" if config["loop"] == "closed"
            else f"open loop, Poisson arrivals at {config['rate_per_s']:g} jobs/s")
    lines = [f"ttsq bench: {config['mode']}, {config['jobs']} jobs, {loop}"]
    if config.get("target"):
        lines.append(f"target: {config['target']}")
    rows: list[tuple[str, str]] = [
        ("jobs ok / errors", f"{jobs['ok']} / {jobs['errors']}"),
        ("wall time", _fmt(data["wall_s"], " s", 2)),
        ("jobs/s", _fmt(throughput["jobs_per_s"], "", 2)),
        ("audio seconds per second", _fmt(throughput["audio_s_per_s"], "", 2)),
        ("real-time factor (wall / audio)", _fmt(throughput["real_time_factor"], "", 4)),
        ("mean batch size (fill)", _fmt(batch["mean_size"], "", 2)
         + (f" ({batch['fill']:.0%} of {config['max_batch']})" if batch["fill"] is not None else "")),
        ("cache hit ratio", _fmt(data["cache_hit_ratio"], "", 3)),
    ]
    width = max(len(name) for name, _ in rows)
    lines += [f"  {name:<{width}}  {value}" for name, value in rows]
    lines.append("")
    lines.append(f"  {'seconds':<22}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}")
    for key, name in (("latency_s", "end-to-end latency"), ("queue_wait_s", "queue wait"),
                      ("batch_wait_s", "batch wait"), ("synthesis_s", "synthesis (batch)")):
        dist = data[key]
        lines.append(f"  {name:<22}" + "".join(f"{_fmt(dist[p], '', 3):>9}" for p in ("p50", "p95", "p99", "max")))
    if data["stage_jobs"]:
        lines.append("")
        lines.append(f"  {'where a job spends its time (ms)':<48}{'mean':>9}{'p50':>9}{'p95':>9}")
        total = 0.0
        for stage in data["stages_ms"].values():
            total += stage["mean_ms"] or 0.0
            lines.append(f"  {stage['label']:<48}" + "".join(
                f"{_fmt(stage[p], '', 2):>9}" for p in ("mean_ms", "p50_ms", "p95_ms")))
        lines.append(f"  {'total (mean end-to-end latency)':<48}{total:>9.2f}")
        own = data["queue_overhead_ms"]
        lines.append(f"  {own['label']:<48}" + "".join(
            f"{_fmt(own[p], '', 2):>9}" for p in ("mean_ms", "p50_ms", "p95_ms")))
    for kind, entry in data["errors"].items():
        lines.append(f"  error {kind} x{entry['count']}: {entry['example']}")
    return "\n".join(lines)


def check_corpus(corpus: Sequence[Sentence], plan: Plan, limits: Limits) -> None:
    """Refuse a corpus with a request the producer would refuse, before anything starts."""
    if not corpus:
        raise InvalidRequest("corpus", "is empty")
    for number, sentence in enumerate(corpus, 1):
        try:
            SynthesisRequest.from_dict(_fields(sentence, sentence.text, plan.audio_format), limits)
        except InvalidRequest as exc:
            raise InvalidRequest("corpus", f"entry {number}: {exc}") from None


def measure(settings: Settings, plan: Plan, corpus: Sequence[Sentence], *, embedded: bool = False,
            temporary_storage: bool = False, corpus_name: str = "built-in",
            progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run ``plan`` against the deployment ``settings`` point at, or an embedded one; return the report.

    ``temporary_storage`` (embedded only) keeps the audio in a folder removed afterwards.
    """
    import tempfile
    from contextlib import ExitStack

    from ttsq.cache import redact_url
    from ttsq.client import Client

    check_corpus(corpus, plan, Limits.from_settings(settings))
    with ExitStack() as stack:
        if embedded:
            from ttsq.embedded import Embedded

            if temporary_storage:
                folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="ttsq-bench-"))
                settings = settings.replace(storage_url=folder)
            # Quiet worker: the bench prints its own figures, per-job log lines would only cost time.
            deployment = stack.enter_context(Embedded(settings.replace(log_level="WARNING")))
            settings, app = deployment.settings, deployment.app
            target = (f"embedded: private Redis, in-process {settings.engine} worker "
                      f"(max batch {settings.max_batch}, max wait {settings.max_wait_ms} ms), "
                      f"storage {'temporary folder' if temporary_storage else settings.storage_url}")
        else:
            target = f"broker {redact_url(settings.broker_url)}, queue {settings.queue}, engine {settings.engine}"
            app = None
        client = Client(settings, app=app)
        stack.callback(client.close)
        if not embedded and not client.identities():
            logger.warning("no worker of queue %s has announced itself on this cache: jobs may wait for one",
                           settings.queue)
        outcomes, wall = run(ClientTarget(client), corpus, plan, progress=progress)
        languages = sorted({s.language for s in corpus})
        return report(outcomes, wall, plan, max_batch=settings.max_batch if embedded else None,
                      config={"target": target, "corpus": f"{corpus_name}: {len(corpus)} sentences, "
                                                          f"languages {', '.join(languages)}"})
