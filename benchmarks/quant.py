"""Quantized weights (``TTSQ_QWEN_QUANT``) against full precision, side by side in one run: speed,
weight memory and teacher-forced fidelity, for qwen-fast's decode loop.

Every variant (full precision, then each ``--quant``) is the same random-weight checkpoint loaded by
the qwen-fast engine, in one process:

- **Speed.** The same B prompts through each variant's decode loop for ``--frames`` frames (random
  weights never sample the end token, so every row makes exactly that many), interleaved repeats, the
  median: milliseconds per frame of the loop alone (the codec is the same work in every variant and
  stays in its own precision), and the ratio to full precision.
- **Weight memory.** Bytes of the talker's and code predictor's weights (parameters and buffers) in
  each variant, and what quantization saved on the layers it replaced.
- **Fidelity, teacher-forced.** Full precision decodes ``--fidelity-rows`` prompts greedily for
  ``--fidelity-frames`` frames, recording the logits of every codebook (the talker's first code, the
  code predictor's 15). Each quantized variant then runs the same prompts with every code forced to
  full precision's, recording its own logits at the same points. Per codebook: top-1 agreement,
  relative logit error ``|q - f| / |f|``, and KL(f || q) of the softmaxes; and top-1 agreement over
  the *decisive* points only, where full precision's top-1 logit leads the second by at least
  ``--margin``. Random weights give nearly flat distributions, where a top-1 flips on any rounding:
  the all-points agreement is a floor, the decisive one is the figure that speaks for a trained model
  (where random weights give too few decisive points, the agreement over the points whose lead is in
  the top tenth of their codebook's stands in), and none says how the audio sounds (that needs real
  weights and listening).

    python benchmarks/quant.py                                        # CPU, tiny checkpoint, a minute
    python benchmarks/quant.py --size full --batches 1,4 --frames 12  # CPU, full-size architecture
    python benchmarks/quant.py --size full --device cuda --dtype bfloat16 --batches 1,8,32,64 --frames 64
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "안녕하세요, 오늘 날씨가 정말 좋네요. 산책하러 갈까요?",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "今日はとても良い天気ですね。散歩に行きましょう。",
]
INSTRUCT = "A calm, warm female voice, speaking slowly."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an existing VoiceDesign checkpoint folder")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny", help="random checkpoint to build")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="the full-precision dtype (auto: bfloat16 on CUDA)")
    parser.add_argument("--quant", default="int8,fp8", help="comma-separated: int8, fp8")
    parser.add_argument("--batches", default="1,4", help="comma-separated batch sizes for the speed table")
    parser.add_argument("--frames", type=int, default=24, help="frames per row in the speed table")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repetitions; the median is reported")
    parser.add_argument("--untimed", default="", help="comma-separated quants not timed (fp8 on a CPU is emulated)")
    parser.add_argument("--fidelity-rows", type=int, default=4)
    parser.add_argument("--fidelity-frames", type=int, default=24)
    parser.add_argument("--margin", type=float, default=1.0, help="logit lead that makes a point decisive")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: the engine's policy)")
    parser.add_argument("--json", dest="json_path", help="also write the figures here")
    args = parser.parse_args()
    figures = run(args)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2))


def run(args: Any) -> dict[str, Any]:
    import torch

    from ttsq.config import Settings
    from ttsq.engines.qwen.fast import QwenFastEngine
    from ttsq.testing.qwen_checkpoint import build

    quants = [q for q in args.quant.split(",") if q]
    untimed = {q for q in args.untimed.split(",") if q}
    batches = [int(b) for b in args.batches.split(",")]
    slots = max(*batches, args.fidelity_rows)
    with tempfile.TemporaryDirectory() as scratch:
        model = Path(args.model) if args.model else build(Path(scratch) / args.size, "voice_design", args.size)
        settings = Settings(
            engine="qwen-fast",
            qwen_model=str(model),
            qwen_device=args.device,
            qwen_dtype=args.dtype,
            max_batch=slots,
            qwen_max_frames=max(64, args.frames, args.fidelity_frames),
            torch_threads=args.threads,
        )
        engines: dict[str, Any] = {}
        for quant in ["none", *quants]:
            engine = QwenFastEngine(settings.replace(qwen_quant=quant))
            engine.load()  # no warm-up: it would capture CUDA graphs this benchmark does not replay
            engines[quant] = engine
        reference = engines["none"]
        cuda = reference._device.startswith("cuda")
        device = torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)"
        with torch.inference_mode():
            prompts = [reference._prompt(PROMPTS[i % len(PROMPTS)], "auto", INSTRUCT, "", None) for i in range(slots)]
        print(
            f"quantized weights vs {reference._dtype_name}: {model.name} on {device}, qwen-fast's decode loop; "
            f"quantized: the talker's and code predictor's decoder linears"
        )
        memory = {quant: weight_bytes(engine) for quant, engine in engines.items()}
        print_memory(engines, memory)
        speed = speed_table(args, engines, prompts, batches, untimed, cuda, torch)
        for engine in engines.values():  # the slots' caches (a gigabyte each at full size) are done with
            engine.loop = None
        gc.collect()
        rows = prompts[: args.fidelity_rows]
        want = _record(reference, rows, args.fidelity_frames, None, torch)
        fidelity = {quant: teacher_forced(args, want, engines[quant], rows, torch) for quant in quants}
        print_fidelity(args, fidelity)
        for engine in engines.values():
            engine.close()
    return {
        "device": device,
        "model": model.name,
        "dtype": reference._dtype_name,
        "threads": torch.get_num_threads(),
        "weights": memory,
        "saved": {q: engines[q].quant_report.saved for q in quants if engines[q].quant_report is not None},
        "kernels": {q: engines[q].quant_report.kernel for q in quants if engines[q].quant_report is not None},
        "speed": speed,
        "fidelity": fidelity,
    }


def weight_bytes(engine: Any) -> int:
    """Bytes of the talker's weights (code predictor included): parameters and quantized buffers."""
    talker = engine._tts.model.talker
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*talker.parameters(), *talker.buffers())}
    return sum(tensors.values())


