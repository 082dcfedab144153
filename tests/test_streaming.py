"""Streaming jobs through a real worker and Redis: the audio as it is made, through ``Client.stream``."""

from __future__ import annotations

import base64
import io
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from document_corpus import corpus
from support import WorkerProcess, run_cli, wait_until

from ttsq.app import make_app
from ttsq.audio import pcm16
from ttsq.client import AudioPiece, AudioStream, Client, Job
from ttsq.config import Settings
from ttsq.constants import STREAM_PREFIX
from ttsq.engines.base import EngineIdentity, EngineOutput
from ttsq.engines.espeak import EspeakEngine
from ttsq.errors import CorruptRecord, InvalidRequest, StreamBroken
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key
from ttsq.observer import Observer
from ttsq.records.owner import RedisOwner
from ttsq.records.streams import parse_entry
from ttsq.worker.streaming import PIECE_S, StreamWriter

StartWorker = Callable[..., WorkerProcess]
TEXT = "A streamed sentence arrives in pieces, and the pieces make the stored file."


def pcm_of(pieces: list[AudioPiece]) -> bytes:
    assert pieces and len({p.sample_rate for p in pieces}) == 1
    return b"".join(p.pcm for p in pieces)


def wav_pcm(data: bytes) -> tuple[bytes, int]:
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    return samples.astype("<i2").tobytes(), int(rate)


def test_a_stream_is_the_stored_file_and_a_cache_hit_streams_it_again(
    settings: Settings, start_worker: StartWorker
) -> None:
    start_worker(settings)
    client = Client(settings)
    stream = client.stream(TEXT, timeout=60)
    pieces = list(stream)
    assert stream.result is not None and stream.result["cached"] is False
    assert len(pieces) > 1  # several seconds of audio, half a second a piece
    stored, rate = wav_pcm(client.download(stream.result))
    assert pieces[0].sample_rate == rate
    assert pcm_of(pieces) == stored  # byte for byte: the stream is the file's own samples

    # The worker wrote the stream in order and closed it with the job's end.
    entries = RedisOwner(settings, role="test").streams.read(stream.job.id or "", block_s=0.1)
    assert entries[0].kind == "start" and entries[-1].kind == "end"
    assert [e.seq for e in entries if e.kind == "audio"] == list(range(len(pieces)))
    # A reader that reconnects after an entry gets only what follows it.
    later = RedisOwner(settings, role="test").streams.read(stream.job.id or "", after=entries[1].id, block_s=0.1)
    assert [e.id for e in later] == [e.id for e in entries[2:]]

    again = client.stream(TEXT, timeout=60)
    replay = list(again)
    assert again.job.cached and pcm_of(replay) == stored  # from storage, at once
    client.close()


def test_the_stream_field_is_checked_and_is_not_part_of_the_content_key() -> None:
    identity = EngineIdentity(engine="espeak", model="espeak-ng", revision="1", sample_rate=22050)
    plain = SynthesisRequest.from_dict({"text": TEXT})
    streamed = SynthesisRequest.from_dict({"text": TEXT, "stream": True})
    assert content_key(plain, identity) == content_key(streamed, identity)
    assert "stream" not in plain.to_dict() and streamed.to_dict()["stream"] is True
    for bad in ("yes", 1, None, [True]):
        with pytest.raises(InvalidRequest, match="stream"):
            SynthesisRequest.from_dict({"text": TEXT, "stream": bad})


