"""Long documents end to end: real Redis, moto S3, real ``ttsq worker`` processes, espeak.

A document fans out into ordinary chunk jobs and a stitch job (a Celery chord that replaces the
document task); these tests check the stitched file against its chunks, resume after a worker is
killed, progress while it runs, and sharing with ordinary submits. Waits are generous bounds,
never timings.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
import soundfile as sf
from document_corpus import corpus
from support import Flower, WorkerProcess, published_states, run_cli, wait_until

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import DOCUMENT_TASK_NAME, TASK_NAME
from ttsq.document import Document, Options
from ttsq.engines.base import EngineIdentity
from ttsq.errors import InvalidRequest
from ttsq.job import Limits, SynthesisRequest
from ttsq.keys import content_key
from ttsq.records.owner import RedisOwner
from ttsq.records.plans import chunk_task_ids
from ttsq.splitter import normalize

StartWorker = Callable[..., WorkerProcess]
TESTS = Path(__file__).parent


def synthesized_keys(worker: WorkerProcess) -> list[str]:
    """Key prefixes of the chunks a worker synthesized (not answered from the cache), from its log."""
    return re.findall(r"job \S+: synthesized ([0-9a-f]{12}) in batch", worker.log())


@pytest.mark.slow
def test_a_20000_character_multilingual_document_becomes_one_file(
    settings: Settings, start_worker: StartWorker
) -> None:
    text = corpus(20_000)
    assert len(text) >= 20_000
    worker = start_worker(settings)
    with Client(settings) as client:
        job = client.submit_document(text, format="flac")
        result = job.wait(timeout=240)
        assert result["format"] == "flac" and not result["cached"] and job.id is not None
        chunks = result["chunks"]  # type: ignore[typeddict-item]
        assert result["document"]["chunks"] == len(chunks) >= 50  # type: ignore[typeddict-item]

        # The file is exactly its chunks joined: minus each crossfade, plus each pause.
        cache = RedisOwner(settings, role="test").cache_index
        entries = [cache.get(chunk["key"]) for chunk in chunks]
        assert all(entry is not None and entry["format"] == "wav" for entry in entries)
        rate = result["sample_rate"]
        pauses = {"sentence": settings.doc_sentence_pause_ms, "paragraph": settings.doc_paragraph_pause_ms}
        expected_samples = 0
        for index, (chunk, entry) in enumerate(zip(chunks, entries, strict=True)):
            assert entry is not None
            expected_samples += round(entry["duration_s"] * rate)
            if index < len(chunks) - 1:
                expected_samples += round(pauses.get(chunk["boundary"], 0) * rate / 1000)
                if chunk["boundary"] == "split":
                    expected_samples -= round(settings.doc_crossfade_ms * rate / 1000)
        info = sf.info(io.BytesIO(client.download(result)))
        assert info.samplerate == rate
        assert abs(info.frames - expected_samples) <= len(chunks)  # chunk durations are rounded to 0.1 ms
        assert abs(result["duration_s"] - info.duration) < 0.01

        # Chunk boundaries: contiguous in the text, increasing in time, inside the file.
        normalized = normalize(text)
        assert chunks[0]["start_char"] == 0 and chunks[-1]["end_char"] == len(normalized)
        assert {chunk["boundary"] for chunk in chunks} == {"split", "sentence", "paragraph", "end"}
        for before, after in itertools.pairwise(chunks):
            assert before["end_char"] == after["start_char"]
            assert before["start_s"] < before["end_s"] and after["start_s"] < after["end_s"]
            gap = after["start_s"] - before["end_s"]
            if before["boundary"] == "split":  # the two overlap by the crossfade
                assert gap == pytest.approx(-settings.doc_crossfade_ms / 1000, abs=0.001)
            else:
                assert gap == pytest.approx(pauses[before["boundary"]] / 1000, abs=0.001)
        assert chunks[-1]["end_s"] == pytest.approx(info.duration, abs=0.01)
        for chunk in chunks:
            sentences = chunk["sentences"]
            assert sentences[0]["start_s"] == chunk["start_s"] and sentences[-1]["end_s"] == chunk["end_s"]
            assert all(chunk["start_char"] <= s["start_char"] < s["end_char"] <= chunk["end_char"] for s in sentences)

        # Every chunk is an ordinary job: its key is the one a plain submit of its text would get.
        identity = client.identities()["voice_design"]
        seed = result["document"]["seed"]  # type: ignore[typeddict-item]
        document = Document.parse(
            {"text": text},
            limits=Limits(),
            max_document_chars=len(text),
            default_options=Options.from_settings(settings),
        )
        assert seed == document.seed(identity)  # no seed given: derived from the document, the same every time
        for chunk in chunks[:10]:
            piece = normalized[chunk["start_char"] : chunk["end_char"]].strip()
            assert chunk["key"] == content_key(SynthesisRequest.from_dict({"text": piece, "seed": seed}), identity)

        # Submitting it again is a cache hit: no job at all.
        again = client.submit_document(text, format="flac")
        assert again.id is None and again.result is not None and again.result["cached"]
        assert again.result["key"] == result["key"]
        assert again.result["chunks"] == chunks  # type: ignore[typeddict-item]
        assert client.status(job.id)["state"] == "SUCCESS"
    # The worker does not keep listening for the results of the chunk and stitch jobs it sent (only
    # those: the Redis is shared, and another test's client may listen for its own jobs meanwhile).
    results = redis.Redis.from_url(settings.result_backend)
    sent_ids = [job.id, *chunk_task_ids(job.id, len(chunks))]  # the stitch runs under the document's id

    def listened() -> set[bytes]:
        ours = {f"celery-task-meta-{i}".encode() for i in sent_ids}
        return set(results.pubsub_channels("celery-task-meta-*")) & ours

    subscribed = listened()
    wait_until(
        lambda: not listened(),
        30,
        f"no result subscriptions left (there were {subscribed}, document {job.id}; the worker's log ends: "
        f"{worker.log()[-3000:]})",
    )
    log = worker.log()
    assert "document" in log and "stitched" in log
    assert "old mill" not in log and "渔夫" not in log and "Signature" not in log  # no text, no signed URL


def test_chunks_are_shared_with_ordinary_submits(settings: Settings, start_worker: StartWorker) -> None:
    worker = start_worker(settings)
    text = (
        "First sentence of the shared test. Second sentence of the shared test. Third sentence here. "
        "Fourth and last sentence."
    )
    with Client(settings) as client:
        # One chunk per sentence; the first two were already made by ordinary submits of the same text.
        ordinary = [
            client.submit(piece, seed=7).wait(timeout=60)
            for piece in ("First sentence of the shared test.", "Second sentence of the shared test.")
        ]
        assert len(synthesized_keys(worker)) == 2
        client.settings = settings.replace(doc_target_chars=1)
        document = client.submit_document(text, seed=7).wait(timeout=60)
    chunks = document["chunks"]  # type: ignore[typeddict-item]
    assert len(chunks) == 4
    assert [chunk["key"] for chunk in chunks[:2]] == [result["key"] for result in ordinary]
    assert [chunk["cached"] for chunk in chunks] == [True, True, False, False]
    assert document["document"]["cached_chunks"] == 2  # type: ignore[typeddict-item]
    made = synthesized_keys(worker)
    assert len(made) == 4 and {key[:12] for key in (c["key"] for c in chunks[2:])} == set(made[2:])


@pytest.mark.slow
def test_kill_the_worker_halfway_only_missing_chunks_are_redone(
    settings: Settings,
    start_worker: StartWorker,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    # Slow chunks, one at a time, and a visibility timeout short enough to see redelivery in a test.
    slow = settings.replace(
        engine=faulty_engine,
        max_batch=1,
        visibility_timeout_s=25,
        job_timeout_s=12,
        storage_attempts=1,
        storage_timeout_s=2,
        doc_target_chars=1,
    )
    text = " ".join(f"[slow] Sentence number {n} of the resume test." for n in range(10))
    w1 = start_worker(slow, name="w1")
    client = Client(slow)
    job = client.submit_document(text)
    wait_until(lambda: len(synthesized_keys(w1)) >= 3, 60, "three chunks done")
    assert w1.process is not None
    w1.process.send_signal(signal.SIGKILL)
    w1.process.wait(10)
    before = synthesized_keys(w1)
    assert 3 <= len(before) < 10

    # After restart and re-submit: the re-submit joins the same document, nothing done is redone.
    w2 = start_worker(slow, name="w2")
    again = client.submit_document(text)
    assert again.id == job.id and again.joined
    result = again.wait(timeout=180)
    after = synthesized_keys(w2)
    keys = [chunk["key"][:12] for chunk in result["chunks"]]  # type: ignore[typeddict-item]
    assert len(keys) == 10
    assert not set(before) & set(after), "a chunk finished before the kill was synthesized again"
    assert sorted(before + after) == sorted(keys)  # every chunk synthesized exactly once
    client.close()


def test_a_failed_document_resubmitted_makes_only_the_missing_chunks(
    settings: Settings,
    start_worker: StartWorker,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    faulty_engine: str,
) -> None:
    fault = tmp_path / "device-fault"
    fault.touch()
    monkeypatch.setenv("FAULTY_ENGINE_FLAKY", str(fault))
    flaky = settings.replace(engine=faulty_engine, doc_target_chars=1)
    worker = start_worker(flaky)
    text = "A short sentence to begin. Another short one follows. And a [flaky] one at the end."
    with Client(flaky) as client:
        failed = client.submit_document(text)
        with pytest.raises(Exception, match="flaky device fault"):
            failed.wait(timeout=60)
        assert client.status(failed.id or "")["state"] == "FAILURE"
        assert len(synthesized_keys(worker)) == 2  # the two good chunks are stored
        fault.unlink()  # the device recovers
        again = client.submit_document(text)
        assert again.id != failed.id  # a failed document is not joined: it starts again
        result = again.wait(timeout=60)
    assert [chunk["cached"] for chunk in result["chunks"]] == [True, True, False]  # type: ignore[typeddict-item]
    assert len(synthesized_keys(worker)) == 3  # only the missing chunk was synthesized


@pytest.mark.slow
def test_status_shows_progress_rising_while_a_document_runs(
    settings: Settings,
    start_worker: StartWorker,
    monkeypatch: pytest.MonkeyPatch,
    faulty_engine: str,
) -> None:
    slow = settings.replace(engine=faulty_engine, max_batch=1, doc_target_chars=1)
    start_worker(slow)
    text = " ".join(f"[slow] Progress sentence number {n}." for n in range(6))
    with Client(slow) as client:
        job = client.submit_document(text)
        assert job.id is not None
        seen: list[int] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            out = run_cli("status", job.id, "--json", settings=slow)
            assert out.returncode == 0, out.stderr
            info = json.loads(out.stdout)
            if info["state"] == "PROGRESS":
                progress = info["progress"]
                assert progress["chunks_total"] == 6
                if not seen or progress["chunks_done"] != seen[-1]:
                    seen.append(progress["chunks_done"])
                if len(seen) == 2:  # what a person sees
                    plain = run_cli("status", job.id, settings=slow).stdout.decode()
                    assert re.fullmatch(
                        r"(PROGRESS \d/6 chunks, [\d.]+ s of audio(, stitching)?|SUCCESS .*)\n", plain
                    ), plain
            if info["state"] == "SUCCESS":
                break
            time.sleep(0.2)
        assert info["state"] == "SUCCESS"
        assert len(seen) >= 2 and seen == sorted(seen) and seen[-1] > seen[0], seen
        done = run_cli("status", job.id, settings=slow)
        assert done.returncode == 0 and "SUCCESS" in done.stdout.decode() and "6 chunks" in done.stdout.decode()


def test_bad_documents_are_refused_at_the_edge_and_nothing_is_queued(settings: Settings) -> None:
    from support import queue_length

    with Client(settings.replace(max_document_chars=100)) as client:
        for text, fields, field in (
            ("", {}, "text"),
            ("   \n\n  ", {}, "text"),
            ("a\x00b", {}, "text"),
            ("x. " * 60, {}, "text"),
            ("Hello.", {"language": "klingon"}, "language"),
            ("Hello.", {"deadline": time.time() + 60}, "deadline"),
            ("Hello.", {"speed": 2}, "speed"),
        ):
            with pytest.raises(InvalidRequest) as info:
                client.submit_document(text, **fields)
            assert info.value.field.startswith(field), (text, info.value)
    assert queue_length(settings) == 0


def test_a_raw_document_message_from_a_backend_without_ttsq(settings: Settings, start_worker: StartWorker) -> None:
    from celery import Celery

    start_worker(settings)
    app = Celery(broker=settings.broker_url, backend=settings.result_backend)
    result = app.send_task(
        DOCUMENT_TASK_NAME,
        kwargs={"text": "One. Two sentences.\n\nA paragraph.", "format": "mp3"},
        queue=settings.queue,
    )
    value = result.get(timeout=60)
    assert value["format"] == "mp3" and len(value["chunks"]) >= 2 and "text" not in value
    bad = app.send_task(DOCUMENT_TASK_NAME, kwargs={"text": "Hello.", "mode": "karaoke"}, queue=settings.queue)
    with pytest.raises(Exception, match="mode"):
        bad.get(timeout=60)
    app.close()


@pytest.mark.slow
def test_cli_document_with_a_progress_bar_and_an_output_file(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    chapter = tmp_path / "chapter.txt"
    chapter.write_text(corpus(1500), encoding="utf-8")
    audio = tmp_path / "chapter.ogg"
    out = run_cli("submit", "-f", str(chapter), "--wait", "-o", str(audio), settings=settings)
    assert out.returncode == 0, out.stderr
    assert "chunks" in out.stderr.decode()  # the progress bar (stderr: stdout stays one line)
    line = out.stdout.decode().strip()
    assert line.startswith(f"wrote {audio}:") and "chunks (0 from the cache), synthesized" in line
    assert sf.info(str(audio)).format == "OGG" and sf.info(str(audio)).duration > 30
    again = run_cli("submit", "-f", str(chapter), "--json", settings=settings)
    result = json.loads(again.stdout)
    assert again.returncode == 0 and not result["cached"] and result["format"] == "wav"  # another file...
    assert result["document"]["cached_chunks"] == result["document"]["chunks"]  # ...from the same chunks


@pytest.mark.slow
def test_cli_each_line_submits_one_job_per_line_with_a_summary(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    with Client(settings) as client:
        client.submit("Line two is already cached.").wait(timeout=60)
    lines = tmp_path / "lines.txt"
    lines.write_text(
        "Line one is new.\nLine two is already cached.\n\n" + "x" * 80 + "\nLine five is new too.\n", encoding="utf-8"
    )
    strict = settings.replace(max_text_chars=60)  # the producer refuses line 4 at the edge
    out = run_cli("submit", "-f", str(lines), "--each-line", "--json", settings=strict)
    assert out.returncode == 1, out.stderr  # one line failed
    records = [json.loads(line) for line in out.stdout.decode().splitlines()]
    assert [(r["line"], r["state"]) for r in records] == [(1, "done"), (2, "cached"), (4, "failed"), (5, "done")]
    assert records[2]["error"].startswith("invalid text:") and "url" in records[0] and "text" not in records[0]
    table = run_cli("submit", "-f", str(lines), "--each-line", settings=strict)
    rows = table.stdout.decode().splitlines()
    assert rows[0].split() == ["lines", "done", "cached", "failed"]
    assert rows[1].split() == ["4", "0", "3", "1"] and rows[2].startswith("line 4: invalid text")
    assert "lines" in table.stderr.decode()  # the progress bar
    queued = run_cli("submit", "-f", str(lines), "--each-line", "--no-wait", "--json", settings=strict)
    # Answered by the producer from the cache: nothing is queued for those lines.
    assert [json.loads(line)["state"] for line in queued.stdout.decode().splitlines()] == [
        "cached",
        "cached",
        "failed",
        "cached",
    ], queued.stderr
    # Line numbers are the file's: a Unicode line separator inside a line does not start another.
    odd = tmp_path / "odd.txt"
    odd.write_text("One line\u2028with a separator.\r\n" + "y" * 80 + "\r\n", encoding="utf-8")
    numbered = run_cli("submit", "-f", str(odd), "--each-line", "--no-wait", "--json", settings=strict)
    assert [(r["line"], r["state"]) for r in map(json.loads, numbered.stdout.decode().splitlines())] == [
        (1, "queued"),
        (2, "failed"),
    ], numbered.stderr


@pytest.mark.slow
def test_flower_shows_a_document_in_progress_then_done(
    settings: Settings,
    start_worker: StartWorker,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    faulty_engine: str,
) -> None:

    slow = settings.replace(engine=faulty_engine, max_batch=1, doc_target_chars=1)
    flower = Flower(slow, tmp_path / "flower.log")
    try:
        start_worker(slow)
        with Client(slow) as client:
            job = client.submit_document(" ".join(f"[slow] Flower sentence number {n}." for n in range(5)))
            states: list[tuple[str, str]] = []
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    info = json.loads(flower.get(f"/api/task/info/{job.id}"))
                except OSError:  # 404 until Flower has seen an event of it
                    time.sleep(0.2)
                    continue
                states.append((info["state"], str(info.get("result"))))
                # The first SUCCESS must show the stitched result: the last chunk's count, which runs
                # after the chord has sent the stitch, once reached Flower after it and replaced it.
                if info["state"] == "SUCCESS":
                    break
                time.sleep(0.2)
        progress = [result for state, result in states if state == "PROGRESS"]
        assert progress and re.fullmatch(r"\d/5 chunks, [\d.]+ s of audio", progress[0]), states
        assert states[-1][0] == "SUCCESS" and "<url>" in states[-1][1]  # the stitched result, URL redacted
    finally:
        flower.stop()


def test_chunks_fit_the_frame_cap_of_the_model_that_reads_them() -> None:
    # A model with a 100-frame cap (8 s) refuses text whose fast reading is longer: chunks stay under it.
    identity = EngineIdentity(engine="qwen", model="tiny", revision="r", sample_rate=24000, max_frames=100)
    text = "这是一个没有标点的很长很长的句子" * 20 + "。Short one. " + "word " * 200
    document = Document.parse({"text": text}, limits=Limits(), max_document_chars=10_000, identity=identity)
    assert Options().chunk_max(Limits(), identity) == 48
    assert len(document.chunks) > 10 and all(len(chunk.text) <= 48 for chunk in document.chunks)
    for request in document.requests(seed=1, limits=Limits()):
        identity.check(request)  # none refused
    # qwen-fast's prompt area is counted in UTF-8 bytes, beside the instruct: Hangul is 3 bytes a character.
    fast = EngineIdentity(
        engine="qwen-fast", model="tiny", revision="r", sample_rate=24000, max_frames=2048, max_prompt_bytes=992
    )
    korean = "가나다라마바사아자차카타파하" * 100 + "."
    document = Document.parse(
        {"text": korean, "instruct": "차분한 목소리"}, limits=Limits(), max_document_chars=10_000, identity=fast
    )
    assert len(document.chunks) > 4
    for request in document.requests(seed=1, limits=Limits()):
        fast.check(request)  # none refused
    with pytest.raises(InvalidRequest) as info:
        Document.parse({"text": "Hello.", "options": {"max_chars": 5}}, limits=Limits(), max_document_chars=100)
    assert info.value.field == "options.max_chars"


def test_the_document_benchmark_runs(tmp_path: Path) -> None:
    import subprocess
    import sys

    script = TESTS.parent / "benchmarks" / "document.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")}
    out = subprocess.run(
        [sys.executable, str(script), "--chars", "600", "--rounds", "1"],
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    lines = out.stdout.decode().splitlines()
    assert lines[0].startswith("document: ") and "baseline" in lines[1] and "overhead" in lines[2]
    assert "cache hit" in lines[3]


def test_cli_usage_errors_are_one_line_and_queue_nothing(settings: Settings, tmp_path: Path) -> None:
    from support import queue_length

    doc = tmp_path / "doc.txt"
    doc.write_text("Hello there.", encoding="utf-8")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9")
    for args, message in (
        (["submit", "text", "-f", str(doc)], "one of them"),
        (["submit", "--each-line", "text"], "--each-line reads the lines of -f FILE"),
        (["submit", "-f", str(doc), "--each-line", "-o", str(tmp_path / "x.wav")], "--output-dir"),
        (["submit", "-f", str(tmp_path / "missing.txt")], "does not exist"),
        (["submit", "-f", str(bad)], "invalid text: is not valid UTF-8"),
        (["submit", "-f", str(doc), "--deadline-s", "30"], "invalid deadline"),
    ):
        out = run_cli(*args, settings=settings)
        lines = out.stderr.decode().strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and message in lines[0], (args, out.stderr)
    assert queue_length(settings) == 0


def test_a_workers_app_never_listens_for_the_results_it_sends(settings: Settings) -> None:
    # Celery's Redis backend subscribes to the result of every task its process sends, and of every
    # header task of a group or chord, until it reads it (celery#3812). A worker sends chunks, stitches,
    # released and swept jobs and waits for none: each would stay subscribed for the life of the process.
    from celery import group

    from ttsq.app import make_app

    results = redis.Redis.from_url(settings.result_backend)
    worker_app = make_app(settings, worker=True)
    producer = make_app(settings)
    try:
        # Held: Celery stops listening for a result whose handle is garbage collected. From threads of
        # their own, as a worker's task threads send: Celery makes a backend per thread.
        sent: list[Any] = []
        for send in (
            lambda: worker_app.send_task(TASK_NAME, kwargs={}, task_id="sent-by-a-worker", queue=settings.queue),
            lambda: group(worker_app.signature(TASK_NAME, queue=settings.queue) for _ in range(3)).apply_async(),
        ):
            thread = threading.Thread(target=lambda send=send: sent.append(send()))
            thread.start()
            thread.join()
        assert len(sent) == 2
        # Only the channels of what this test sent: the Redis is shared with other tests' clients.
        ids = ["sent-by-a-worker", *(r.id for r in sent[1].results), "sent-by-a-producer"]

        def listened() -> list[bytes]:
            ours = {f"celery-task-meta-{i}".encode() for i in ids}
            return [c for c in results.pubsub_channels("celery-task-meta-*") if c in ours]

        assert listened() == []
        # A producer does listen: it waits for its jobs (the check above could not pass by accident).
        sent.append(producer.send_task(TASK_NAME, kwargs={}, task_id="sent-by-a-producer", queue=settings.queue))
        assert listened() == [b"celery-task-meta-sent-by-a-producer"]
    finally:
        worker_app.close()
        producer.backend.result_consumer.stop()
        producer.close()
        redis.Redis.from_url(settings.broker_url).delete(settings.queue)


@pytest.mark.slow
def test_progress_never_goes_backwards_when_chunks_finish_together(
    settings: Settings, start_worker: StartWorker
) -> None:
    # Chunks of one batch finish together on several task threads, each publishing the document's
    # progress: every PROGRESS the backend publishes must count at least as many chunks as the last.
    batched = settings.replace(max_batch=16, doc_target_chars=1)
    start_worker(batched)
    with published_states(settings) as messages, Client(batched) as client:
        job = client.submit_document(" ".join(f"Batch sentence {n}." for n in range(64)))
        job.wait(timeout=120)
    done = [
        m["result"]["chunks_done"]
        for m in messages  # type: ignore[index]
        if m.get("task_id") == job.id and m.get("status") == "PROGRESS"
    ]
    # Every chunk publishes its count, except those of the last batch whose count comes after the
    # stitch has finished: a finished document is never taken back (at most one batch of 16).
    assert len(done) >= 64 - 16 and done[-1] == 64, done
    assert done == sorted(done), done


def test_the_stitch_job_sends_no_signed_urls_in_its_events(settings: Settings, start_worker: StartWorker) -> None:
    # The stitch job's arguments are the chunk results, each with a signed URL: its task-sent event
    # (what Flower and `celery events` show) must carry a placeholder, not their repr.
    import threading

    from celery import Celery

    start_worker(settings)
    app = Celery(broker=settings.broker_url, backend=settings.result_backend)
    events: list[dict[str, object]] = []
    with app.connection() as connection:
        receiver = app.events.Receiver(connection, handlers={"*": events.append})
        thread = threading.Thread(target=lambda: receiver.capture(limit=None, timeout=None, wakeup=False), daemon=True)
        thread.start()
        wait_until(lambda: bool(events), 30, "a worker heartbeat: the receiver is listening")
        with Client(settings) as client:
            result = client.submit_document("One sentence here. Another sentence there.").wait(timeout=60)
        wait_until(
            lambda: any(e.get("type") == "task-sent" and e.get("name") == "ttsq.stitch" for e in events),
            30,
            "the stitch's task-sent",
        )
        sent = [event for event in events if event.get("type") == "task-sent"]
        receiver.should_stop = True
        thread.join(10)
    app.close()
    assert result["url"].startswith("http")
    stitch = [event for event in sent if event.get("name") == "ttsq.stitch"]
    assert stitch, sent
    assert all("http" not in str(event.get("args")) and "Signature" not in str(event) for event in stitch), stitch


def test_options_given_to_submit_document_are_the_ones_sent(settings: Settings, start_worker: StartWorker) -> None:
    # The producer validates and keys the document with the options it is given: the worker must
    # cut and key it with the same ones, not the producer's TTSQ_DOC_* defaults.
    start_worker(settings)
    with Client(settings) as client:
        job = client.submit_document("One. Two. Three. Four.", options={"target_chars": 1, "max_chars": 20})
        result = job.wait(timeout=60)
    assert len(result["chunks"]) == 4 and result["key"] == job.key  # type: ignore[typeddict-item]


@pytest.mark.slow
def test_embedded_documents_and_line_files_are_not_held_to_one_job_limit(tmp_path: Path) -> None:
    # --embedded validates before it starts anything; a document (or a file of lines) may be
    # longer than one job's TTSQ_MAX_TEXT_CHARS, and a bad line fails alone.
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("TTSQ_")} | {"TTSQ_MAX_TEXT_CHARS": "60"}
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(f"Embedded sentence number {n} of the document." for n in range(4)), encoding="utf-8")
    lines = tmp_path / "lines.txt"
    lines.write_text("A good first line.\n" + "x" * 80 + "\nA good third line.\n", encoding="utf-8")

    def submit(*args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [sys.executable, "-m", "ttsq.cli.main", "submit", *args, "--embedded", "--json"],
            env=env,
            capture_output=True,
            timeout=180,
            cwd=tmp_path,
        )

    out = submit("-f", str(doc))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["document"]["chunks"] == 4
    out = submit("-f", str(lines), "--each-line")
    assert out.returncode == 1, out.stderr  # the long line failed, alone
    assert [json.loads(line)["state"] for line in out.stdout.decode().splitlines()] == ["done", "failed", "done"]


def test_document_options_in_a_message_are_held_to_the_settings_ranges() -> None:
    # A raw message's pauses are silence the stitch holds in memory for every chunk: the same
    # 0..10000 ms a TTSQ_DOC_* setting may have, named by field, before anything is synthesized.
    for name in ("sentence_pause_ms", "paragraph_pause_ms", "crossfade_ms"):
        assert getattr(Options.from_dict({name: 10_000}), name) == 10_000
        with pytest.raises(InvalidRequest) as info:
            Options.from_dict({name: 10_001})
        assert info.value.field == f"options.{name}"
