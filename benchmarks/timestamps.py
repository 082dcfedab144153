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
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=10, help="texts of three sentences each, per language")
    parser.add_argument("--repeats", type=int, default=5, help="syntheses per text and side (the best counts)")
    parser.add_argument("--languages", default="en", help="comma-separated: en, ko")
    parser.add_argument("--cpu-threads", type=int, default=0, help="the recogniser's threads (0: its default)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args(argv)
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
