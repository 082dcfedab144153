"""Does each engine say the text? Word error rate by offline speech recognition, per engine, in one run.

    python benchmarks/fidelity.py [--engines espeak,qwen] [--languages en,ko] [--model PATH] [--document]
                                  [--limit N] [--json out.json]

For each engine, starts the embedded stack (a private Redis, an in-process worker, a temporary local
folder), submits every sentence of the fixed English corpus (``tests/fidelity_corpus.py``, no digits)
as an ordinary job, downloads each file and transcribes it with Whisper ``tiny.en`` on the CPU
(``ttsq.testing.fidelity``, the extra ``fidelity``), then prints a markdown table: word error rate, words
missing, words inserted, and the worst sentence's recall. ``--document`` also submits the long
document of the round-trip test (fifteen hundred words) and reports its WER, its chunks' recall
(worst and mean) and the WER of its chunks transcribed one by one.

``qwen`` without ``--model`` is a tiny random-weight checkpoint built for the run (as
``benchmarks/compare.py --tiny`` does), capped at a few frames a job: it makes noise, so its figures
only show that the path works. ``--model PATH`` (a real VoiceDesign checkpoint, on a GPU) gives the
figures that mean something.

``--languages en,ko`` also measures the fixed Korean corpus (``KOREAN_SENTENCES``, no digits) with
the multilingual Whisper ``base`` (the extra ``fidelity-multilingual``, about 145 MB) decoding as
Korean, in a second table: the character error rate (Hangul syllables, no punctuation or spaces) and
the WER, which is harsh in Korean (one wrong syllable costs the whole word with its particles). Without
that extra the Korean rows say so and the rest of the run goes on.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.ops.embedded import Embedded
from ttsq.ops.preflight import require_command_line
from ttsq.splitter import normalize
from ttsq.testing.fidelity import CharacterReport, Recognizer, Report, check, check_characters

#: Codec frames per job with the tiny random checkpoint (about 2 s of noise), as ``compare.py --tiny``.
TINY_QWEN_FRAMES = 24
#: The voice description a VoiceDesign checkpoint reads (espeak ignores it).
INSTRUCT = "A calm adult narrator speaking clearly at an even pace."
#: Whisper's language code -> (ttsq's language name, the corpus's sentences).
LANGUAGES = {"en": ("english", "SENTENCES"), "ko": ("korean", "KOREAN_SENTENCES")}
#: Languages scored by characters as well as by words.
BY_CHARACTERS = ("ko",)


def corpus() -> Any:
    """``tests/fidelity_corpus.py``: the sentences and the long document."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    return importlib.import_module("fidelity_corpus")


def _totals(reports: list[Report]) -> dict[str, Any]:
    words = sum(r.reference_words for r in reports)
    errors = sum(r.substitutions + r.deletions + r.insertions for r in reports)
    return {
        "sentences": len(reports),
        "words": words,
        "wer": round(errors / max(1, words), 4),
        "missing": sum(len(r.missing) for r in reports),
        "inserted": sum(len(r.inserted) for r in reports),
        "out_of_order": sum(len(r.out_of_order) for r in reports),
        "worst_recall": round(min(chunk.recall for r in reports for chunk in r.chunks), 4),
    }


def _character_totals(reports: list[CharacterReport]) -> dict[str, Any]:
    characters = sum(r.reference_chars for r in reports)
    errors = sum(r.substitutions + r.deletions + r.insertions for r in reports)
    return {
        "characters": characters,
        "cer": round(errors / max(1, characters), 4),
        "worst_sentence_cer": round(max(r.cer for r in reports), 4),
    }


def measure(
    engine: str,
    settings: Settings,
    recognizer: Recognizer,
    *,
    fields: dict[str, Any],
    limit: int,
    document: bool,
    language: str = "en",
) -> dict[str, Any]:
    """One engine: the sentences of one language (and, in English, the document) through the embedded
    stack, transcribed; in Korean also scored by characters."""
    texts = corpus()
    name, corpus_name = LANGUAGES[language]
    sentences = list(getattr(texts, corpus_name))[: limit or None]
    figures: dict[str, Any] = {"engine": engine}
    with Embedded(settings) as stack:
        assert stack.runtime is not None
        client = Client(stack.settings, redis=stack.owner)
        figures["model"] = stack.runtime.engine.identity.model
        started = time.perf_counter()
        results = [job.wait(timeout=1800) for job in [client.submit(s, language=name, **fields) for s in sentences]]
        figures["synthesis_s"] = round(time.perf_counter() - started, 2)
        started = time.perf_counter()
        transcripts = [recognizer.transcribe(client.download(result)) for result in results]
        figures["recognition_s"] = round(time.perf_counter() - started, 2)
        figures.update(_totals([check(text, heard) for text, heard in zip(sentences, transcripts, strict=True)]))
        if language in BY_CHARACTERS:
            figures["language"] = language
            figures.update(
                _character_totals(
                    [check_characters(text, heard) for text, heard in zip(sentences, transcripts, strict=True)]
                )
            )
        figures["audio_s"] = round(sum(result["duration_s"] for result in results), 2)
        if document and language == "en":
            text = normalize(texts.DOCUMENT)
            result = client.submit_document(texts.DOCUMENT, language="english", **fields).wait(timeout=3600)
            chunks = result["chunks"]  # type: ignore[typeddict-item]
            spans = [(chunk["start_char"], chunk["end_char"]) for chunk in chunks]
            whole = check(text, recognizer.transcribe(client.download(result)), spans=spans)
            runtime = stack.runtime
            alone = []
            for chunk in chunks:
                entry = runtime.cache.get(chunk["key"])
                assert entry is not None, "a chunk of the document is not in the cache"
                alone.append(recognizer.transcribe(runtime.storage.get(entry["object_key"])))
            by_chunk = check(text, " ".join(alone), spans=spans)
            figures["document"] = {
                **whole.summary(),
                "audio_s": result["duration_s"],
                "chunks_alone": by_chunk.summary(),
            }
        client.close()
    return figures


