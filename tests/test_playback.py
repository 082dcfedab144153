"""The one reader of a job's stream (``ttsq.records.playback``), driven directly: entries and clock ticks
in, actions out. The drivers (``AudioStream``, the gateway) are tested end to end in test_streaming.py
and test_gateway_streaming.py; here, every rule once, and a seeded run of random trims and interleavings
against the one property that matters: what a reader plays, then reads from the stored file, is the
clip, or it says the stream broke."""

from __future__ import annotations

import collections
import io
import random

import numpy as np
import soundfile as sf

from ttsq.audio import encode
from ttsq.records.playback import (
    Broken,
    CheckState,
    Done,
    Failed,
    FromStored,
    Play,
    Playback,
    stored_pcm,
)
from ttsq.records.streams import StreamEntry

RATE = 22_050


class Stream:
    """A job's stream as the worker writes it, with ids, and trims from the front."""

    def __init__(self) -> None:
        self.entries: list[StreamEntry] = []
        self._n = 0

    def add(self, kind: str, **fields: object) -> StreamEntry:
        self._n += 1
        entry = StreamEntry(id=f"{self._n}-0", kind=kind, **fields)  # type: ignore[arg-type]
        self.entries.append(entry)
        return entry

    def start(self, run: str) -> None:
        self.add("start", sample_rate=RATE, run=run)

    def audio(self, seq: int, pcm: bytes, run: str = "r1", at: int = -1) -> None:
        self.add("audio", seq=seq, pcm=pcm, run=run, at=at)

    def after(self, entry_id: str) -> list[StreamEntry]:
        n = int(entry_id.split("-")[0])
        return [e for e in self.entries if int(e.id.split("-")[0]) > n]

    def trim_to(self, keep: int) -> None:
        """Keep the last ``keep`` entries."""
        self.entries = self.entries[-keep:]


def piece(n: int, seq: int) -> bytes:
    return bytes([seq % 256, n % 256]) * n


def new(now: float = 0.0, first_audio_by: float | None = 100.0) -> Playback:
    return Playback("job", now=now, first_audio_by=first_audio_by, stall_s=30.0, check_s=2.0)


def test_a_live_reader_plays_every_piece_then_is_done() -> None:
    stream = Stream()
    stream.start("r1")
    for seq in range(3):
        stream.audio(seq, piece(10, seq))
    stream.add("end", payload={"ignored": ["instruct"]})
    playback = new()
    actions = playback.entries(stream.entries, 1.0)
    assert actions[:3] == [Play(piece(10, seq), RATE) for seq in range(3)]
    assert actions[3] == Done({"ignored": ["instruct"]}) and playback.over and playback.offset == 30


def test_a_late_reader_whose_first_pieces_were_trimmed_reads_the_stored_file_from_the_start() -> None:
    stream = Stream()
    stream.start("r1")
    for seq in range(6):
        stream.audio(seq, piece(10, seq))
    stream.trim_to(2)  # the window: the start and the first pieces are gone
    playback = new()
    assert playback.entries(stream.entries, 1.0) == [] and playback.phase == "behind" and playback.trimmed
    stream.add("end", payload={})
    assert playback.entries(stream.entries[-1:], 2.0) == [FromStored(0)]


def test_a_reader_that_falls_behind_goes_on_from_the_sample_it_reached() -> None:
    stream = Stream()
    stream.start("r1")
    stream.audio(0, piece(8, 0))
    stream.audio(1, piece(8, 1))
    playback = new()
    assert len(playback.entries(stream.entries, 1.0)) == 2
    last = stream.entries[-1].id
    for seq in range(2, 9):
        stream.audio(seq, piece(8, seq))
    stream.trim_to(3)  # pieces 2..5 went while the reader was away
    assert playback.entries(stream.after(last), 2.0) == [] and playback.phase == "behind"
    stream.add("end", payload={})
    assert playback.entries(stream.entries[-1:], 3.0) == [FromStored(16)]


def test_a_piece_missing_inside_one_read_is_a_broken_stream_not_a_trim() -> None:
    stream = Stream()
    stream.start("r1")
    stream.audio(1, piece(4, 1))
    [action] = new().entries(stream.entries, 1.0)
    assert isinstance(action, Broken) and "missing" in action.message


def test_a_rerun_after_audio_was_played_breaks_even_when_its_start_was_trimmed() -> None:
    for with_start in (True, False):
        stream = Stream()
        stream.start("r1")
        stream.audio(0, piece(4, 0))
        playback = new()
        assert len(playback.entries(stream.entries, 1.0)) == 1
        last = stream.entries[-1].id
        if with_start:
            stream.start("r2")
        stream.audio(3, piece(4, 3), run="r2")
        [action] = playback.entries(stream.after(last), 2.0)
        assert isinstance(action, Broken) and "run again" in action.message, with_start


def test_a_reader_that_played_nothing_follows_a_rerun() -> None:
    stream = Stream()
    stream.start("r1")
    stream.start("r2")
    stream.audio(0, piece(4, 0), run="r2")
    assert new().entries(stream.entries, 1.0) == [Play(piece(4, 0), RATE)]


