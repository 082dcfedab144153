"""The Qwen3-ForcedAligner path (``TTSQ_ALIGNER=qwen-aligner``): what it costs, how right it is on a
real checkpoint, and whether it computes what the reference implementation does.

    python benchmarks/qwen_aligner.py [--model FOLDER | --size tiny|full] [--device cpu|cuda:0]
                                      [--dtype float32|bfloat16] [--texts N] [--repeats R]
    python benchmarks/qwen_aligner.py --reference /path/to/qwen_asr/src [--size tiny]

espeak speaks texts of about forty words (three sentences of the fixed corpus, ``tests/fidelity_corpus.py``)
with its own word times (exact: the sample each word starts at). The aligner times the same samples;
each run reports the seconds of alignment per second of audio (best of ``--repeats``, the model loaded
and warmed before timing) and the median and 95th percentile of |start - espeak's start|. Without
``--model`` the checkpoint is a random-weight one (``ttsq.testing.aligner_checkpoint``; ``--size full``
has the published sizes): its times are noise, so only the cost means anything.

``--reference SRC`` checks ttsq's network and decoding against ``qwen-asr``'s own code (0.0.6: ``pip
download qwen-asr==0.0.6 --no-deps`` and unzip the wheel; SRC is the folder holding ``qwen_asr/``)
on the same checkpoint: that ``Qwen3ASRForConditionalGeneration.from_pretrained`` finds every tensor
under the names ttsq loads (nothing missing, nothing unexpected), the largest difference of the two
networks' logits on qwen-asr's own processed inputs, and whether qwen-asr's ``Qwen3ForcedAligner.align``
and ttsq's repaired slot times agree. ``nagisa`` (imported by qwen-asr at its top, used only for
Japanese) is stubbed; nothing of qwen-asr is installed.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

from ttsq.alignment import text_words
from ttsq.alignment.forced import monotonic, units
from ttsq.config import Settings
from ttsq.engines.base import EngineOutput
from ttsq.engines.espeak import EspeakEngine
from ttsq.job import SynthesisRequest


def corpus_texts(count: int) -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    sentences: tuple[str, ...] = importlib.import_module("fidelity_corpus").SENTENCES
    return [" ".join(sentences[i : i + 3]) for i in range(0, 3 * count, 3) if i < len(sentences)]


def speak(engine: EspeakEngine, text: str) -> EngineOutput:
    request = SynthesisRequest.from_dict({"text": text, "language": "english", "timestamps": "word"})
    output = engine.synthesize_batch([request])[0]
    assert isinstance(output, EngineOutput), output
    return output


def checkpoint(args: argparse.Namespace, scratch: Path) -> Path:
    """``--model``, or a random-weight checkpoint written under ``scratch`` (removed after the run)."""
    if args.model:
        return Path(args.model)
    from ttsq.testing.aligner_checkpoint import build

    return build(scratch / f"random-{args.size}", args.size)


def measure(args: argparse.Namespace, folder: Path) -> None:
    from ttsq.engines.qwen.aligner import QwenForcedAligner

    settings = Settings(
        aligner="qwen-aligner", qwen_aligner_model=str(folder), qwen_device=args.device, qwen_dtype=args.dtype
    )
    aligner = QwenForcedAligner(settings)
    engine = EspeakEngine(Settings(engine="espeak"))
    engine.load()
    outputs = [(text, speak(engine, text)) for text in corpus_texts(args.texts)]
    engine.close()
    load_started = time.perf_counter()
    aligner.load()
    load_s = time.perf_counter() - load_started
    aligner.align(outputs[0][1].samples, outputs[0][1].sample_rate, outputs[0][0], "english")  # warm
    audio_s = align_s = 0.0
    found: list[float] = []
    for text, output in outputs:
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            words = aligner.align(output.samples, output.sample_rate, text, "english")
            best = min(best, time.perf_counter() - started)
        align_s += best
        audio_s += output.samples.shape[0] / output.sample_rate
        assert [w.word for w in words] == [w for w, _, _ in text_words(text)]
        found += [abs(w.start - ref.start) for w, ref in zip(words, output.words or (), strict=True)]
    ordered = sorted(found)
    print(
        f"checkpoint {folder} on {aligner.device} as {str(aligner.dtype).removeprefix('torch.')}: "
        f"loaded in {load_s:.1f} s"
    )
    print(
        f"{len(outputs)} texts, {audio_s:.1f} s of audio, {len(found)} words: "
        f"{align_s / audio_s:.4f} s of alignment per second of audio (best of {args.repeats})"
    )
    print(
        f"|start - espeak's start|: median {statistics.median(ordered):.3f} s, "
        f"p95 {ordered[int(0.95 * (len(ordered) - 1))]:.3f} s" + ("" if args.model else " (random weights: noise)")
    )


def reference(args: argparse.Namespace, folder: Path) -> None:
    import torch

    sys.modules.setdefault("nagisa", types.ModuleType("nagisa"))
    sys.path.insert(0, args.reference)
    backend = importlib.import_module("qwen_asr.core.transformers_backend")
    inference = importlib.import_module("qwen_asr.inference.qwen3_forced_aligner")
    from transformers import AutoConfig, AutoModel, Qwen2TokenizerFast, WhisperFeatureExtractor

    from ttsq.alignment.whisper import to_whisper_rate
    from ttsq.engines.qwen.aligner import QwenForcedAligner

    AutoConfig.register("qwen3_asr", backend.Qwen3ASRConfig)
    AutoModel.register(backend.Qwen3ASRConfig, backend.Qwen3ASRForConditionalGeneration)
    model, info = backend.Qwen3ASRForConditionalGeneration.from_pretrained(
        str(folder), output_loading_info=True, dtype=torch.float32, attn_implementation="sdpa"
    )
    print("qwen-asr's load of the checkpoint:", {key: value for key, value in info.items() if value} or "every tensor")
    tokenizer = Qwen2TokenizerFast.from_pretrained(str(folder))
    tokenizer.audio_token, tokenizer.audio_bos_token, tokenizer.audio_eos_token = (
        "<|audio_pad|>",
        "<|audio_start|>",
        "<|audio_end|>",
    )
    processor = backend.Qwen3ASRProcessor(
        feature_extractor=WhisperFeatureExtractor.from_pretrained(str(folder)), tokenizer=tokenizer
    )
    theirs = inference.Qwen3ForcedAligner(
        model=model.eval(), processor=processor, aligner_processor=inference.Qwen3ForceAlignProcessor()
    )
    ours = QwenForcedAligner(Settings(aligner="qwen-aligner", qwen_aligner_model=str(folder), qwen_device="cpu"))
    ours.load()
    network = ours._model
    assert network is not None  # loaded above
    engine = EspeakEngine(Settings(engine="espeak"))
    engine.load()
    for text, language in [
        ("The quick brown fox jumps over the lazy dog, again and again.", "English"),
        ("Hello there - don't worry: 42 apples!", "English"),
        ("今天天气很好 我们去 park 散步吧", "Chinese"),
    ]:
        output = engine.synthesize_batch([SynthesisRequest.from_dict({"text": text, "language": language.lower()})])[0]
        assert isinstance(output, EngineOutput), output
        audio = to_whisper_rate(output.samples, output.sample_rate)  # the same 16 kHz samples into both
        word_list, prompt_text = theirs.aligner_processor.encode_timestamp(text, language)
        inputs = processor(text=[prompt_text], audio=[audio], return_tensors="pt", padding=True)
        frames = int(inputs["feature_attention_mask"].sum())
        with torch.inference_mode():
            expected = model.thinker(**inputs).logits[0]
            got = network(inputs["input_ids"][0], inputs["input_features"][0, :, :frames], ours.audio_token_id)
        diff = float((expected - got).abs().max())
        same = bool((expected.argmax(-1) == got.argmax(-1)).all())
        their_items = theirs.align(audio=(audio, 16_000), text=text, language=language)[0]
        unit_list = [unit for word, _, _ in text_words(text) for unit in units(word)]
        slots = monotonic(ours.slot_times(audio, 16_000, unit_list))
        agree = [round(int(ms) / 1000, 3) for ms in slots] == [
            t for i in their_items for t in (i.start_time, i.end_time)
        ]
        print(
            f"{language}: {len(word_list)} units (the same: {unit_list == word_list}); logits max |diff| {diff:.1e}, "
            f"argmax the same on all {expected.shape[0]} tokens: {same}; repaired times the same: {agree}"
        )
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="The Qwen3-ForcedAligner path: its cost, its accuracy, and qwen-asr.")
    parser.add_argument("--model", help="a Qwen3-ForcedAligner checkpoint folder (default: random weights)")
    parser.add_argument("--size", choices=("tiny", "full"), default="full", help="random checkpoint's size")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--texts", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference", help="the folder holding qwen-asr 0.0.6's qwen_asr/ source")
    args = parser.parse_args()
    if args.reference and not args.model and "--size" not in sys.argv:
        args.size = "tiny"
    with tempfile.TemporaryDirectory(prefix="qwen-aligner-") as scratch:
        folder = checkpoint(args, Path(scratch))
        if args.reference:
            reference(args, folder)
        else:
            measure(args, folder)


if __name__ == "__main__":
    main()
