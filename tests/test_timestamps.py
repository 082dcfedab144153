"""Word timestamps end to end: real Redis, moto S3, a real ``ttsq worker`` (espeak), the real client and CLI.

A request with ``timestamps: "word"`` gets its words in the result, stored beside the audio it shares
with the same request without them; a document's words are its chunks', moved to where each chunk
lies in the stitched file; ``ttsq submit -f FILE --captions x.srt`` writes captions of a long document.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path

import pytest
import soundfile as sf
from document_corpus import corpus
from support import GatewayProcess, WorkerProcess, api_key, run_cli, s3_keys, wait_until

from ttsq.alignment import parse_words, text_words
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.keys import is_words_key
from ttsq.splitter import normalize

StartWorker = Callable[..., WorkerProcess]

FORTY_WORDS = (
    "The small library opened early on Monday, and the children ran inside to find their favourite books. "
    "A quiet librarian helped them choose stories about dragons, rivers and distant mountains, then read "
    "one aloud while the rain kept falling outside."
)


def test_a_clip_with_word_timestamps_from_a_real_worker(settings: Settings, start_worker: StartWorker) -> None:
    """Acceptance 1 on the stored file: every word in order inside the clip, starts within 0.15 s
    (median) of an independent recogniser's on the downloaded audio."""
    pytest.importorskip("faster_whisper", reason="the reference recogniser needs: pip install 'ttsq[fidelity]'")
    from ttsq.alignment.whisper import WhisperAligner, place

    start_worker(settings)
    with Client(settings) as client:
        result = client.submit(FORTY_WORDS, timestamps="word", format="flac").wait(timeout=120)
        words = parse_words(result["words"])
        assert [w.word for w in words] == FORTY_WORDS.split()
        assert all(0 <= w.start <= w.end <= result["duration_s"] for w in words)
        assert all(a.start <= b.start for a, b in itertools.pairwise(words))
        samples, rate = sf.read(io.BytesIO(client.download(result)), dtype="float32")
        heard = WhisperAligner(cpu_threads=1).heard(samples, rate, "en")
        reference = place([w for w, _, _ in text_words(FORTY_WORDS)], heard)
        distances = [abs(w.start - times[0]) for w, times in zip(words, reference, strict=True) if times]
        assert len(distances) >= 30 and statistics.median(distances) <= 0.15

        # Stored beside the audio, which the same request without timestamps shares.
        assert is_words_key(result["words_key"]) and any(k.endswith(result["words_key"]) for k in s3_keys(settings))
        plain = client.submit(FORTY_WORDS, format="flac").wait(timeout=120)
        assert plain["object_key"] == result["object_key"] and plain["key"] != result["key"]
        assert "words" not in plain and "words_key" not in plain
        again = client.submit(FORTY_WORDS, timestamps="word", format="flac").wait(timeout=120)
        assert again["cached"] and again["words"] == result["words"]


def test_a_documents_words_lie_in_their_chunks(settings: Settings, start_worker: StartWorker) -> None:
    """Each chunk's words are moved by its exact start in the stitched file: they lie inside its span."""
    start_worker(settings)
    text = " ".join(
        f"Paragraph {n} begins here, and it goes on for a while so that the splitter cuts it. "
        f"It ends with a question number {n}? Then a short answer follows." + ("\n\n" if n % 2 else " ")
        for n in range(8)
    )
    with Client(settings) as client:
        result = client.submit_document(text, timestamps="word").wait(timeout=240)
    words = parse_words(result["words"])
    assert [w.word for w in words] == text.split()
    assert len(result["chunks"]) > 2
    at = 0
    normalized = normalize(text)  # what the chunks' character offsets count in
    for chunk in result["chunks"]:
        count = len(text_words(normalized[chunk["start_char"] : chunk["end_char"]]))
        for word in words[at : at + count]:
            assert chunk["start_s"] - 1e-3 <= word.start <= word.end <= chunk["end_s"] + 1e-3, (word, chunk)
        at += count
    assert at == len(words)


def test_cli_captions_of_a_clip(settings: Settings, start_worker: StartWorker, tmp_path: Path) -> None:
    start_worker(settings)
    captions = tmp_path / "clip.vtt"
    out = run_cli("submit", "Hello there. How are you today?", "--captions", str(captions), settings=settings)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    assert b"wrote 2 captions to" in out.stderr and out.stdout.count(b"\n") == 1  # stdout: the result line
    text = captions.read_text(encoding="utf-8")
    assert text.startswith("WEBVTT\n\n00:00:00.") and text.endswith("How are you today?\n\n")


def test_bad_captions_flags_are_refused_before_anything_is_sent(settings: Settings, tmp_path: Path) -> None:
    out = run_cli("submit", "Hello.", "--captions", str(tmp_path / "x.txt"), settings=settings)
    assert out.returncode != 0 and b".srt or .vtt" in out.stderr
    out = run_cli("submit", "Hello.", "--captions", str(tmp_path / "x.srt"), "--stream", settings=settings)
    assert out.returncode != 0 and b"--captions goes with one text" in out.stderr