def test_an_end_with_nothing_played_and_an_error_and_a_bad_rate() -> None:
    stream = Stream()
    stream.add("end", payload={})
    hit = new()
    assert hit.entries(stream.entries, 1.0) == [FromStored(0)] and not hit.trimmed  # a cache hit at the worker
    failed = Stream()
    failed.add("error", payload={"type": "EngineError", "message": "out of memory"})
    assert new().entries(failed.entries, 1.0) == [Failed("EngineError", "out of memory")]
    bad = Stream()
    bad.add("start", sample_rate=7, run="r1")
    [action] = new().entries(bad.entries, 1.0)
    assert isinstance(action, Broken) and action.code == "corrupt_record"


def test_time_no_audio_in_time_a_stall_and_state_checks() -> None:
    playback = new(first_audio_by=10.0)
    assert playback.idle(1.0) == []
    assert playback.idle(2.5) == [CheckState()]  # nothing started: is the job over?
    assert playback.idle(3.0) == []  # not again before check_s
    [timeout] = playback.idle(10.5)
    assert isinstance(timeout, Broken) and timeout.code == "timeout"

    stream = Stream()
    stream.start("r1")
    stream.audio(0, piece(4, 0))
    live = new(first_audio_by=10.0)
    live.entries(stream.entries, 1.0)
    assert live.idle(2.0) == []  # live, and news a second ago
    assert live.idle(3.5) == [CheckState()]  # silent for check_s: a stream that expired after its end?
    [stall] = live.idle(31.5)
    assert isinstance(stall, Broken) and "no audio for 30s" in stall.message
    # The job was over and its stream had nothing more: the stored file from where the reader is.
    over = new()
    over.entries(stream.entries, 1.0)
    assert over.job_over() == [FromStored(4)] and over.over and over.job_over() == []


def test_stored_pcm_cuts_a_wav_at_a_sample_and_decodes_anything_else() -> None:
    samples = (np.sin(np.arange(RATE) / 7) * 0.4).astype(np.float32)
    wav = encode(samples, RATE, "wav").data
    data = wav[44:]
    for offset in (0, 1, 1000, RATE - 1, RATE):
        for chunk in (7, 4096, 65536):
            chunks = [wav[i : i + chunk] for i in range(0, len(wav), chunk)]
            got = list(stored_pcm(chunks, offset, 882))
            assert b"".join(got) == data[2 * offset :], (offset, chunk)
            assert all(len(p) <= 882 for p in got)
    flac = io.BytesIO()
    sf.write(flac, samples, RATE, format="FLAC", subtype="PCM_16")
    decoded = np.frombuffer(b"".join(stored_pcm([flac.getvalue()], 1000, 882)), dtype="<i2").astype(np.int32)
    expected = np.frombuffer(data[2000:], dtype="<i2").astype(np.int32)
    assert decoded.size == expected.size and np.abs(decoded - expected).max() <= 1  # libsndfile rounds


def test_random_trims_and_pauses_never_make_a_wrong_clip() -> None:
    """A seeded run of streams written, trimmed to a window and read in random pauses: what a reader
    plays, then takes from the stored file at its offset, is the clip, byte for byte."""
    rng = random.Random(41)
    outcomes: collections.Counter[str] = collections.Counter()
    for _ in range(300):
        pieces = [piece(rng.randint(1, 6), seq) for seq in range(rng.randint(1, 12))]
        clip = b"".join(pieces)
        window = rng.randint(1, 4)
        stream, writes = Stream(), [("start", -1)] + [("audio", seq) for seq in range(len(pieces))] + [("end", -1)]
        playback, position, heard, now = new(), "0-0", b"", 0.0
        result: FromStored | Done | None = None
        for kind, seq in writes:
            if kind == "start":
                stream.start("r1")
            elif kind == "audio":
                stream.audio(seq, pieces[seq])
            else:
                stream.add("end", payload={})
            stream.trim_to(window + 1)
            while result is None and rng.random() < 0.5:  # the reader reads now, or later
                now += 1.0
                got = stream.after(position)[: rng.randint(1, 4)]
                if got:
                    position = got[-1].id
                for action in playback.entries(got, now):
                    if isinstance(action, Play):
                        heard += action.pcm
                    elif isinstance(action, FromStored | Done):
                        result = action
                    elif not isinstance(action, CheckState):  # the job is not over yet: read on
                        raise AssertionError(action)
        while result is None:
            now += 1.0
            got = stream.after(position)
            if not got:  # expired after its end: the job is over
                [action] = playback.job_over()
                assert isinstance(action, FromStored)
                result = action
                break
            position = got[-1].id
            for action in playback.entries(got, now):
                if isinstance(action, Play):
                    heard += action.pcm
                elif isinstance(action, FromStored | Done):
                    result = action
        if isinstance(result, FromStored):
            assert result.offset * 2 == len(heard)
            heard += clip[2 * result.offset :]
        assert heard == clip
        outcomes[
            type(result).__name__ + ("" if not isinstance(result, FromStored) else str(min(result.offset, 1)))
        ] += 1
    assert outcomes["Done"] and outcomes["FromStored0"] and outcomes["FromStored1"], outcomes
