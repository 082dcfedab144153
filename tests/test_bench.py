"""``ttsq bench``: real runs (embedded, and against a running worker); figures checked for structure and
consistency, never for speed."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import WorkerProcess, run_cli, s3_keys, wait_until

from ttsq.config import Settings
from ttsq.engines.espeak import EspeakEngine
from ttsq.errors import InvalidRequest
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key
from ttsq.ops import bench
from ttsq.records.owner import RedisOwner

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

StartWorker = Callable[..., WorkerProcess]


def table_value(table: str, name: str) -> str:
    """The value printed on the row that starts with ``name``."""
    row = next(line for line in table.splitlines() if line.strip().startswith(name))
    return row.strip()[len(name) :].split()[0]


def assert_consistent(data: dict[str, Any], *, jobs: int) -> None:
    """Figures that must agree with each other whatever the machine's speed."""
    assert data["ttsq_bench"] == 1
    assert data["jobs"]["sent"] == jobs and data["jobs"]["ok"] + data["jobs"]["errors"] == jobs
    ok, wall, throughput = data["jobs"]["ok"], data["wall_s"], data["throughput"]
    assert throughput["jobs_per_s"] == pytest.approx(ok / wall)
    assert throughput["audio_s_per_s"] == pytest.approx(throughput["audio_s"] / wall)
    assert throughput["real_time_factor"] == pytest.approx(wall / throughput["audio_s"])
    latency = data["latency_s"]
    assert 0 < latency["p50"] <= latency["p95"] <= latency["p99"] <= latency["max"]
    assert latency["max"] <= wall
    # The stages of a job add up to its latency, so their means add up to the mean latency.
    if data["stage_jobs"]:
        assert data["stage_jobs"] == ok
        total_ms = sum(stage["mean_ms"] for stage in data["stages_ms"].values())
        assert total_ms == pytest.approx(latency["mean"] * 1000, rel=1e-6)
        stages = data["stages_ms"]
        own = (
            total_ms
            - stages["synthesis"]["mean_ms"]
            - stages["batch_wait"]["mean_ms"]
            - stages.get("send_delay", {"mean_ms": 0.0})["mean_ms"]
        )
        assert data["queue_overhead_ms"]["mean_ms"] == pytest.approx(own, rel=1e-6)