def test_stream_entries_read_back_are_checked() -> None:
    pcm = base64.b64encode(b"\x01\x00").decode()
    assert parse_entry("1-0", {"kind": "audio", "seq": "3", "pcm": pcm}).pcm == b"\x01\x00"  # as workers wrote it
    raw = {b"kind": b"audio", b"seq": b"3", b"raw": b"\xff\x00", b"run": b"r1"}  # as read, not decoded
    entry = parse_entry(b"1-0", raw)
    assert (entry.id, entry.pcm, entry.seq, entry.run) == ("1-0", b"\xff\x00", 3, "r1")
    fields: dict[str, str] | dict[bytes, bytes]
    for fields in (
        {b"kind": b"audio", b"seq": b"3", b"raw": b"\xff"},  # half a sample
        {"kind": "audio", "seq": "3", "raw": "\ufffd\x00"},  # read as text: its bytes are lost
        {"kind": "audio", "seq": "3", "pcm": "not base64!"},
        {"kind": "audio", "seq": "x", "pcm": pcm},
        {"kind": "audio", "pcm": pcm},
        {"kind": "start"},
        {"kind": "end", "payload": "[1]"},
        {"kind": "end", "payload": "{"},
        {"kind": "surprise"},
        {},
    ):
        with pytest.raises(CorruptRecord):
            parse_entry("1-0", fields)


def test_a_clip_written_at_once_reaches_a_reader_that_keeps_up_and_its_end_keeps_one_window(
    settings: Settings,
) -> None:
    """An engine that does not stream hands over its whole clip at once: the writer sends a window of
    it per round trip, and no round trip trims its own pieces or the ones before (a reader blocked on
    the stream wakes at the first and reads the rest after it), so a clip of two windows is all there to
    read; the end trims what lies more than a window before the clip's end."""
    rate, window_s = 24_000, 4
    owner = RedisOwner(settings.replace(stream_window_s=window_s), role="test")
    task_id = f"whole-{uuid.uuid4().hex}"
    clip = (np.sin(np.arange(7 * rate) / 20) * 0.3).astype(np.float32)
    writer = StreamWriter(owner.streams, task_id, sample_rate=rate, observer=Observer(), sent_at=None)
    writer.finish(EngineOutput(samples=clip, sample_rate=rate))
    entries = owner.streams.read(task_id, block_s=0.1)
    audio = [entry for entry in entries if entry.kind == "audio"]
    assert entries[0].kind == "start" and [entry.seq for entry in audio] == list(range(len(audio)))
    assert b"".join(entry.pcm for entry in audio) == pcm16(clip)  # all of it, from its first piece
    owner.streams.end(task_id, {"duration_s": 7.0}, keep_from=writer.end_trim())
    kept = owner.streams.read(task_id, block_s=0.1)
    tail = [entry for entry in kept if entry.kind == "audio"]
    assert kept[-1].kind == "end" and kept[0].kind == "audio" and tail[0].seq > 0
    assert sum(len(entry.pcm) for entry in tail) <= (window_s + PIECE_S) * rate * 2  # a window and a piece
    assert b"".join(entry.pcm for entry in tail) == pcm16(clip)[-sum(len(entry.pcm) for entry in tail) :]
    owner.close()


def test_espeak_hands_a_streaming_row_its_audio_as_it_speaks(tmp_path: Path) -> None:
    engine = EspeakEngine(Settings(storage_url=str(tmp_path)))
    engine.load()
    try:
        for fields in ({}, {"max_new_tokens": 20}):  # and a capped row: only what it keeps is handed over
            got: list[np.ndarray] = []
            request = SynthesisRequest.from_dict({"text": TEXT + " " + TEXT, **fields})
            [output] = engine.synthesize_batch([request], pieces=[got.append])
            assert not isinstance(output, Exception)
            assert len(got) > 1  # espeak's callback hands its audio over clause by clause
            assert np.array_equal(np.concatenate(got), output.samples)
            assert output.truncated == bool(fields)
        [plain] = engine.synthesize_batch([SynthesisRequest.from_dict({"text": TEXT})])
        assert not isinstance(plain, Exception) and plain.samples.size > 0
    finally:
        engine.close()


