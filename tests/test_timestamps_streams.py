"""Words in streams, end to end: a real espeak worker, real Redis and S3, ``Client.stream`` and
``Client.stream_document``, and the gateway's SSE read with httpx and OpenAI's own package.

Each piece (each ``speech.audio.delta``) carries the words its audio completes; together they are the
result's words, once each, in order, none before its audio; a reader that falls back to the stored
file gets the rest from the stored result; a forged words entry is a clear ``CorruptRecord``.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterable
from typing import Any

import httpx
import openai
import pytest
import redis
from support import GatewayProcess, WorkerProcess, api_key, late_reader, scrape, value, wait_until

from ttsq.alignment import Word, parse_words, words_to_json
from ttsq.client import AudioPiece, AudioStream, Client
from ttsq.config import Settings
from ttsq.constants import STREAM_PREFIX
from ttsq.errors import CorruptRecord
from ttsq.records.owner import RedisOwner
from ttsq.records.playback import Broken, Done, Play, Playback, Words
from ttsq.records.streams import StreamEntry, parse_entry

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]
TEXT = (
    "The small library opened early on Monday, and the children ran inside to find their favourite books. "
    "A quiet librarian helped them choose stories about dragons, rivers and distant mountains."
)


def said_in_time(pieces: Iterable[AudioPiece]) -> list[Word]:
    """The words the pieces carry, in order, each checked to come with or after the audio that ends it."""
    words: list[Word] = []
    played = 0
    rate = 0
    for piece in pieces:
        played += len(piece.pcm) // 2
        rate = piece.sample_rate or rate
        for word in piece.words:
            assert word.end <= played / rate + 0.001, (word, played / rate)
        words += piece.words
    return words


def test_a_streamed_clips_pieces_carry_the_words_they_complete(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings.replace(stream_window_s=600))  # the whole clip stays: this reader is live
    with Client(settings) as client:
        stream = client.stream(TEXT, timeout=60, timestamps="word")
        pieces = list(stream)
        assert stream.result is not None
        words = said_in_time(pieces)
        assert words_to_json(words) == stream.result["words"]  # the stored words, once each, in order
        assert [w.word for w in words] == TEXT.split()
        # espeak times its words as it speaks: nearly every word rides on the piece whose audio ends it
        # (the worker wrote them on its audio entries), not after the audio, nor only in the end's result.
        assert sum(len(piece.words) for piece in pieces if piece.pcm) >= 0.9 * len(words)
        entries = RedisOwner(settings, role="test").streams.read(stream.job.id or "", block_s=0.1)
        assert sum(len(e.words) for e in entries if e.kind == "audio") >= 0.9 * len(words)
        # Without timestamps: no words anywhere.
        plain = list(client.stream(TEXT + " Plain.", timeout=60))
        assert not any(piece.words for piece in plain)
        # A cache hit plays the stored file with the stored words.
        again = client.stream(TEXT, timeout=60, timestamps="word")
        assert again.job.cached and said_in_time(list(again)) == words


@pytest.mark.slow
def test_readers_behind_or_late_get_the_rest_of_the_words_from_the_stored_result(
    settings: Settings, start_worker: StartWorker
) -> None:
    windowed = settings.replace(stream_window_s=1, stream_grace_s=60)
    start_worker(windowed)
    text = " ".join([TEXT] * 4)
    with Client(windowed) as client:
        live = client.stream(text, timeout=90, timestamps="word")
        behind = iter(AudioStream(client, live.job, timeout=90))
        first = [next(behind)]  # plays its first piece, then stops while the window moves on
        result = client.wait(live.job.id or "", timeout=90)
        expected = parse_words(result["words"])
        entries = RedisOwner(windowed, role="test").streams.read(live.job.id or "", block_s=0.1)
        assert entries[0].kind != "start"  # trimmed: a reader now comes back to what the stream no longer has
        assert said_in_time([*first, *behind]) == expected
        late = AudioStream(client, live.job, timeout=90)  # opens after the head was trimmed
        assert said_in_time(list(late)) == expected
        assert said_in_time(list(live)) == expected


@pytest.mark.slow
def test_a_streamed_documents_words_come_as_its_chunks_arrive(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings.replace(stream_window_s=600))
    text = " ".join(
        f"Paragraph {n} begins here, and it goes on for a while so that the splitter cuts it. "
        f"It ends with a question number {n}? Then a short answer follows." + ("\n\n" if n % 2 else " ")
        for n in range(6)
    )
    with Client(settings) as client:
        stream = client.stream_document(text, timeout=240, timestamps="word")
        pieces = list(stream)
        assert stream.result is not None and len(stream.result["chunks"]) > 2
        words = said_in_time(pieces)
        assert [w.word for w in words] == text.split()
        stored = parse_words(stream.result["words"])
        # Each chunk's words moved by its exact start in the stitched file: the stored words, to the ms.
        assert all(
            abs(a.start - b.start) <= 0.001 and abs(a.end - b.end) <= 0.001 for a, b in zip(words, stored, strict=True)
        )
        # They came as chunks arrived: the first words with the first pieces, not all at the end.
        with_words = [index for index, piece in enumerate(pieces) if piece.words]
        assert with_words[0] < len(pieces) // 2


@pytest.mark.slow
def test_forged_words_in_a_stream_are_a_corrupt_record(settings: Settings, start_worker: StartWorker) -> None:
    start_worker(settings).stop()  # the fleet is known; nobody consumes: the test writes the stream
    owner = RedisOwner(settings, role="test")
    with Client(settings) as client:
        stream = client.stream(TEXT, timeout=30, timestamps="word")
        task_id = stream.job.id or ""
        owner.streams.start(task_id, sample_rate=22_050, run="r1")
        owner.streams.audio(task_id, 0, b"\x00\x01" * 22_050, run="r1")
        owner.cache.xadd(STREAM_PREFIX + task_id, {"kind": "words", "from": "0", "run": "r1", "words": '[{"word": 1}]'})
        with pytest.raises(CorruptRecord, match="words"):
            list(stream)
    owner.close()


# -- the gateway: SSE deltas --------------------------------------------------------------------


def sse(api: httpx.Client, body: dict[str, Any]) -> tuple[list[dict[str, Any]], httpx.Headers]:
    with api.stream("POST", "/v1/audio/speech", json=body) as response:
        assert response.status_code == 200, response.read()
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        return events, response.headers


def test_sse_deltas_carry_the_words_their_audio_completes(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    start_worker(settings.replace(stream_window_s=600))
    gateway, token = start_gateway(settings), api_key(settings)
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "stream_format": "sse", "timestamps": "word"}
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:
        events, headers = sse(api, body)
        assert events[-1]["type"] == "speech.audio.done"
        deltas = events[:-1]
        assert {e["type"] for e in deltas} == {"speech.audio.delta"}
        sent_s, words = 0.0, []
        for delta in deltas:
            sent_s += len(base64.b64decode(delta["audio"])) / 2 / 24_000  # pcm: OpenAI's 24 kHz
            for word in delta.get("words", []):
                assert word["end"] <= sent_s + 0.002 and set(word) == {"word", "start", "end"}
            words += delta.get("words", [])
        job_id = headers["x-ttsq-job-id"]
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS", 60, "the job's result")
        assert words == api.get(f"/v1/jobs/{job_id}").json()["result"]["words"]
        assert [w["word"] for w in words] == TEXT.split()
        assert sum(len(delta.get("words", [])) for delta in deltas if delta["audio"]) >= 0.9 * len(words)

        # A cache hit: the stored file at once, its words with its first bytes.
        events, headers = sse(api, body)
        assert headers["x-ttsq-cached"] == "true" and events[0]["words"] == words
        # Without timestamps: no words.
        events, _ = sse(api, {**body, "timestamps": False, "input": TEXT + " Plain."})
        assert not any("words" in event for event in events)

    # Through OpenAI's package: ttsq's field rides along as an extra body field.
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=token, max_retries=0, timeout=60)
    with client.audio.speech.with_streaming_response.create(
        model="tts-1",
        voice="alloy",
        input=TEXT + " Once more.",
        response_format="wav",
        stream_format="sse",
        extra_body={"timestamps": "word"},
    ) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    got = [word["word"] for line in lines for word in json.loads(line[6:]).get("words", [])]
    assert got == (TEXT + " Once more.").split()


# -- the rules, without I/O: the one reader (``ttsq.records.playback``) and the entries it reads ----------


def entry(n: int, kind: str, **fields: Any) -> StreamEntry:
    return StreamEntry(id=f"{n}-0", kind=kind, **fields)


def test_the_reader_hands_each_word_out_once_with_or_after_the_audio_that_ends_it() -> None:
    rate = 4000
    half = b"\0\0" * (rate // 2)  # half a second
    said = [Word("one", 0.0, 0.4), Word("two", 0.5, 0.9), Word("three", 1.0, 1.4), Word("four", 1.5, 1.9)]
    playback = Playback("job", now=0.0, first_audio_by=None)
    actions = playback.entries(
        [
            entry(1, "start", sample_rate=rate, run="r"),
            # Piece 0 (0..0.5 s) completes "one"; piece 1 (0.5..1 s) carries "two" and, early, "three".
            entry(2, "audio", seq=0, pcm=half, run="r", words=tuple(said[:1])),
            entry(3, "audio", seq=1, pcm=half, run="r", words=tuple(said[1:3]), first_word=1),
        ],
        1.0,
    )
    assert actions == [Play(half, rate, (said[0],)), Play(half, rate, (said[1],))]
    # "three" ends at 1.4 s: it comes with the piece that gets there (1 s long: to 2 s).
    (play,) = playback.entries([entry(4, "audio", seq=2, pcm=half * 2, run="r")], 2.0)
    assert isinstance(play, Play) and play.words == (said[2],)
    # A words entry whose audio already played: at once, without audio; said words are not said again.
    assert playback.entries([entry(5, "words", run="r", words=tuple(said[2:]), first_word=2)], 3.0) == [
        Words((said[3],))
    ]
    # The end's result has them all: nothing is left to say.
    result = {"words": [word.to_dict() for word in said]}
    assert playback.entries([entry(6, "end", payload=result)], 4.0) == [Done(result)]

    # Words that leave a gap are kept for the whole list of the end's result.
    late = Playback("job", now=0.0, first_audio_by=None)
    late.entries([entry(1, "start", sample_rate=rate, run="r"), entry(2, "audio", seq=0, pcm=half * 4)], 1.0)
    assert late.entries([entry(3, "words", run="r", words=tuple(said[2:]), first_word=2)], 2.0) == []
    assert late.entries([entry(4, "end", payload=result)], 3.0) == [Words(tuple(said)), Done(result)]
    # A forged word list in the end: the reader stops, naming the record.
    forged = Playback("job", now=0.0, first_audio_by=None)
    forged.entries([entry(1, "start", sample_rate=rate, run="r"), entry(2, "audio", seq=0, pcm=b"\0\0")], 1.0)
    (broken,) = forged.entries([entry(3, "end", payload={"words": [{"word": "x", "start": 2, "end": 1}]})], 2.0)
    assert isinstance(broken, Broken) and broken.code == "corrupt_record" and "words" in broken.message


def test_words_read_back_from_a_stream_are_checked() -> None:
    good = json.dumps([{"word": "a", "start": 0.0, "end": 0.1}])
    pcm = base64.b64encode(b"\0\0").decode()
    assert parse_entry("1-0", {"kind": "words", "from": "0", "run": "r", "words": good}).words == (Word("a", 0, 0.1),)
    assert parse_entry("1-0", {"kind": "audio", "seq": "0", "pcm": pcm, "from": "3", "words": good}).first_word == 3
    for fields in (
        {"kind": "words", "from": "0", "words": "{"},
        {"kind": "words", "from": "0", "words": "{}"},
        {"kind": "words", "from": "-1", "words": good},
        {"kind": "words", "from": "x", "words": good},
        {"kind": "words", "words": good},
        {"kind": "words", "from": "0", "words": json.dumps([{"word": "a", "start": "soon", "end": 1}])},
        {"kind": "words", "from": "0", "words": json.dumps([{"word": "a", "start": 1, "end": float("inf")}])},
        {
            "kind": "audio",
            "seq": "0",
            "pcm": pcm,
            "from": "0",
            "words": json.dumps([{"word": "", "start": 0, "end": 1}]),
        },
        {"kind": "audio", "seq": "0", "pcm": pcm, "words": good},
    ):
        with pytest.raises(CorruptRecord):
            parse_entry("1-0", fields)


def test_forged_words_end_the_gateways_sse_with_an_error_event(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    start_worker(settings).stop()  # the fleet is known; nobody consumes: the test writes the stream
    gateway, token = start_gateway(settings), api_key(settings)
    owner = RedisOwner(settings, role="test")
    body = {"model": "tts-1", "input": TEXT, "response_format": "pcm", "stream_format": "sse", "timestamps": "word"}
    got: list[dict[str, Any]] = []
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:

        def read() -> None:
            with api.stream("POST", "/v1/audio/speech", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        got.append(json.loads(line[6:]))

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        broker = redis.Redis.from_url(settings.broker_url)
        wait_until(lambda: broker.llen(settings.queue) == 1, 30, "the job's message")
        task_id = json.loads(broker.lindex(settings.queue, 0))["headers"]["id"]  # type: ignore[arg-type]
        broker.close()
        owner.streams.start(task_id, sample_rate=24_000, run="r1")
        owner.streams.audio(task_id, 0, b"\0\0" * 12_000, run="r1")
        wait_until(lambda: len(got) >= 1, 30, "the first delta")
        owner.cache.xadd(STREAM_PREFIX + task_id, {"kind": "words", "from": "0", "run": "r1", "words": "[{}]"})
        thread.join(60)
        assert not thread.is_alive()
    owner.close()
    assert got[0]["type"] == "speech.audio.delta" and got[-1]["type"] == "speech.audio.error"
    assert got[-1]["error"]["code"] == "corrupt_record" and "words" in got[-1]["error"]["message"]


def test_a_late_sse_reader_gets_the_words_from_the_stored_result(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    """The gateway paused (SIGSTOP) while the worker writes and trims the whole stream: its reader goes
    on from the stored file, and its deltas carry the stored words, each with the audio that ends it."""
    worker = start_worker(settings.replace(stream_window_s=1))
    gateway, token = start_gateway(settings), api_key(settings)
    # Stream pieces are bytes: the kinds are what these reads need.
    cache = redis.Redis.from_url(settings.cache_url, decode_responses=True, encoding_errors="replace")
    text = f"{TEXT} {TEXT} Late."
    body = {"model": "tts-1", "input": text, "response_format": "pcm", "stream_format": "sse", "timestamps": "word"}
    got: list[dict[str, Any]] = []
    headers: dict[str, str] = {}
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as api:

        def read() -> None:
            with api.stream("POST", "/v1/audio/speech", json=body) as response:
                headers.update(response.headers)
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        got.append(json.loads(line[6:]))

        thread = threading.Thread(target=read, daemon=True)
        late_reader(
            worker.process,
            gateway.process,
            thread.start,
            lambda: value(scrape(gateway.port), "ttsq_gateway_streams_read") == 1,
            lambda: any(
                fields["kind"] == "end" for key in cache.keys(STREAM_PREFIX + "*") for _, fields in cache.xrange(key)
            ),
        )
        (key,) = cache.keys(STREAM_PREFIX + "*")
        assert cache.xrange(key)[0][1]["kind"] != "start"  # trimmed: the reader was late
        thread.join(60)
        assert not thread.is_alive() and got[-1]["type"] == "speech.audio.done"
        job_id = headers["x-ttsq-job-id"]
        stored = api.get(f"/v1/jobs/{job_id}").json()["result"]["words"]
    cache.close()
    sent_s, words = 0.0, []
    for delta in got[:-1]:
        sent_s += len(base64.b64decode(delta["audio"])) / 2 / 24_000
        for word in delta.get("words", []):
            assert word["end"] <= sent_s + 0.002
        words += delta.get("words", [])
    assert words == stored and [w["word"] for w in words] == text.split()


def test_a_documents_sse_deltas_carry_its_words_as_its_chunks_arrive(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    short = settings.replace(max_text_chars=300)  # a document past 300 characters: a few chunks here
    start_worker(short)
    gateway, token = start_gateway(short), api_key(settings)
    text = " ".join(f"Sentence number {n} of a short document, read aloud in its turn." for n in range(8))
    body = {"model": "tts-1", "input": text, "response_format": "mp3", "stream_format": "sse", "timestamps": "word"}
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=120) as api:
        events, headers = sse(api, body)
        job_id = headers["x-ttsq-job-id"]
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS", 60, "the document")
        result = api.get(f"/v1/jobs/{job_id}").json()["result"]
    assert events[-1]["type"] == "speech.audio.done" and len(result["chunks"]) > 1
    words = [word for event in events[:-1] for word in event.get("words", [])]
    assert [w["word"] for w in words] == text.split()
    assert all(abs(a["start"] - b["start"]) <= 0.001 for a, b in zip(words, result["words"], strict=True))
    assert next(i for i, event in enumerate(events) if event.get("words")) < len(events) // 2  # not all at the end
