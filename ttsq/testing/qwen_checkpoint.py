"""Random-weight Qwen3-TTS checkpoints, for tests and benchmarks on machines that cannot download one.

``build(folder, kind, size)`` writes a folder that ``TTSQ_QWEN_MODEL`` (and qwen-tts's own
``Qwen3TTSModel.from_pretrained``) loads exactly like a released checkpoint: config.json,
generation_config.json, safetensors weights, a byte-level BPE text tokenizer, and the 12 Hz codec in
``speech_tokenizer/``. Nothing is downloaded.

- ``size="tiny"``: every width and depth shrunk (about 13 MB); a batch generates in well under a second
  on a CPU. The real load, generate and decode code paths all run; the audio is noise.
- ``size="full"``: the published Qwen3-TTS-12Hz-1.7B architecture (talker 28 x 2048, code predictor
  5 x 1024, codec decoder 8 x 512; ``shared/notes/qwen3-tts-fullsize.md`` has the sources), for speed and
  memory measurements on a GPU. Random weights rarely sample the end token, so every row runs to its
  frame cap: exactly what a fixed-frame benchmark wants.

The text tokenizer is a small BPE trained here; a real checkpoint's Qwen2 tokenizer has 151,936 ids.
The model slices the chat template by position, so ``<|im_start|>assistant\\n`` must be exactly three
tokens and ``<|im_end|>\\n<|im_start|>assistant\\n`` exactly five; the training text makes them so.

Usage: ``python -m ttsq.testing.qwen_checkpoint FOLDER --kind voice_design --size tiny``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

#: Codec language ids of the released checkpoints (the ten languages).
LANGUAGE_IDS = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
#: A few CustomVoice speakers, with their released ids.
SPEAKER_IDS = {"vivian": 3065, "ryan": 3061, "sohee": 2864}
KINDS = ("voice_design", "custom_voice", "base")
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>"]
_FULL_TALKER: dict[str, Any] = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    text_hidden_size=2048,
    text_vocab_size=151936,
    max_position_embeddings=32768,
    rope_scaling={"rope_type": "default", "type": "default", "interleaved": True, "mrope_section": [24, 20, 20]},
)
_FULL_PREDICTOR: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=5,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=65536,
)
_TINY_TALKER: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    text_hidden_size=32,
    rope_scaling={"rope_type": "default", "mrope_section": [4, 2, 2], "interleaved": True},
)
_TINY_PREDICTOR: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16
)
_FULL_DECODER: dict[str, Any] = dict(
    latent_dim=1024,
    codebook_dim=512,
    codebook_size=2048,
    decoder_dim=1536,
    hidden_size=512,
    intermediate_size=1024,
    head_dim=64,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_hidden_layers=8,
    num_quantizers=16,
    sliding_window=72,
    upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2],
    rms_norm_eps=1e-5,
    rope_theta=10000,
    max_position_embeddings=8000,
    layer_scale_initial_scale=0.01,
    hidden_act="silu",
)
_TINY_DECODER: dict[str, Any] = dict(
    hidden_size=32,
    latent_dim=32,
    codebook_dim=16,
    decoder_dim=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    num_quantizers=16,
)
_TINY_ENCODER: dict[str, Any] = dict(
    hidden_size=32,
    num_hidden_layers=1,
    num_filters=4,
    intermediate_size=64,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=16,
    codebook_dim=16,
    vector_quantization_hidden_dimension=16,
    num_quantizers=16,
    upsample_groups=32,
)
# Keys Qwen3TTSSpeakerEncoderConfig accepts on reload (save_pretrained adds ones it then rejects).
_SPEAKER_ENCODER_KEYS = (
    "mel_dim",
    "enc_dim",
    "enc_channels",
    "enc_kernel_sizes",
    "enc_dilations",
    "enc_attention_channels",
    "enc_res2net_scale",
    "enc_se_channels",
    "sample_rate",
)


def build(folder: str | Path, kind: str = "voice_design", size: str = "tiny", seed: int = 0) -> Path:
    """Write a random-weight checkpoint folder of ``kind`` (voice_design, custom_voice, base)."""
    from qwen_tts.core import Qwen3TTSTokenizerV2Config, Qwen3TTSTokenizerV2Model
    from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast

    if kind not in KINDS or size not in ("tiny", "full"):
        raise ValueError(f"kind must be one of {KINDS} and size tiny or full, got {kind!r}, {size!r}")
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tiny = size == "tiny"

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["assistant\nuser\nHello world. The quick brown fox."] * 50,
        trainers.BpeTrainer(
            vocab_size=400, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>", unk_token=None, pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(out)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in _SPECIALS}

    speakers = SPEAKER_IDS if kind == "custom_voice" else {}
    talker = dict(
        _TINY_TALKER if tiny else _FULL_TALKER,
        vocab_size=3072,
        num_code_groups=16,
        codec_bos_id=2149,
        codec_eos_token_id=2150,
        codec_pad_id=2148,
        codec_think_id=2154,
        codec_nothink_id=2155,
        codec_think_bos_id=2156,
        codec_think_eos_id=2157,
        codec_language_id=LANGUAGE_IDS,
        spk_id=speakers,
        spk_is_dialect=dict.fromkeys(speakers, False),
        code_predictor_config=dict(_TINY_PREDICTOR if tiny else _FULL_PREDICTOR, vocab_size=2048, num_code_groups=16),
    )
    if tiny:
        talker["text_vocab_size"] = len(tokenizer)
    speaker_encoder = (
        dict(enc_dim=32, enc_channels=[16, 16, 16, 16, 48], enc_attention_channels=8, enc_se_channels=8)
        if tiny
        else dict(enc_dim=2048, sample_rate=24000)
    )
    config = Qwen3TTSConfig(
        talker_config=talker,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="1b7",
        tts_model_type=kind,
        speaker_encoder_config=speaker_encoder,
        im_start_token_id=ids["<|im_start|>"],
        im_end_token_id=ids["<|im_end|>"],
        tts_pad_token_id=ids["<|tts_pad|>"],
        tts_bos_token_id=ids["<|tts_bos|>"],
        tts_eos_token_id=ids["<|tts_eos|>"],
        architectures=["Qwen3TTSForConditionalGeneration"],
    )
    dtype = torch.float32 if tiny else torch.bfloat16
    model = Qwen3TTSForConditionalGeneration._from_config(config, dtype=dtype)
    model.save_pretrained(out)
    del model
    config_path = out / "config.json"
    saved = json.loads(config_path.read_text())
    saved["speaker_encoder_config"] = {
        key: value for key, value in saved["speaker_encoder_config"].items() if key in _SPEAKER_ENCODER_KEYS
    }
    config_path.write_text(json.dumps(saved, indent=2))
    # The released generation defaults (sampling on, for both the talker and the code predictor).
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "repetition_penalty": 1.05,
                "temperature": 0.9,
                "top_p": 1.0,
                "top_k": 50,
                "subtalker_dosample": True,
                "subtalker_temperature": 0.9,
                "subtalker_top_p": 1.0,
                "subtalker_top_k": 50,
                "max_new_tokens": 8192,
            },
            indent=2,
        )
    )

    codec_folder = out / "speech_tokenizer"
    codec = Qwen3TTSTokenizerV2Model(
        Qwen3TTSTokenizerV2Config(
            encoder_config=_TINY_ENCODER if tiny else {},
            decoder_config=_TINY_DECODER if tiny else _FULL_DECODER,
            encoder_valid_num_quantizers=16,
            input_sample_rate=24000,
            output_sample_rate=24000,
            decode_upsample_rate=1920,
            encode_downsample_rate=1920,
            architectures=["Qwen3TTSTokenizerV2Model"],
        )
    )
    # Hugging Face init leaves the codebooks at zero (silence) and shrinks the decoder's output to ~1e-9:
    # randomize both so the audio is a non-silent signal in [-1, 1].
    for module in codec.decoder.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.ConvTranspose1d)):
            module.reset_parameters()
    with torch.no_grad():
        for name, weight in codec.named_parameters():
            if name.endswith(("embedding_sum", "scale")):
                torch.nn.init.normal_(weight)
    codec.save_pretrained(codec_folder)
    (codec_folder / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "feature_extractor_type": "EncodecFeatureExtractor",
                "feature_size": 1,
                "sampling_rate": 24000,
                "padding_side": "right",
                "padding_value": 0.0,
                "return_attention_mask": True,
            }
        )
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a random-weight Qwen3-TTS checkpoint folder.")
    parser.add_argument("folder")
    parser.add_argument("--kind", choices=KINDS, default="voice_design")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.folder, args.kind, args.size, args.seed))


if __name__ == "__main__":
    main()