def print_memory(engines: dict[str, Any], memory: dict[str, int]) -> None:
    full = memory["none"]
    print("\nweights (talker and code predictor)")
    print(f"{'variant':>8} {'MB':>10} {'of full':>8} {'kernel':>8}")
    for quant in engines:
        report = engines[quant].quant_report
        kernel = "-" if report is None else report.kernel
        print(f"{quant:>8} {memory[quant] / 1e6:>10.1f} {memory[quant] / full:>8.2f} {kernel:>8}")


def decode(engine: Any, prompts: list[Any], frames: int, torch: Any) -> float:
    """Seconds for the rows to make ``frames`` frames each through the engine's loop (greedy)."""
    from ttsq.engines.qwen.sampling import Sampling

    loop = engine.loop
    if engine._device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    for prompt in prompts:
        loop.admit(prompt, cap=frames, sampling=Sampling(do_sample=False))
    while loop.active:
        loop.step()
    if engine._device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def speed_table(
    args: Any,
    engines: dict[str, Any],
    prompts: list[Any],
    batches: list[int],
    untimed: set[str],
    cuda: bool,
    torch: Any,
) -> list[dict[str, Any]]:
    timed = [quant for quant in engines if quant not in untimed]
    print(f"\ndecode loop, {args.frames} frames per row, median of {args.repeats} interleaved runs (ms per frame)")
    print(f"{'batch':>5} " + " ".join(f"{q + ' ms':>10} {q + ' x':>8}" for q in timed))
    rows = []
    for size in batches:
        for quant in timed:  # once untimed: first-call costs
            decode(engines[quant], prompts[:size], 2, torch)
        times: dict[str, list[float]] = {quant: [] for quant in timed}
        for _ in range(args.repeats):
            for quant in timed:
                times[quant].append(decode(engines[quant], prompts[:size], args.frames, torch))
        ms = {quant: 1000 * statistics.median(times[quant]) / args.frames for quant in timed}
        row: dict[str, Any] = {"batch": size}
        for quant in timed:
            row[f"{quant}_ms_per_frame"] = round(ms[quant], 2)
            row[f"{quant}_speedup"] = round(ms["none"] / ms[quant], 2)
        rows.append(row)
        print(f"{size:>5} " + " ".join(f"{ms[q]:>10.2f} {ms['none'] / ms[q]:>7.2f}x" for q in timed), flush=True)
    return rows


def teacher_forced(args: Any, want: dict[str, Any], quantized: Any, prompts: list[Any], torch: Any) -> dict[str, Any]:
    """``want``: full precision's greedy run (its logits and codes); the quantized model, fed the same
    codes, records its own logits. Figures per codebook (0: the talker's code, 1-15: the predictor's)."""
    got = _record(quantized, prompts, args.fidelity_frames, want["codes"], torch)
    result: dict[str, Any] = {"points": 0, "codebooks": []}
    for group in range(16):
        f = torch.stack(want["logits"][group]).float()  # (points, vocab)
        q = torch.stack(got["logits"][group]).float()
        top2 = f.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        decisive = margin >= args.margin
        agree = f.argmax(-1) == q.argmax(-1)
        # Random weights seldom lead by a whole logit: the points whose lead is in the top tenth of this
        # codebook's are the nearest thing to a decisive choice they make.
        leading = margin >= margin.quantile(0.9)
        kl = torch.nn.functional.kl_div(q.log_softmax(-1), f.log_softmax(-1), log_target=True, reduction="none")
        result["codebooks"].append(
            {
                "codebook": group,
                "points": int(f.shape[0]),
                "top1_agreement": round(agree.float().mean().item(), 4),
                "relative_logit_error": round(((q - f).norm(dim=-1) / f.norm(dim=-1)).mean().item(), 5),
                "kl": float(f"{kl.sum(-1).mean().item():.3g}"),
                "decisive_points": int(decisive.sum().item()),
                "decisive_top1_agreement": round(agree[decisive].float().mean().item(), 4) if decisive.any() else None,
                "top_decile_margin": round(margin.quantile(0.9).item(), 4),
                "top_decile_top1_agreement": round(agree[leading].float().mean().item(), 4),
            }
        )
        result["points"] += int(f.shape[0])
    books = result["codebooks"]
    result["top1_agreement"] = round(statistics.mean(b["top1_agreement"] for b in books), 4)
    decisive_books = [b for b in books if b["decisive_points"]]
    total = sum(b["decisive_points"] for b in decisive_books)
    result["decisive_points"] = total
    result["decisive_top1_agreement"] = (
        round(sum(b["decisive_top1_agreement"] * b["decisive_points"] for b in decisive_books) / total, 4)
        if total
        else None
    )
    result["top_decile_top1_agreement"] = round(statistics.mean(b["top_decile_top1_agreement"] for b in books), 4)
    result["relative_logit_error"] = round(statistics.mean(b["relative_logit_error"] for b in books), 5)
    result["kl"] = float(f"{statistics.mean(b['kl'] for b in books):.3g}")
    return result