@pytest.mark.slow
def test_captions_of_a_20000_character_document(settings: Settings, start_worker: StartWorker, tmp_path: Path) -> None:
    """Acceptance 3: ``--captions x.srt``: cues in order, none overlapping, the last ending within 0.5 s
    of the audio's end, every cue's text a span of the document."""
    start_worker(settings)
    document = tmp_path / "book.txt"
    text = corpus(20_000)
    document.write_text(text, encoding="utf-8")
    captions = tmp_path / "book.srt"
    out = run_cli(
        "submit",
        "-f",
        str(document),
        "--captions",
        str(captions),
        "--format",
        "flac",
        "--json",
        settings=settings,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    result = json.loads(out.stdout)
    cues = parse_srt(captions.read_text(encoding="utf-8"))
    assert len(cues) > 100
    for (_, end, _), (start, _, _) in itertools.pairwise(cues):
        assert end <= start
    assert all(start <= end for start, end, _ in cues)
    assert abs(cues[-1][1] - result["duration_s"]) <= 0.5
    flat = " ".join(text.split())
    for _, _, cue_text in cues:
        assert cue_text in flat, cue_text


def parse_srt(text: str) -> list[tuple[float, float, str]]:
    cues = []
    for block in text.strip().split("\n\n"):
        number, timing, *lines = block.split("\n")
        assert number.isdigit() and lines
        start, end = (
            int(h) * 3600 + int(m) * 60 + int(s) + int(ms) / 1000
            for h, m, s, ms in re.findall(r"(\d\d):(\d\d):(\d\d),(\d\d\d)", timing)
        )
        cues.append((start, end, " ".join(lines)))
    return cues


def test_the_jobs_api_returns_words_and_serves_captions(
    settings: Settings, start_worker: StartWorker, start_gateway: Callable[..., GatewayProcess]
) -> None:
    import httpx

    start_worker(settings)
    gateway = start_gateway(settings)
    headers = {"Authorization": f"Bearer {api_key(settings)}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as api:
        bad = api.post("/v1/jobs", json={"text": "Hello.", "timestamps": "syllable"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "timestamps"
        plain = api.post("/v1/jobs", json={"text": "No words asked for."}).json()["id"]
        job_id = api.post("/v1/jobs", json={"text": FORTY_WORDS, "timestamps": "word"}).json()["id"]
        wait_until(lambda: api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS", 120, "the job")
        result = api.get(f"/v1/jobs/{job_id}").json()["result"]
        assert [w["word"] for w in result["words"]] == FORTY_WORDS.split()
        srt = api.get(f"/v1/jobs/{job_id}/captions.srt")
        assert srt.status_code == 200 and srt.headers["content-type"].startswith("application/x-subrip")
        cues = parse_srt(srt.text)
        assert " ".join(text for _, _, text in cues) == FORTY_WORDS
        assert cues[-1][1] <= result["duration_s"] + 1e-3
        vtt = api.get(f"/v1/jobs/{job_id}/captions.vtt")
        assert vtt.status_code == 200 and vtt.text.startswith("WEBVTT\n\n")
        assert api.get(f"/v1/jobs/{job_id}/captions.ass").status_code == 404
        wait_until(lambda: api.get(f"/v1/jobs/{plain}").json()["state"] == "SUCCESS", 120, "the plain job")
        refused = api.get(f"/v1/jobs/{plain}/captions.srt")
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_timestamps"
        # Another key sees no captions of this one's job, as for a job that never existed.
        other = {"Authorization": f"Bearer {api_key(settings, 'other')}"}
        assert api.get(f"/v1/jobs/{job_id}/captions.srt", headers=other).status_code == 404


def test_an_engine_without_word_times_gets_the_recognisers(
    settings: Settings, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Acceptance 2 through a worker: the recogniser-based aligner times a wordless engine's words."""
    pytest.importorskip("faster_whisper", reason="the recogniser-based aligner needs: pip install 'ttsq[fidelity]'")
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    wordless = settings.replace(engine="wordless_engine:WordlessEngine")
    worker = start_worker(wordless)
    with Client(wordless) as client:
        result = client.submit(FORTY_WORDS, timestamps="word", language="english").wait(timeout=240)
    assert result["engine"] == "wordless"
    words = parse_words(result["words"])
    assert [w.word for w in words] == FORTY_WORDS.split()
    assert all(0 <= w.start <= w.end <= result["duration_s"] for w in words)
    assert all(a.start <= b.start for a, b in itertools.pairwise(words))
    assert words[-1].start > result["duration_s"] / 2
    assert "aligned 40 words with whisper" in worker.log()
