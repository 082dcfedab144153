"""The Qwen3-ForcedAligner path (``TTSQ_ALIGNER=qwen-aligner``) on a tiny random-weight checkpoint built
here in the published layout: the real load (strict, by the reference's parameter names), features,
prompt, forward pass and repair, on espeak audio.

Random weights give random classes, so the tests hold shape and order, not accuracy: one (start, end)
per word of the text, starts never going back, each end at or after its start, all inside the clip.

The checkpoint's tensor names and shapes are written out below from the reference implementation
(``qwen-asr`` 0.0.6, ``Qwen3ASRForConditionalGeneration`` with a forced-aligner thinker), not from
ttsq's model: a renamed or reshaped parameter on either side fails the strict load.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from support import WorkerProcess

from ttsq.alignment import Word, create_aligner, parse_words, text_words
from ttsq.client import Client
from ttsq.config import Settings
from ttsq.engines.espeak import EspeakEngine
from ttsq.errors import ConfigError, EngineUnavailable
from ttsq.job import SynthesisRequest

torch = pytest.importorskip("torch", reason="the qwen aligner needs: pip install 'ttsq[qwen]'")
pytest.importorskip("transformers", reason="the qwen aligner needs: pip install 'ttsq[qwen]'")

#: Whole-file: torch and a model load, several seconds on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

ENGLISH = "The small library opened early on Monday, and the children ran inside - to find their books."
CHINESE = "今天 天气很好。 我们去 park 散步吧!"
SEGMENT_MS = 80
CLASSES = 5000  # the published head: 5000 bins of 80 ms, 400 s
LIVE_BINS = 64
StartWorker = Callable[..., WorkerProcess]
_SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
    "<timestamp>",
]
_AUDIO = dict(
    num_mel_bins=128,
    encoder_layers=2,
    encoder_attention_heads=2,
    encoder_ffn_dim=32,
    d_model=16,
    output_dim=32,
    n_window=50,
    n_window_infer=800,
    conv_chunksize=500,
    downsample_hidden_size=8,
    max_source_positions=1500,
    activation_function="gelu",
    scale_embedding=False,
)
_TEXT = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    hidden_act="silu",
    max_position_embeddings=65536,
    rms_norm_eps=1e-6,
    rope_theta=1000000,
    attention_bias=False,
    tie_word_embeddings=False,
    rope_scaling={"rope_type": "default", "interleaved": True, "mrope_interleaved": True, "mrope_section": [4, 2, 2]},
)


def reference_tensors(audio: dict[str, int], text: dict[str, int], vocab: int, classes: int) -> dict[str, list[int]]:
    """Every persistent tensor of ``qwen-asr``'s ``Qwen3ASRForConditionalGeneration`` (forced-aligner
    thinker), by name, with its shape."""
    shapes: dict[str, list[int]] = {}
    a, d, ffn, ch = "thinker.audio_tower.", audio["d_model"], audio["encoder_ffn_dim"], audio["downsample_hidden_size"]
    bins = ((audio["num_mel_bins"] + 1) // 2 + 1) // 2
    bins = (bins + 1) // 2
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


def build_checkpoint(folder: Path, seed: int = 0) -> Path:
    """A tiny Qwen3-ForcedAligner checkpoint in the published file layout, random weights."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2TokenizerFast, WhisperFeatureExtractor

    folder.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        ["The quick brown fox jumps over the lazy dog. 今天天气很好"] * 20,
        trainers.BpeTrainer(
            vocab_size=320, special_tokens=_SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = Qwen2TokenizerFast(
        tokenizer_object=bpe, bos_token=None, eos_token="<|im_end|>", unk_token=None, pad_token="<|endoftext|>"
    )
    tokenizer.save_pretrained(folder)
    WhisperFeatureExtractor(feature_size=128).save_pretrained(folder)
    ids = {name: tokenizer.convert_tokens_to_ids(name) for name in _SPECIALS}
    vocab = len(tokenizer)
    config = {
        "architectures": ["Qwen3ASRForConditionalGeneration"],
        "model_type": "qwen3_asr",
        "support_languages": ["English", "Chinese"],
        "timestamp_token_id": ids["<timestamp>"],
        "timestamp_segment_time": SEGMENT_MS,
        "thinker_config": {
            "model_type": "qwen3_forced_aligner",
            "classify_num": CLASSES,
            "audio_token_id": ids["<|audio_pad|>"],
            "audio_start_token_id": ids["<|audio_start|>"],
            "audio_end_token_id": ids["<|audio_end|>"],
            "audio_config": {**_AUDIO, "model_type": "qwen3_asr_audio_encoder"},
            "text_config": {**_TEXT, "vocab_size": vocab, "model_type": "qwen3_asr_text"},
        },
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in reference_tensors(_AUDIO, _TEXT, vocab, CLASSES).items():  # type: ignore[arg-type]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight") or "layer_norm.weight" in name:
            tensors[name] = torch.ones(shape)
        elif name.endswith(".bias"):
            tensors[name] = torch.zeros(shape)
        else:
            tensors[name] = torch.randn(shape, generator=generator) * 0.2
    # Only the first 64 bins (5.1 s) can win, so that random times fall mostly inside a short clip and
    # the repair and the clipping both have work to do.
    tensors["thinker.lm_head.weight"][LIVE_BINS:] = 0
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("aligner") / "Qwen3-ForcedAligner-tiny")


@pytest.fixture(scope="module")
def aligner(checkpoint: Path) -> Iterator[object]:
    settings = Settings(aligner="qwen-aligner", qwen_aligner_model=str(checkpoint), qwen_device="cpu")
    built = create_aligner("qwen-aligner", settings)
    assert built.name == "qwen-aligner"
    yield built


@pytest.fixture(scope="module")
def espeak() -> Iterator[EspeakEngine]:
    engine = EspeakEngine(Settings(engine="espeak"))
    engine.load()
    yield engine
    engine.close()


def speak(engine: EspeakEngine, text: str, language: str) -> tuple[np.ndarray, int]:
    output = engine.synthesize_batch([SynthesisRequest.from_dict({"text": text, "language": language})])[0]
    assert not isinstance(output, Exception), output
    return output.samples, output.sample_rate


def assert_shape_and_order(words: list[Word], text: str, duration_s: float) -> None:
    assert [word.word for word in words] == [word for word, _, _ in text_words(text)]
    last = 0.0
    for word in words:
        assert last <= word.start <= word.end <= duration_s + 1e-9, (word, last, duration_s)
        last = word.start


def test_english_espeak_audio_gets_one_time_per_word_in_order_inside_the_clip(
    aligner: object, espeak: EspeakEngine
) -> None:
    samples, rate = speak(espeak, ENGLISH, "english")
    words = aligner.align(samples, rate, ENGLISH, "english")  # type: ignore[attr-defined]
    assert_shape_and_order(words, ENGLISH, samples.shape[0] / rate)
    # A lone dash has no unit to time: it is spread between its neighbours, not lost.
    dash = next(index for index, word in enumerate(words) if word.word == "-")
    assert words[dash - 1].start <= words[dash].start <= words[dash + 1].start


def test_chinese_words_are_timed_by_their_characters(aligner: object, espeak: EspeakEngine) -> None:
    samples, rate = speak(espeak, CHINESE, "chinese")
    words = aligner.align(samples, rate, CHINESE, "chinese")  # type: ignore[attr-defined]
    assert_shape_and_order(words, CHINESE, samples.shape[0] / rate)


def test_a_tone_of_any_rate_and_int16_samples_align(aligner: object) -> None:
    rate = 24_000
    tone = (np.sin(np.arange(int(2.3 * rate)) * 2 * np.pi * 220 / rate) * 12_000).astype(np.int16)
    text = "one two three four"
    assert_shape_and_order(aligner.align(tone, rate, text, "english"), text, tone.shape[0] / rate)  # type: ignore[attr-defined]


def test_slots_are_whole_bins_two_per_unit(aligner: object, espeak: EspeakEngine) -> None:
    """The raw slot times, before the repair: the argmax class of each of the two slots per unit times
    80 ms, inside the head's 5000 bins; the prompt's slots and the units match one to one."""
    samples, rate = speak(espeak, "Hello there, friend", "english")
    slots = aligner.slot_times(samples, rate, ["Hello", "there", "friend"])  # type: ignore[attr-defined]
    assert len(slots) == 6
    assert all(ms % SEGMENT_MS == 0 and 0 <= ms < CLASSES * SEGMENT_MS for ms in slots), slots


def test_the_same_audio_and_text_give_the_same_times(aligner: object, espeak: EspeakEngine) -> None:
    samples, rate = speak(espeak, "Hello there, friend", "english")
    first = aligner.align(samples, rate, "Hello there, friend", "english")  # type: ignore[attr-defined]
    assert aligner.align(samples, rate, "Hello there, friend", "english") == first  # type: ignore[attr-defined]


def test_silence_too_short_to_hear_and_punctuation_alone_are_spread_not_run(aligner: object) -> None:
    words = aligner.align(np.zeros(100, dtype=np.float32), 16_000, "too short", "english")  # type: ignore[attr-defined]
    assert [(w.word, w.start) for w in words] == [("too", 0.0), ("short", words[1].start)]
    assert_shape_and_order(words, "too short", 100 / 16_000)
    dashes = aligner.align(np.zeros(16_000, dtype=np.float32), 16_000, "- ...", "english")  # type: ignore[attr-defined]
    assert_shape_and_order(dashes, "- ...", 1.0)


def test_a_checkpoint_whose_tensors_do_not_fit_is_refused_naming_them(checkpoint: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for item in checkpoint.iterdir():
        (broken / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    tensors["thinker.classifier.weight"] = tensors.pop("thinker.lm_head.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    settings = Settings(aligner="qwen-aligner", qwen_aligner_model=str(broken), qwen_device="cpu")
    with pytest.raises(EngineUnavailable, match=r"thinker\.lm_head\.weight"):
        create_aligner("qwen-aligner", settings).align(np.zeros(16_000), 16_000, "a word", "english")


def test_a_folder_that_is_not_a_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    settings = Settings(aligner="qwen-aligner", qwen_aligner_model=str(tmp_path), qwen_device="cpu")
    with pytest.raises(ConfigError, match="TTSQ_QWEN_ALIGNER_MODEL"):
        create_aligner("qwen-aligner", settings)


def test_a_worker_times_a_wordless_engines_words_with_the_qwen_aligner(
    checkpoint: Path, settings: Settings, start_worker: StartWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``TTSQ_ALIGNER=qwen-aligner`` through a real worker: the aligner is built by name from the
    settings, loads the checkpoint in the worker, and times the stored file's words."""
    tests = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    wordless = settings.replace(
        engine="wordless_engine:WordlessEngine",
        aligner="qwen-aligner",
        qwen_aligner_model=str(checkpoint),
        qwen_device="cpu",
    )
    worker = start_worker(wordless)
    with Client(wordless) as client:
        result = client.submit(ENGLISH, timestamps="word", language="english").wait(timeout=240)
    words = parse_words(result["words"])
    assert [w.word for w in words] == ENGLISH.split()
    # Word times are rounded to the millisecond, duration_s to a tenth of one: a word ending at the
    # clip's end may read up to half a millisecond past it.
    assert all(0 <= w.start <= w.end <= result["duration_s"] + 0.0005 for w in words), (words, result["duration_s"])
    assert all(a.start <= b.start for a, b in itertools.pairwise(words))
    assert f"aligned {len(words)} words with qwen-aligner" in worker.log()