def _record(engine: Any, prompts: list[Any], frames: int, forced: Any, torch: Any) -> dict[str, Any]:
    """Run the rows through a recording copy of the engine's loop: every codebook's logits, and the
    codes chosen (greedy), or ``forced`` ones (slots x frames x 16) fed instead."""
    from ttsq.engines.qwen.decode import DecodeLoop
    from ttsq.engines.qwen.sampling import Sampling, SubSampling

    logits: list[list[Any]] = [[] for _ in range(16)]

    class Recording(DecodeLoop):
        def _choose(self, scores: Any, slots: Any, *, generated: Any) -> Any:
            logits[0].extend(scores.float().cpu().unbind(0))
            chosen = super()._choose(scores, slots, generated=generated)
            if forced is None:
                return chosen
            frame = torch.as_tensor(generated, device=self.device).expand(slots.shape[0]).clamp(max=frames - 1)
            return forced[slots, frame, 0]

        def _sub_choose(self, scores: Any, slots: Any, step: Any, group: int, race: Any = None) -> Any:
            logits[group].extend(scores.float().cpu().unbind(0))
            chosen = super()._sub_choose(scores, slots, step, group, race)
            if forced is None:
                return chosen
            return forced[slots, step.clamp(max=frames - 1), group]

    loop = Recording(
        engine._tts.model,
        slots=len(prompts),
        # Only what these rows need: the engine's own slots keep 1024 prompt positions each, and a
        # second cache that size per variant is gigabytes at full size.
        positions=max(max(p.embeds.shape[1], p.trailing.shape[1]) for p in prompts) + frames + 8,
        max_frames=frames,
        sub=SubSampling(do_sample=False),
    )
    for prompt in prompts:
        loop.admit(prompt, cap=frames, sampling=Sampling(do_sample=False, repetition_penalty=1.0))
    codes = torch.zeros(len(prompts), frames, 16, dtype=torch.long, device=loop.device)
    while loop.active:
        for finished in loop.step():
            codes[finished.slot, : finished.codes.shape[0]] = finished.codes
    return {"logits": logits, "codes": codes}


def print_fidelity(args: Any, fidelity: dict[str, dict[str, Any]]) -> None:
    print(
        f"\nteacher-forced fidelity against full precision, {args.fidelity_rows} rows x {args.fidelity_frames} "
        f"frames x 16 codebooks; decisive: full precision's top-1 leads by >= {args.margin} logits"
    )
    print(
        f"{'variant':>8} {'codebook':>8} {'points':>7} {'top-1 agree':>11} {'rel. logit err':>14} {'KL':>9} "
        f"{'decisive':>8} {'decisive agree':>14} {'top-10% lead agree':>18}"
    )
    for quant, result in fidelity.items():
        for book in result["codebooks"]:
            if book["codebook"] not in (0, 1, 8, 15):
                continue  # the table shows the talker's and three of the predictor's; the JSON has all
            decisive = book["decisive_top1_agreement"]
            print(
                f"{quant:>8} {book['codebook']:>8} {book['points']:>7} {book['top1_agreement']:>11.3f} "
                f"{book['relative_logit_error']:>14.4f} {book['kl']:>9.3g} {book['decisive_points']:>8} "
                f"{'-' if decisive is None else f'{decisive:.3f}':>14} {book['top_decile_top1_agreement']:>18.3f}"
            )
        overall = result["decisive_top1_agreement"]
        print(
            f"{quant:>8} {'all':>8} {result['points']:>7} {result['top1_agreement']:>11.3f} "
            f"{result['relative_logit_error']:>14.4f} {result['kl']:>9.3g} {result['decisive_points']:>8} "
            f"{'-' if overall is None else f'{overall:.3f}':>14} {result['top_decile_top1_agreement']:>18.3f}"
        )


if __name__ == "__main__":
    main()