def test_embedded_bench_prints_the_table_and_writes_the_same_json(tmp_path: Path) -> None:
    """25 jobs over a 21-sentence corpus: the repeated sentences still miss the cache (cache busting)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    # -X importtime lists every module imported: the bench must not pull in torch.
    out = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "ttsq.cli.main",
            "bench",
            "--embedded",
            "-n",
            "25",
            "-c",
            "4",
            "--json",
            "figures.json",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=300,
    )
    stderr = out.stderr.decode()
    assert out.returncode == 0, stderr[-3000:]
    assert not re.search(r"\|\s+torch(\.|$)", stderr, re.M)
    table = out.stdout.decode()
    data = json.loads((tmp_path / "figures.json").read_text())

    assert table.startswith("ttsq bench: synthesize, 25 jobs, closed loop, concurrency 4\n")
    assert_consistent(data, jobs=25)
    assert data["jobs"] == {"sent": 25, "ok": 25, "errors": 0, "cached": 0, "synthesized": 25}
    assert data["cache_hit_ratio"] == 0.0
    assert "korean" in data["config"]["corpus"] and "embedded" in data["config"]["target"]
    batch = data["batch"]
    assert data["config"]["max_batch"] == 8 and 1 <= batch["mean_size"] <= batch["max_size_seen"] <= 8
    assert batch["fill"] == pytest.approx(batch["mean_size"] / 8)
    assert data["stage_jobs"] == 25 and "send_delay" not in data["stages_ms"]  # closed loop

    # The table shows the JSON's figures.
    assert table_value(table, "jobs ok / errors") == "25"
    assert table_value(table, "jobs/s") == f"{data['throughput']['jobs_per_s']:.2f}"
    assert table_value(table, "audio seconds per second") == f"{data['throughput']['audio_s_per_s']:.2f}"
    assert table_value(table, "cache hit ratio") == "0.000"
    assert table_value(table, "mean batch size (fill)") == f"{batch['mean_size']:.2f}"
    latency_row = table_value(table, "end-to-end latency")
    assert latency_row == f"{data['latency_s']['p50']:.3f}"
    for stage in (*data["stages_ms"].values(), data["queue_overhead_ms"]):
        assert table_value(table, stage["label"]) == f"{stage['mean_ms']:.2f}"
    assert not (tmp_path / "ttsq-audio").exists()  # the embedded bench keeps its audio in a temporary folder


def test_open_loop_and_cache_hit_mode(tmp_path: Path) -> None:
    out = run_cli("bench", "--embedded", "-n", "10", "--rate", "50", "--json", "-", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    data = json.loads(out.stdout)
    assert_consistent(data, jobs=10)
    assert data["config"]["loop"] == "open" and data["config"]["rate_per_s"] == 50
    assert data["config"]["concurrency"] is None
    assert data["jobs"]["synthesized"] == 10
    assert "send_delay" in data["stages_ms"]

    out = run_cli("bench", "--embedded", "-n", "10", "-c", "2", "--mode", "cache-hit", "--json", "-", cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    data = json.loads(out.stdout)
    assert_consistent(data, jobs=10)
    assert data["jobs"] == {"sent": 10, "ok": 10, "errors": 0, "cached": 10, "synthesized": 0}
    assert data["cache_hit_ratio"] == 1.0
    assert data["batch"]["mean_size"] is None and data["synthesis_s"]["p50"] is None


def test_bench_against_a_running_worker(settings: Settings, start_worker: StartWorker, tmp_path: Path) -> None:
    """Not embedded: the producer's settings point at a deployment; every job is really synthesized
    and stored, and the batch sizes are the worker's own reports."""
    start_worker(settings)
    out = run_cli("bench", "-n", "12", "-c", "6", "--json", "figures.json", settings=settings, cwd=tmp_path)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    data = json.loads((tmp_path / "figures.json").read_text())
    assert_consistent(data, jobs=12)
    assert data["jobs"]["ok"] == 12 and data["cache_hit_ratio"] == 0.0
    assert settings.queue in data["config"]["target"]
    assert data["config"]["max_batch"] is None and data["batch"]["fill"] is None  # the producer cannot know it
    assert 1 <= data["batch"]["mean_size"] <= data["batch"]["max_size_seen"] <= settings.max_batch
    assert len(s3_keys(settings)) == 12  # twelve distinct audio files stored
    redis_owner = RedisOwner(settings, role="test")
    # What `ttsq stats` counts; a worker writes its counts once a second.
    wait_until(lambda: redis_owner.stats.window(5)["synthesized"] >= 12, 10, "twelve jobs counted")
    assert redis_owner.stats.window(5)["synthesized"] == 12
    redis_owner.close()


def test_bust_marker_changes_the_key_not_the_audio() -> None:
    markers = {bench.bust_marker("run", index) for index in range(2000)}
    assert len(markers) == 2000
    assert all(unicodedata.category(ch) == "Cf" for marker in markers for ch in marker)
    engine = EspeakEngine(Settings())
    engine.load()
    try:
        for sentence in (bench.CORPUS[0], bench.CORPUS[4]):  # English, Korean
            plain = SynthesisRequest.from_dict({"text": sentence.text, "language": sentence.language})
            marked = SynthesisRequest.from_dict(
                {"text": bench.bust_marker("run", 1) + sentence.text, "language": sentence.language}
            )
            assert marked.text.endswith(plain.text) and marked.text != plain.text  # normalization keeps it
            assert content_key(marked, engine.identity) != content_key(plain, engine.identity)
            a, b = engine.synthesize_batch([plain, marked])
            assert not isinstance(a, Exception) and not isinstance(b, Exception)
            assert abs(a.samples.size - b.samples.size) / a.sample_rate < 0.05  # the same speech
    finally:
        engine.close()