def test_ttsq_submit_stream_writes_wav_as_it_comes(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    piped = run_cli("submit", "--stream", TEXT, settings=settings, timeout=90)
    assert piped.returncode == 0, piped.stderr
    header, pcm = piped.stdout[:44], piped.stdout[44:]
    # A stream's header: the sizes say "until the data ends", as players reading a pipe expect.
    assert header[:4] == b"RIFF" and header[4:8] == b"\xff\xff\xff\xff" and header[36:44] == b"data\xff\xff\xff\xff"
    client = Client(settings)
    stored = client.submit(TEXT)
    assert stored.cached and stored.result is not None
    expected, rate = wav_pcm(client.download(stored.result))
    assert pcm == expected and int.from_bytes(header[24:28], "little") == rate
    assert b"synthesized" in piped.stderr and stored.result["key"][:12].encode() in piped.stderr

    # To a file: a complete WAV once it is done (its sizes set), the samples of the stored file.
    out = tmp_path / "streamed.wav"
    written = run_cli("submit", "--stream", TEXT, "-o", str(out), settings=settings, timeout=90)
    assert written.returncode == 0, written.stderr
    assert out.read_bytes() == client.download(stored.result)  # byte for byte the stored WAV
    for refused in (
        ["-f", str(out), "--each-line"],
        ["--format", "mp3"],
        ["-o", str(tmp_path / "x.mp3")],
        ["--no-wait"],
    ):
        bad = run_cli("submit", "--stream", *(["x"] if refused[0] != "-f" else []), *refused, settings=settings)
        assert bad.returncode == 2 and b"--stream" in bad.stderr, (refused, bad.stderr)
    client.close()


def test_a_job_that_fails_at_the_worker_ends_its_stream_with_its_error(
    settings: Settings, start_worker: StartWorker
) -> None:
    start_worker(settings)
    client = Client(settings)
    # A raw producer's job the espeak worker cannot serve (no speakers): refused at the worker.
    task_id = (
        make_app(settings)
        .send_task(
            "ttsq.synthesize",
            kwargs={"text": TEXT, "stream": True, "mode": "custom_voice", "speaker": "vivian"},
            queue=settings.queue,
        )
        .id
    )
    stream = AudioStream(client, Job(id=task_id, key=None, client=client), timeout=60)
    with pytest.raises(InvalidRequest):
        list(stream)
    entries = RedisOwner(settings, role="test").streams.read(task_id, block_s=0.1)
    assert [e.kind for e in entries] == ["error"] and entries[0].payload is not None
    assert entries[0].payload["type"] == "InvalidRequest" and TEXT not in entries[0].payload["message"]
    client.close()


def test_a_reader_that_played_a_first_take_does_not_get_a_second_one_spliced_on(settings: Settings) -> None:
    """What a reader sees when a job is run again after it played part of the first run: an error."""
    streams = RedisOwner(settings, role="test").streams
    client = Client(settings)
    task_id = "stream-test-" + uuid.uuid4().hex
    streams.start(task_id, sample_rate=22050, run="first")
    streams.audio(task_id, 0, b"\x01\x00" * 100)
    streams.start(task_id, sample_rate=22050, run="second")  # the rerun, after its worker died
    streams.audio(task_id, 0, b"\x02\x00" * 100)
    played = []
    with pytest.raises(StreamBroken, match="run again"):
        for piece in AudioStream(client, Job(id=task_id, key=None, client=client), timeout=10):
            played.append(piece.pcm)
    assert played == [b"\x01\x00" * 100]  # the first take's piece, and nothing of the second
    # A missing piece is as broken as a second take.
    gap = "stream-test-" + uuid.uuid4().hex
    streams.start(gap, sample_rate=22050, run="only")
    streams.audio(gap, 1, b"\x01\x00")
    with pytest.raises(StreamBroken, match="missing"):
        list(AudioStream(client, Job(id=gap, key=None, client=client), timeout=10))
    client.close()


@pytest.mark.slow
def test_a_worker_killed_mid_stream_breaks_the_stream_and_the_job_still_completes(
    settings: Settings,
    start_worker: StartWorker,
    faulty_engine: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    once = tmp_path / "crash-once"
    once.touch()
    monkeypatch.setenv("FAULTY_ENGINE_ONCE", str(once))
    faulty = settings.replace(engine=faulty_engine)
    first = start_worker(faulty, name="first")
    client = Client(faulty)
    text = "[crash-after-audio] " + TEXT
    stream = client.stream(text, timeout=120)
    played = []
    with pytest.raises(StreamBroken):
        for piece in stream:
            played.append(piece)
            if len(played) == 1:
                start_worker(faulty, name="second")  # takes the job over once the first dies
    assert played  # the first take began to play, then broke off: not a short clip that looks complete
    assert first.process is not None and first.process.wait(timeout=60) == -9
    result = client.wait(stream.job.id or "", timeout=120)  # redelivered, run again, stored
    assert result["cached"] is False
    assert client.submit(text).cached
    client.close()


@pytest.mark.slow
def test_a_document_streams_chunk_by_chunk_and_plays_the_stored_file(
    settings: Settings, start_worker: StartWorker, tmp_path: Path
) -> None:
    start_worker(settings)
    client = Client(settings)
    owner = RedisOwner(settings, role="test")
    text = corpus(6000)
    stream = client.stream_document(text, timeout=600)
    pieces = iter(stream)
    first = next(pieces)
    # The first chunk plays while later ones are still being made: the last is not stored yet.
    plan = owner.plans.load(stream.job.id or "")
    last = [chunk["key"] for chunk in plan["chunks"] if chunk["key"]][-1]
    assert len(plan["chunks"]) > 10 and owner.cache_index.get(last) is None
    played = first.pcm + b"".join(piece.pcm for piece in pieces)
    assert stream.result is not None and stream.result["document"]["chunks"] == len(plan["chunks"])
    stored, rate = wav_pcm(client.download(stream.result))
    assert first.sample_rate == rate and played == stored  # the stitched file, byte for byte

    # Streamed again: a cache hit plays the stored file; and the command line writes it as it comes.
    assert b"".join(p.pcm for p in client.stream_document(text, timeout=60)) == stored
    source, out = tmp_path / "doc.txt", tmp_path / "doc.wav"
    source.write_text(text)
    done = run_cli("submit", "--stream", "-f", str(source), "-o", str(out), settings=settings, timeout=120)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == client.download(stream.result)
    client.close()


def test_an_identical_request_joins_the_running_stream_from_its_first_piece(
    settings: Settings, start_worker: StartWorker, faulty_engine: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hold = tmp_path / "hold"
    hold.touch()  # the engine holds the job until both requests are in: the second finds it running
    monkeypatch.setenv("FAULTY_ENGINE_HOLD", str(hold))
    faulty = settings.replace(engine=faulty_engine)
    start_worker(faulty)
    client = Client(faulty)
    text = "[held] " + TEXT
    try:
        first = client.stream(text, timeout=60)
        second = client.stream(text, timeout=60)
    finally:
        hold.unlink()
    assert second.job.joined and second.job.id == first.job.id
    heard = [b"".join(piece.pcm for piece in stream) for stream in (second, first)]
    assert heard[0] == heard[1] and heard[0]
    assert first.result is not None and second.result is not None
    assert first.result["key"] == second.result["key"]
    client.close()


# -- what a stream holds: a window, then nothing a short grace after its end ------------------------


def long_text(n: int, chars: int = 700) -> str:
    """About ``chars`` characters of English for espeak (700: about 42 s of audio), distinct by ``n``."""
    words = f"Stream {n} reads a long passage about rivers, mills and the weather over the hills, sentence by sentence."
    return " ".join([words] * (chars // len(words) + 1))


def test_readers_late_behind_or_back_after_the_grace_play_the_stored_file_from_where_they_were(
    settings: Settings, start_worker: StartWorker
) -> None:
    windowed = settings.replace(stream_window_s=1, stream_grace_s=2)
    start_worker(windowed)
    client = Client(windowed)
    owner = RedisOwner(windowed, role="test")
    live = client.stream(long_text(1), timeout=90)
    job = live.job
    # Two readers play their first piece, then stop: one comes back once the job is done (the window
    # has moved past it), the other once its stream has expired.
    behind, gone = (iter(AudioStream(client, job, timeout=90)) for _ in range(2))
    heard = {"behind": next(behind).pcm, "gone": next(gone).pcm}
    result = client.wait(job.id or "", timeout=90)
    stored, rate = wav_pcm(client.download(result))
    entries = owner.streams.read(job.id or "", block_s=0.1)
    audio = [entry for entry in entries if entry.kind == "audio"]
    # The stream kept its last second or so of audio and the end: the start and the rest were trimmed.
    assert entries[0].kind == "audio" and entries[-1].kind == "end" and audio[0].seq > 10
    assert sum(len(entry.pcm) for entry in audio) <= 2 * rate * 2  # at most the window and one piece
    assert audio[-1].at + len(audio[-1].pcm) // 2 == len(stored) // 2  # pieces say the sample they start at

    heard["behind"] += b"".join(piece.pcm for piece in behind)
    late = AudioStream(client, job, timeout=90)  # arrives after the end: the stream no longer starts
    heard["late"] = b"".join(piece.pcm for piece in late)
    assert late.result is not None and late.result["key"] == result["key"]
    wait_until(lambda: not owner.cache.exists(STREAM_PREFIX + (job.id or "")), 30, "the stream to expire")
    heard["gone"] += b"".join(piece.pcm for piece in gone)
    heard["live"] = b"".join(piece.pcm for piece in live)
    assert len(heard["behind"]) > 1000
    for name, pcm in heard.items():
        assert pcm == stored, name  # byte for byte, whichever way each reader got there
    owner.close()
    client.close()


@pytest.mark.slow
def test_thirty_long_streams_leave_redis_as_they_found_it_after_the_grace(
    settings: Settings, start_worker: StartWorker
) -> None:
    """Acceptance (issue 41): 30 long streams read to the end, then the grace: Redis's memory within
    40 MB of where it started (every clip whole for 15 minutes took it up 439 MB)."""
    graced = settings.replace(stream_grace_s=2)
    start_worker(graced)
    client = Client(graced)
    owner = RedisOwner(graced, role="test")
    client.wait(client.submit("Warm up the worker.").id or "", timeout=60)
    before = int(owner.cache.info("memory")["used_memory"])
    texts = [long_text(n) for n in range(30)]
    heard: dict[int, tuple[bytes, dict[str, object]]] = {}

    def read(n: int) -> None:
        stream = client.stream(texts[n], timeout=300)
        pcm = b"".join(piece.pcm for piece in stream)
        assert stream.result is not None
        heard[n] = (pcm, dict(stream.result))

    threads = [threading.Thread(target=read, args=(n,)) for n in range(30)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert len(heard) == 30
    seconds = sum(len(pcm) / 2 / int(result["sample_rate"]) for pcm, result in heard.values())  # type: ignore[call-overload]
    assert seconds > 30 * 30  # long streams: over 900 s of audio (1,268 s here), about 75 MB as whole streams
    wait_until(lambda: not owner.cache.keys(STREAM_PREFIX + "*"), 60, "every stream gone after its grace")
    after = int(owner.cache.info("memory")["used_memory"])
    print(f"Redis used_memory: {before} before, {after} after {seconds:.0f} s of audio streamed and the grace")
    assert after - before < 40 * 2**20, f"Redis went from {before} to {after} bytes"
    pcm, result = heard[7]
    assert pcm == wav_pcm(client.download(result))[0]  # type: ignore[arg-type]
    owner.close()
    client.close()
