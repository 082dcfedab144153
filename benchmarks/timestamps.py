"""How right are the word times, and what do they cost? Each aligner against an independent reference.

    python benchmarks/timestamps.py [--texts N] [--repeats R] [--languages en,ko] [--json out.json]

espeak speaks texts of about forty words (three sentences of the fixed corpus, ``tests/fidelity_corpus.py``)
with ``timestamps: "word"``; on the same samples:

- **espeak-native** (espeak-ng's own word events) is scored against Whisper's own word starts (the words
  it hears that match the text's, ``ttsq.alignment.whisper.place``): an independent recogniser;
- **whisper** (the recogniser-based aligner: every word of the text, the unheard spread between their
  neighbours) is scored against the espeak-native starts, which are exact: espeak reports the sample
  each word starts at.

Each row: words compared, the median and 95th percentile of |start - reference start| in seconds, and
the share of words within 0.1 s and 0.25 s. Costs: the synthesis time with and without timestamps
(best of ``--repeats`` each, in the same run, so the native aligner's cost is a ratio against its own
baseline), and the recogniser's seconds per second of audio (its model loaded before timing).
``--languages en,ko`` adds Korean (the fixed Korean corpus, Whisper ``base``: the extra
``fidelity-multilingual``); without that extra the Korean rows say so.

``--streamed`` measures instead what words in streams cost, ``timestamps: "word"`` against the same
streamed job without, best of ``--repeats`` each, interleaved, in the same run: espeak streaming a row
(its synthesis, with its word clock: the cost the issue bounds), and espeak speaking into the worker's
own ``StreamWriter`` on a private redis-server (the worker's path from the engine to the job's stream,
less the queue: the pieces a writer cuts depend on when its thread wakes, so this one is noisier); with
the share of words that rode on the audio entry that ends them.

    python benchmarks/timestamps.py --streamed [--texts N] [--repeats R] [--per-text 9]
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ttsq.alignment import Word, text_words
from ttsq.alignment.whisper import WhisperAligner, place
from ttsq.config import Settings
from ttsq.engines.base import EngineOutput
from ttsq.engines.espeak import EspeakEngine
from ttsq.job import SynthesisRequest

LANGUAGES = {"en": ("english", "SENTENCES"), "ko": ("korean", "KOREAN_SENTENCES")}


def corpus() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    return importlib.import_module("fidelity_corpus")


def texts(sentences: tuple[str, ...], count: int, per_text: int = 3) -> list[str]:
    return [" ".join(sentences[i : i + per_text]) for i in range(0, per_text * count, per_text) if i < len(sentences)]


def speak(engine: EspeakEngine, text: str, language: str, timestamps: bool) -> tuple[EngineOutput, float, float]:
    """The output, and the wall and CPU seconds the engine took."""
    fields: dict[str, Any] = {"text": text, "language": language}
    if timestamps:
        fields["timestamps"] = "word"
    request = SynthesisRequest.from_dict(fields)
    started, cpu = time.perf_counter(), time.process_time()
    output = engine.synthesize_batch([request])[0]
    elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    assert isinstance(output, EngineOutput), output
    return output, elapsed, cpu_s


def errors(words: list[Word], reference: list[float | None]) -> list[float]:
    """Signed: the word's start less the reference's (positive: later than the reference)."""
    return [word.start - ref for word, ref in zip(words, reference, strict=True) if ref is not None]


def summary(name: str, language: str, signed: list[float], total_words: int) -> dict[str, Any]:
    found = [abs(e) for e in signed]
    ordered = sorted(found)
    return {
        "aligner": name,
        "language": language,
        "words": total_words,
        "compared": len(found),
        "median_s": round(statistics.median(ordered), 3) if ordered else None,
        "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 3) if ordered else None,
        "within_0.1s": round(sum(e <= 0.1 for e in found) / max(1, len(found)), 3),
        "within_0.25s": round(sum(e <= 0.25 for e in found) / max(1, len(found)), 3),
        "median_signed_s": round(statistics.median(signed), 3) if signed else None,
    }


def measure(language: str, sentences: tuple[str, ...], args: argparse.Namespace) -> dict[str, Any]:
    name, _ = LANGUAGES[language]
    engine = EspeakEngine(Settings(engine="espeak"))
    engine.load()
    engine.warmup()
    aligner = WhisperAligner(english_model="tiny.en", cpu_threads=args.cpu_threads)
    try:
        aligner._model(language)  # loaded before any timing
    except Exception as exc:  # the multilingual extra is not installed
        return {"language": language, "skipped": str(exc)}
    native_errors: list[float] = []
    whisper_errors: list[float] = []
    words_total = 0
    plain_s = timed_s = audio_s = align_s = align_cpu_s = plain_cpu_s = timed_cpu_s = 0.0
    for text in texts(sentences, args.texts):
        # Best of R each, interleaved, so that both sides see the same machine.
        plain: list[tuple[EngineOutput, float, float]] = []
        runs: list[tuple[EngineOutput, float, float]] = []
        for _ in range(args.repeats):
            plain.append(speak(engine, text, name, False))
            runs.append(speak(engine, text, name, True))
        output = runs[0][0]
        plain_s += min(run[1] for run in plain)
        timed_s += min(run[1] for run in runs)
        plain_cpu_s += min(run[2] for run in plain)
        timed_cpu_s += min(run[2] for run in runs)
        audio_s += output.samples.shape[0] / output.sample_rate
        words = list(output.words or ())
        spoken = [word for word, _, _ in text_words(text)]
        words_total += len(spoken)
        started, cpu = time.perf_counter(), time.process_time()
        heard = aligner.heard(output.samples, output.sample_rate, language)
        matched = aligner.align(output.samples, output.sample_rate, text, name)
        align_s += time.perf_counter() - started  # heard once more inside align: halved below
        align_cpu_s += time.process_time() - cpu
        unspaced = language in ("ko", "ja", "zh")
        reference = [None if t is None else t[0] for t in place(spoken, heard, by_characters=unspaced)]
        native_errors += errors(words, reference)
        whisper_errors += errors(matched, [w.start for w in words])
    engine.close()
    align_s /= 2
    align_cpu_s /= 2
    return {
        "language": language,
        "texts": min(args.texts, len(sentences) // 3),
        "audio_s": round(audio_s, 2),
        "rows": [
            summary("espeak-native vs whisper's heard words", language, native_errors, words_total),
            summary("whisper aligner vs espeak-native", language, whisper_errors, words_total),
        ],
        "synthesis_s": round(plain_s, 4),
        "synthesis_with_timestamps_s": round(timed_s, 4),
        "native_cost_ratio": round(timed_s / plain_s - 1, 4),
        "native_cpu_cost_ratio": round(timed_cpu_s / plain_cpu_s - 1, 4),
        "whisper_s_per_audio_s": round(align_s / audio_s, 4),
        "whisper_cpu_s_per_audio_s": round(align_cpu_s / audio_s, 4),
    }


def clock_alone(engine: EspeakEngine, chosen: list[str], repeats: int) -> dict[str, float]:
    """The word clock's own time, steadier than a difference of two syntheses on a busy machine: each
    text's streamed synthesis recorded once (its chunks and events, callback by callback), then the
    clock replayed over them as the engine runs it; against the synthesis (best of ``repeats`` each)."""
    import bisect

    from ttsq.engines.espeak import WordClock

    synthesis_s = clock_s = 0.0
    for text in chosen:
        request = SynthesisRequest.from_dict({"text": text, "language": "english", "stream": True})
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            engine.synthesize_batch([request], [_Discard()])
            best = min(best, time.perf_counter() - started)
        synthesis_s += best
        chunks, events = list(engine._chunks), list(engine._events)
        starts = [0]
        for chunk in chunks:
            starts.append(starts[-1] + chunk.size)
        by_chunk: list[list[tuple[int, int, int]]] = [[] for _ in chunks]
        for event in events:  # each event with the chunk its sample lies in, as espeak's callback brings it
            by_chunk[min(len(chunks) - 1, max(0, bisect.bisect_right(starts, event[2]) - 1))].append(event)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            kept: list[Any] = []
            clock = WordClock(text, engine.identity.sample_rate, kept)
            for chunk, chunk_events in zip(chunks, by_chunk, strict=True):
                for event in chunk_events:
                    clock.event(*event)
                kept.append(chunk)
                if clock.waiting:
                    clock.ready()
            clock.ready(final=True)
            best = min(best, time.perf_counter() - started)
        clock_s += best
    return {
        "synthesis_s": round(synthesis_s, 4),
        "clock_s": round(clock_s, 4),
        "ratio": round(clock_s / synthesis_s, 4),
    }


class _Discard:
    """A streaming row's sink that keeps nothing: the engine's own cost of streaming its words."""

    def __call__(self, samples: Any) -> None:
        pass

    def put_words(self, words: Any) -> None:
        pass


def streamed(args: argparse.Namespace) -> dict[str, Any]:
    """A streamed job's synthesis with and without words (module docstring)."""
    from concurrent.futures import Future

    from ttsq.observer import Observer
    from ttsq.ops.redis_server import RedisServer
    from ttsq.records.connection import connect
    from ttsq.records.streams import AudioStreams
    from ttsq.worker.streaming import StreamWriter

    engine = EspeakEngine(Settings(engine="espeak"))
    engine.load()
    engine.warmup()
    server = RedisServer().start()
    client = connect(f"{server.url}/2")
    streams = AudioStreams(client, window_s=600.0, grace_s=1)  # whole: every entry read back
    rate = engine.identity.sample_rate

    def request(text: str, timestamps: bool) -> SynthesisRequest:
        fields: dict[str, Any] = {"text": text, "language": "english", "stream": True}
        return SynthesisRequest.from_dict({**fields, "timestamps": "word"} if timestamps else fields)

    def engine_only(text: str, timestamps: bool) -> tuple[float, float, int, int]:
        """The engine alone handing a streaming row its audio (and words) over: wall and CPU seconds."""
        started, cpu = time.perf_counter(), time.process_time()
        engine.synthesize_batch([request(text, timestamps)], [_Discard()])
        return time.perf_counter() - started, time.process_time() - cpu, 0, 0

    def into_stream(text: str, timestamps: bool) -> tuple[float, float, int, int]:
        """Wall and CPU seconds to the stream's last entry; words in all, and on audio entries."""
        task_id = uuid.uuid4().hex
        writer = StreamWriter(streams, task_id, sample_rate=rate, observer=Observer(), sent_at=None)
        future: Future[Any] = Future()
        synthesis = request(text, timestamps)
        started, cpu = time.perf_counter(), time.process_time()
        # The engine on its own thread, as the batcher runs it; the writer on this one, as a task thread.
        thread = threading.Thread(target=lambda: future.set_result(engine.synthesize_batch([synthesis], [writer])[0]))
        thread.start()
        output: EngineOutput = writer.wait(future, 120)  # type: ignore[assignment]  # the engine's, not a BatchItem
        writer.finish(output)
        elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        thread.join()
        entries = streams.read(task_id, block_s=0.01)
        client.delete(f"ttsq:stream:{task_id}")
        on_audio = sum(len(entry.words) for entry in entries if entry.kind == "audio")
        return elapsed, cpu_s, len(output.words or ()), on_audio

    figures: dict[str, Any] = {"texts": args.texts}
    try:
        chosen = texts(corpus().SENTENCES, args.texts, args.per_text)
        figures["clock"] = clock_alone(engine, chosen, args.repeats)
        figures["audio_s"] = round(
            sum(speak(engine, t, "english", False)[0].samples.shape[0] for t in chosen) / rate, 2
        )
        for name, run in (("engine", engine_only), ("stream", into_stream)):
            sums = {"plain_s": 0.0, "words_s": 0.0, "plain_cpu_s": 0.0, "words_cpu_s": 0.0}
            words = on_audio = 0
            for text in chosen:
                plain, timed = [], []
                for _ in range(args.repeats):  # best of R each, interleaved: both sides see the same machine
                    plain.append(run(text, False))
                    timed.append(run(text, True))
                sums["plain_s"] += min(r[0] for r in plain)
                sums["words_s"] += min(r[0] for r in timed)
                sums["plain_cpu_s"] += min(r[1] for r in plain)
                sums["words_cpu_s"] += min(r[1] for r in timed)
                words, on_audio = words + timed[0][2], on_audio + timed[0][3]
            figures[name] = {
                **{key: round(value, 4) for key, value in sums.items()},
                "cost_ratio": round(sums["words_s"] / sums["plain_s"] - 1, 4),
                "cpu_cost_ratio": round(sums["words_cpu_s"] / sums["plain_cpu_s"] - 1, 4),
            }
            if name == "stream":
                figures["words"], figures["words_on_their_audio_entry"] = words, round(on_audio / max(1, words), 4)
    finally:
        engine.close()
        client.close()
        server.stop()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=10, help="texts of three sentences each, per language")
    parser.add_argument("--repeats", type=int, default=5, help="syntheses per text and side (the best counts)")
    parser.add_argument("--languages", default="en", help="comma-separated: en, ko")
    parser.add_argument("--cpu-threads", type=int, default=0, help="the recogniser's threads (0: its default)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    parser.add_argument("--streamed", action="store_true", help="measure words in streams instead (docstring)")
    parser.add_argument("--per-text", type=int, default=3, help="sentences per text (--streamed)")
    args = parser.parse_args(argv)
    if args.streamed:
        figures = streamed(args)
        print(f"{figures['audio_s']} s of audio in {figures['texts']} texts, best of {args.repeats} each side")
        for name, label in (("engine", "espeak streaming a row"), ("stream", "espeak into its Redis stream")):
            row = figures[name]
            print(
                f"{label}: {row['plain_s']} s, with words {row['words_s']} s ({row['cost_ratio']:+.1%}); "
                f"CPU {row['plain_cpu_s']} s, with words {row['words_cpu_s']} s ({row['cpu_cost_ratio']:+.1%})"
            )
        clock = figures["clock"]
        print(
            f"the word clock alone, replayed: {clock['clock_s']} s against a streamed synthesis of "
            f"{clock['synthesis_s']} s ({clock['ratio']:.1%})"
        )
        print(
            f"{figures['words_on_their_audio_entry']:.1%} of {figures['words']} words on the audio entry that ends them"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2), encoding="utf-8")
        return 0
    data = corpus()
    results = []
    for language in args.languages.split(","):
        if language not in LANGUAGES:
            parser.error(f"unknown language {language}: choose from {', '.join(LANGUAGES)}")
        results.append(measure(language, tuple(getattr(data, LANGUAGES[language][1])), args))
    print(
        "| aligner | language | words | compared | median error (s) | p95 (s) | within 0.1 s | within 0.25 s "
        "| median signed (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for result in results:
        if "skipped" in result:
            print(f"| (skipped) | {result['language']} | | | {result['skipped']} | | | | |")
            continue
        for row in result["rows"]:
            print(
                f"| {row['aligner']} | {row['language']} | {row['words']} | {row['compared']} | {row['median_s']} "
                f"| {row['p95_s']} | {row['within_0.1s']:.0%} | {row['within_0.25s']:.0%} | {row['median_signed_s']} |"
            )
    print()
    for result in results:
        if "skipped" in result:
            continue
        print(
            f"{result['language']}: {result['audio_s']} s of audio; espeak synthesis {result['synthesis_s']} s, "
            f"with timestamps {result['synthesis_with_timestamps_s']} s ({result['native_cost_ratio']:+.1%}; "
            f"CPU time {result['native_cpu_cost_ratio']:+.1%}); "
            f"whisper aligner {result['whisper_s_per_audio_s']} s per second of audio "
            f"({result['whisper_cpu_s_per_audio_s']} CPU s)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