def test_corpus_file(tmp_path: Path) -> None:
    path = tmp_path / "corpus.txt"
    path.write_text(
        '# comment\n\nPlain line.\nko\t안녕하세요.\n{"text": "JSON line.", "language": "en", "format": "mp3"}\n',
        encoding="utf-8",
    )
    assert bench.load_corpus(path) == [
        bench.Sentence("Plain line."),
        bench.Sentence("안녕하세요.", "ko"),
        bench.Sentence("JSON line.", "en", fields={"format": "mp3"}),
    ]
    requests = bench.make_requests(bench.load_corpus(path), 3, mode="cache-hit", run_id="r", seed=0, audio_format="wav")
    assert sorted(r["text"] for r in requests) == ["JSON line.", "Plain line.", "안녕하세요."]
    assert next(r for r in requests if r["text"] == "JSON line.")["format"] == "mp3"

    path.write_text("fine\n{not json\n", encoding="utf-8")
    with pytest.raises(InvalidRequest, match="line 2"):
        bench.load_corpus(path)
    out = run_cli("bench", "--embedded", "--corpus", str(path))
    assert out.returncode == 2
    assert out.stderr.decode().startswith("ttsq: error: invalid corpus: line 2: not valid JSON")
    # A request the producer would refuse stops the bench before anything starts, naming the entry.
    path.write_text('fine\nko\thello\n{"text": "x", "temperature": 9}\n', encoding="utf-8")
    out = run_cli("bench", "--embedded", "--corpus", str(path))
    assert out.returncode == 2
    assert (
        out.stderr.decode().strip() == "ttsq: error: invalid corpus: entry 3: invalid temperature: 9 is out of "
        "range [0.01, 2.0]"
    )


def test_bench_usage_errors() -> None:
    out = run_cli("bench", "--embedded", "--concurrency", "2", "--rate", "5")
    assert out.returncode == 2 and len(out.stderr.decode().strip().splitlines()) == 1
    assert "exclude each other" in out.stderr.decode()
    out = run_cli("bench", "--embedded", "-n", "0")
    assert out.returncode == 2
    assert out.stderr.decode().strip() == "ttsq: error: invalid jobs: must be at least 1"


def test_report_counts_batches_not_jobs() -> None:
    """Jobs of one batch all report its size: two batches of 4 and 2 are 6 jobs, mean batch 3 (not 3.33)."""

    def outcome(index: int, size: int) -> bench.Outcome:
        result = {
            "duration_s": 1.0,
            "cached": False,
            "batch_size": size,
            "timings": {
                "queue_wait_s": 0.01,
                "batch_wait_s": 0.0,
                "synthesis_s": 0.1,
                "encode_s": 0.0,
                "upload_s": 0.0,
                "index_s": 0.0,
                "worker_s": 0.12,
            },
        }
        return bench.Outcome(index, 0.2, result=result, client={"client_validate_hash": 0.001, "client_publish": 0.002})

    outcomes = [outcome(i, 4) for i in range(4)] + [outcome(4 + i, 2) for i in range(2)]
    outcomes.append(bench.Outcome(6, 0.5, error="JobFailed: boom"))
    data = bench.report(outcomes, 2.0, bench.Plan(jobs=7), max_batch=4)
    assert data["batch"] == {"mean_size": 3.0, "batches": 2, "max_size_seen": 4, "fill": 0.75}
    assert data["jobs"] == {"sent": 7, "ok": 6, "errors": 1, "cached": 0, "synthesized": 6}
    assert data["errors"] == {"JobFailed": {"count": 1, "example": "JobFailed: boom"}}
    assert data["throughput"]["audio_s_per_s"] == 3.0
    stages = data["stages_ms"]
    assert stages["synthesis"]["mean_ms"] == pytest.approx(100)
    assert stages["worker_other"]["mean_ms"] == pytest.approx(20)
    assert stages["broker_round_trip"]["mean_ms"] == pytest.approx(200 - 1 - 2 - 120)
    assert "error JobFailed x1: JobFailed: boom" in bench.format_report(data)
