"""What a long document costs over the same chunks submitted as ordinary jobs, in one run.

    python benchmarks/document.py [--chars 20000] [--rounds 3] [--format wav]

Starts the embedded stack (a private Redis, one in-process espeak worker, a temporary local folder),
then per round, each a cache miss (a fresh seed):

- **baseline**: the document's chunks (the same splitter, the same texts) submitted at once as
  ordinary ``ttsq.synthesize`` jobs through ``Client.submit``, waiting for all;
- **document**: the same text through ``Client.submit_document`` (fan-out, chunk jobs, stitch,
  encode, store), waiting for the stitched result;
- **cached**: the same document submitted again (answered by the producer from the document index).

It prints the medians and the document's overhead over the baseline (fan-out, the chord's join,
progress writes, the stitch: decode, join, encode, upload). Figures depend on the machine; espeak
synthesizes so fast that the overhead is the larger share here, where a GPU model's synthesis time
would dominate.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.document import Document, Options
from ttsq.job import Limits
from ttsq.ops.embedded import Embedded
from ttsq.ops.preflight import require_command_line


def corpus(chars: int) -> str:
    """The document of the tests (``tests/document_corpus.py``): ten languages, paragraphs of five sentences."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    text: str = importlib.import_module("document_corpus").corpus(chars)
    return text


def main() -> int:
    require_command_line()  # before minutes of work that would end in workers that never start
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=20_000, help="document length in characters")
    parser.add_argument("--rounds", type=int, default=3, help="rounds; medians are printed")
    parser.add_argument("--format", default="wav", help="output format of the document")
    args = parser.parse_args()

    text = corpus(args.chars)
    with tempfile.TemporaryDirectory() as folder:
        settings = Settings.from_env(storage_url=folder, engine="espeak", metrics_port=0)
        document = Document.parse(
            {"text": text},
            limits=Limits.from_settings(settings),
            max_document_chars=settings.max_document_chars,
            default_options=Options.from_settings(settings),
        )
        pieces = list(dict.fromkeys(chunk.text for chunk in document.chunks))
        figures: dict[str, list[float]] = {"baseline": [], "document": [], "cached": []}
        audio_s = 0.0
        with Embedded(settings) as stack:
            client = Client(stack.settings, redis=stack.owner)
            for round_number in range(args.rounds):
                seed = 1000 + 2 * round_number
                started = time.perf_counter()
                jobs = [client.submit(piece, seed=seed) for piece in pieces]
                for job in jobs:
                    job.wait(timeout=600)
                figures["baseline"].append(time.perf_counter() - started)

                started = time.perf_counter()
                result = client.submit_document(text, seed=seed + 1, format=args.format).wait(timeout=600)
                figures["document"].append(time.perf_counter() - started)
                audio_s = result["duration_s"]

                started = time.perf_counter()
                again = client.submit_document(text, seed=seed + 1, format=args.format)
                assert again.result is not None and again.result["cached"]
                figures["cached"].append(time.perf_counter() - started)
            client.close()

    median = {name: statistics.median(values) for name, values in figures.items()}
    print(
        f"document: {len(text)} characters, {len(document.chunks)} chunks ({len(pieces)} distinct), "
        f"{audio_s:.0f} s of audio as {args.format}; espeak, one embedded worker, {args.rounds} rounds (medians)"
    )
    print(f"  baseline, the chunks as ordinary jobs   {median['baseline']:8.2f} s")
    print(
        f"  document (fan-out, chunks, stitch)      {median['document']:8.2f} s   "
        f"overhead {median['document'] - median['baseline']:+.2f} s "
        f"({median['document'] / median['baseline']:.2f}x the baseline)"
    )
    print(f"  the same document again (cache hit)     {median['cached'] * 1000:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