def format_table(rows: list[dict[str, Any]]) -> str:
    """The figures as markdown."""
    lines = [
        "| engine | model | sentences | words | WER | missing | inserted | out of order | worst sentence recall |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['engine']} | {row['model']} | {row['sentences']} | {row['words']} | {row['wer']:.3f} | "
            f"{row['missing']} | {row['inserted']} | {row['out_of_order']} | {row['worst_recall']:.2f} |"
        )
    documents = [row for row in rows if "document" in row]
    if documents:
        lines += [
            "",
            "| engine | document words | chunks | WER | chunk recall, worst | chunk recall, mean | "
            "WER, chunks one by one | chunk recall alone, worst |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in documents:
            doc, alone = row["document"], row["document"]["chunks_alone"]
            lines.append(
                f"| {row['engine']} | {doc['reference_words']} | {doc['chunks']} | {doc['wer']:.3f} | "
                f"{doc['min_chunk_recall']:.2f} | {doc['mean_chunk_recall']:.2f} | {alone['wer']:.3f} | "
                f"{alone['min_chunk_recall']:.2f} |"
            )
    return "\n".join(lines)


def format_korean_table(rows: list[dict[str, Any]]) -> str:
    """The Korean figures as markdown: the character error rate first, then the WER."""
    lines = [
        "| engine | model | language | sentences | characters | CER | worst sentence CER | words | WER |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if "skipped" in row:
            lines.append(f"| {row['engine']} | not measured: {row['skipped']} |")
            continue
        lines.append(
            f"| {row['engine']} | {row['model']} | {row['language']} | {row['sentences']} | {row['characters']} | "
            f"{row['cer']:.3f} | {row['worst_sentence_cer']:.2f} | {row['words']} | {row['wer']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default="espeak,qwen", help="comma-separated engines to measure")
    parser.add_argument(
        "--languages", default="en", help="comma-separated corpora: en, ko (Korean needs ttsq[fidelity-multilingual])"
    )
    parser.add_argument("--model", default="", help="a real Qwen3-TTS VoiceDesign checkpoint (default: tiny random)")
    parser.add_argument("--document", action="store_true", help="also the long document, chunk by chunk")
    parser.add_argument("--limit", type=int, default=0, help="only the first N sentences (0: all)")
    parser.add_argument("--beam-size", type=int, default=1, help="the recognizer's beam (1: greedy)")
    parser.add_argument("--cpu-threads", type=int, default=0, help="the recognizer's threads (0: its default)")
    parser.add_argument("--json", default="", help="also write the figures to this file")
    args = parser.parse_args(argv)

    languages = args.languages.split(",")
    unknown = sorted(set(languages) - set(LANGUAGES))
    if unknown:
        parser.error(f"unknown language {', '.join(unknown)}: choose from {', '.join(LANGUAGES)}")
    recognizers: dict[str, Recognizer | str] = {}
    if "en" in languages:
        recognizers["en"] = Recognizer(cpu_threads=args.cpu_threads, beam_size=args.beam_size)
    if "ko" in languages:
        try:
            recognizers["ko"] = Recognizer(
                model="base", language="ko", cpu_threads=args.cpu_threads, beam_size=args.beam_size
            )
        except ImportError as exc:
            recognizers["ko"] = str(exc)
    rows: list[dict[str, Any]] = []
    korean: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ttsq-fidelity-") as folder:
        for engine in args.engines.split(","):
            settings = Settings.from_env(storage_url=str(Path(folder) / engine), engine=engine, metrics_port=0)
            fields: dict[str, Any] = {}
            if engine.startswith("qwen"):
                fields["instruct"] = INSTRUCT
                model = args.model or settings.qwen_model
                if not model:
                    # Random weights never sample their end token: cap every job, or it runs to its frame cap.
                    from ttsq.testing.qwen_checkpoint import build

                    model = str(build(Path(folder) / "tiny-qwen", "voice_design"))
                    fields["max_new_tokens"] = TINY_QWEN_FRAMES
                settings = settings.replace(qwen_model=model)
            for language, recognizer in recognizers.items():
                into = rows if language == "en" else korean
                if isinstance(recognizer, str):
                    into.append({"engine": engine, "language": language, "skipped": recognizer})
                    continue
                into.append(
                    measure(
                        engine, settings, recognizer, fields=fields, limit=args.limit, document=args.document,
                        language=language,
                    )
                )  # fmt: skip
    tables = ([format_table(rows)] if rows else []) + ([format_korean_table(korean)] if korean else [])
    print("\n\n".join(tables))
    if args.json:
        figures: dict[str, Any] = {"ttsq_fidelity": 1, "engines": rows}
        if korean:
            figures["korean"] = korean
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
