"""Random-weight Qwen3-ForcedAligner checkpoints, for tests and benchmarks on machines that cannot
download one (``TTSQ_ALIGNER=qwen-aligner``, ``ttsq.engines.qwen.aligner``).

``build(folder, size)`` writes the published layout of ``Qwen/Qwen3-ForcedAligner-0.6B``: config.json
(``model_type: qwen3_asr`` with a forced-aligner ``thinker_config``, ``timestamp_token_id`` and
``timestamp_segment_time`` at the top), ``model.safetensors``, a byte-level BPE Qwen2 tokenizer with
the aligner's special tokens, and Whisper's ``preprocessor_config.json`` (128 mel bins).

The tensors are named and shaped from the reference implementation (``qwen-asr`` 0.0.6,
``Qwen3ASRForConditionalGeneration`` with a forced-aligner thinker), written out below, not taken
from ttsq's model: a renamed or reshaped parameter on either side fails ttsq's strict load.

- ``size="tiny"``: every width and depth shrunk (under 1 MB of weights); a clip aligns in well under
  a second on a CPU. The load, feature, prompt, forward and repair paths all run; the times are noise.
- ``size="full"``: the published sizes (audio encoder 24 x 1024, text model 28 x 1024, 5000 classes;
  as third-party mirrors of the published config.json give them, not read from the hub here), for
  speed and memory measurements. About 0.9 B parameters, written in bfloat16 (1.8 GB).

Usage: ``python -m ttsq.testing.aligner_checkpoint FOLDER --size tiny``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

SEGMENT_MS = 80
CLASSES = 5000  # the published head: 5000 bins of 80 ms (400 s)
_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<timestamp>",
]
_AUDIO_COMMON: dict[str, Any] = dict(
    num_mel_bins=128,
    n_window=50,
    n_window_infer=800,
    conv_chunksize=500,
    max_source_positions=1500,
    activation_function="gelu",
    scale_embedding=False,
)
_TEXT_COMMON: dict[str, Any] = dict(
    hidden_act="silu",
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    rope_theta=1000000,
    attention_bias=False,
    tie_word_embeddings=False,
)
_SIZES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "tiny": (
        dict(encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16, output_dim=32),
        dict(
            downsample_hidden_size=8,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            rope_scaling={"rope_type": "default", "interleaved": True, "mrope_section": [4, 2, 2]},
        ),
    ),
    "full": (
        dict(encoder_layers=24, encoder_attention_heads=16, encoder_ffn_dim=4096, d_model=1024, output_dim=1024),
        dict(
            downsample_hidden_size=480,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=152064,
            rope_scaling={"rope_type": "default", "interleaved": True, "mrope_section": [24, 20, 20]},
        ),
    ),
}


def reference_tensors(audio: dict[str, Any], text: dict[str, Any], vocab: int, classes: int) -> dict[str, list[int]]:
    """Every persistent tensor of ``qwen-asr``'s ``Qwen3ASRForConditionalGeneration`` (forced-aligner
    thinker), by name, with its shape."""
    shapes: dict[str, list[int]] = {}
    a, d, ffn, ch = "thinker.audio_tower.", audio["d_model"], audio["encoder_ffn_dim"], audio["downsample_hidden_size"]
    bins = (((audio["num_mel_bins"] + 1) // 2 + 1) // 2 + 1) // 2  # after three stride-2 convolutions
    shapes |= {f"{a}conv2d1.weight": [ch, 1, 3, 3], f"{a}conv2d1.bias": [ch]}
    for conv in ("conv2d2", "conv2d3"):
        shapes |= {f"{a}{conv}.weight": [ch, ch, 3, 3], f"{a}{conv}.bias": [ch]}
    shapes[f"{a}conv_out.weight"] = [d, ch * bins]
    for i in range(audio["encoder_layers"]):
        layer = f"{a}layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            shapes |= {f"{layer}self_attn.{proj}.weight": [d, d], f"{layer}self_attn.{proj}.bias": [d]}
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            shapes |= {f"{layer}{norm}.weight": [d], f"{layer}{norm}.bias": [d]}
        shapes |= {f"{layer}fc1.weight": [ffn, d], f"{layer}fc1.bias": [ffn]}
        shapes |= {f"{layer}fc2.weight": [d, ffn], f"{layer}fc2.bias": [d]}
    shapes |= {f"{a}ln_post.weight": [d], f"{a}ln_post.bias": [d]}
    shapes |= {f"{a}proj1.weight": [d, d], f"{a}proj1.bias": [d]}
    shapes |= {f"{a}proj2.weight": [audio["output_dim"], d], f"{a}proj2.bias": [audio["output_dim"]]}
    m, h, head = "thinker.model.", text["hidden_size"], text["head_dim"]
    heads, kv, mid = text["num_attention_heads"], text["num_key_value_heads"], text["intermediate_size"]
    shapes[f"{m}embed_tokens.weight"] = [vocab, h]
    for i in range(text["num_hidden_layers"]):
        layer = f"{m}layers.{i}."
        shapes |= {
            f"{layer}self_attn.q_proj.weight": [heads * head, h],
            f"{layer}self_attn.k_proj.weight": [kv * head, h],
            f"{layer}self_attn.v_proj.weight": [kv * head, h],
            f"{layer}self_attn.o_proj.weight": [h, heads * head],
            f"{layer}self_attn.q_norm.weight": [head],
            f"{layer}self_attn.k_norm.weight": [head],
            f"{layer}mlp.gate_proj.weight": [mid, h],
            f"{layer}mlp.up_proj.weight": [mid, h],
            f"{layer}mlp.down_proj.weight": [h, mid],
            f"{layer}input_layernorm.weight": [h],
            f"{layer}post_attention_layernorm.weight": [h],
        }
    shapes[f"{m}norm.weight"] = [h]
    shapes["thinker.lm_head.weight"] = [classes, h]
    return shapes


def build(folder: str | Path, size: str = "tiny", seed: int = 0, live_bins: int = 0) -> Path:
    """Write a random-weight Qwen3-ForcedAligner checkpoint folder. ``live_bins``: only the first this
    many classes can win (0: all), so that random times fall inside a short clip."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast, WhisperFeatureExtractor

    if size not in _SIZES:
        raise ValueError(f"size must be tiny or full, got {size!r}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        ["The quick brown fox jumps over the lazy dog. 今天天气很好"] * 20,
        trainers.BpeTrainer(vocab_size=320, special_tokens=_SPECIALS, initial_alphabet=alphabet),
    )
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>", unk_token=None, pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(out)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(out)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in _SPECIALS}
    audio_size, text_size = _SIZES[size]
    audio = {**_AUDIO_COMMON, **audio_size, "downsample_hidden_size": text_size["downsample_hidden_size"]}
    text = {key: value for key, value in {**_TEXT_COMMON, **text_size}.items() if key != "downsample_hidden_size"}
    text.setdefault("vocab_size", len(tokenizer))
    config = {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "support_languages": ["Chinese", "English", "Japanese", "Korean", "German", "French", "Spanish"],
        "timestamp_token_id": ids["<timestamp>"],
        "timestamp_segment_time": SEGMENT_MS,
        "thinker_config": {
            "model_type": "qwen3_forced_aligner",
            "classify_num": CLASSES,
            "audio_token_id": ids["<|audio_pad|>"],
            "audio_start_token_id": ids["<|audio_start|>"],
            "audio_end_token_id": ids["<|audio_end|>"],
            "audio_config": {**audio, "model_type": "qwen3_asr_audio_encoder"},
            "text_config": {**text, "model_type": "qwen3_asr_text"},
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generator = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if size == "tiny" else torch.bfloat16
    tensors = {}
    for name, shape in reference_tensors(audio, text, text["vocab_size"], CLASSES).items():
        if name.endswith(("norm.weight", "layernorm.weight", "layer_norm.weight")):
            tensor = torch.ones(shape)
        elif name.endswith(".bias"):
            tensor = torch.zeros(shape)
        else:
            # Scaled by fan-in, so activations keep their size through the full-size stack too.
            tensor = torch.randn(shape, generator=generator) * min(0.2, shape[-1] ** -0.5)
        tensors[name] = tensor.to(dtype)
    if live_bins:
        tensors["thinker.lm_head.weight"][live_bins:] = 0
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight Qwen3-ForcedAligner checkpoint folder.")
    parser.add_argument("folder")
    parser.add_argument("--size", choices=tuple(_SIZES), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.folder, args.size, args.seed))


if __name__ == "__main__":
    main()
