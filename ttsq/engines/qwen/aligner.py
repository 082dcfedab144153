"""Qwen3-ForcedAligner-0.6B (``TTSQ_ALIGNER=qwen-aligner``): word times from one forward pass of a
Qwen3-ASR model whose head classifies each ``<timestamp>`` slot into 80 ms bins.

The checkpoint is a local folder in the published layout of ``Qwen/Qwen3-ForcedAligner-0.6B``:
``config.json`` (``model_type: qwen3_asr``, a ``thinker_config`` with ``audio_config``,
``text_config``, ``classify_num``, and ``timestamp_token_id`` and ``timestamp_segment_time`` at the
top), ``model.safetensors`` (or shards with their index), the Qwen2 tokenizer files and
``preprocessor_config.json`` (Whisper's 128-bin log-mel features). The reference implementation is
the ``qwen-asr`` package (0.0.6), which cannot share a worker with ``qwen-tts`` (docs/timestamps.md);
this is the part of it an aligner needs, built from transformers' own blocks where they are the same
network:

- the audio encoder is ``Qwen3OmniMoeAudioEncoder`` (three stride-2 convolutions, windows of 100 mel
  frames, a Whisper-style encoder, a two-layer projection): line for line the encoder of
  ``qwen-asr``'s ``Qwen3ASRAudioEncoder``;
- the text model is ``Qwen3Model``: ``qwen-asr``'s thinker text model is Qwen3 with multimodal RoPE,
  and its positions for audio and text alike are the token index on all three axes, where multimodal
  RoPE is plain RoPE;
- the head is a bias-free linear layer to ``classify_num`` classes.

Parameter names are those of ``qwen-asr``'s ``Qwen3ASRForConditionalGeneration`` (``thinker.audio_tower``,
``thinker.model``, ``thinker.lm_head``), so the published safetensors load as they are, strictly: a
missing or unexpected tensor is refused at load, naming it. Loaded on first use, never at import.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ttsq.alignment import Word, duration, fill_gaps, text_words
from ttsq.alignment.forced import AUDIO_PAD, TIMESTAMP, audio_tokens, monotonic, prompt, units
from ttsq.alignment.forced import word_times as times_of_words
from ttsq.alignment.whisper import to_whisper_rate
from ttsq.errors import ConfigError, EngineUnavailable

if TYPE_CHECKING:
    import numpy.typing as npt

    from ttsq.config import Settings

logger = logging.getLogger(__name__)

#: The aligner hears 16 kHz audio as 100 mel frames a second (Whisper's front end).
RATE = 16_000
_HOP = 160
#: The longest audio ``qwen-asr`` aligns in one pass (it cuts longer audio first; this path does not).
REFERENCE_LONGEST_S = 180
#: Keys of a sub-config that name its file format, not the network.
_NOT_NETWORK = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")


class _Thinker(nn.Module):  # type: ignore[misc]  # torch is Any to mypy here
    """The audio encoder, the text model and the timestamp head, named as ``qwen-asr`` names them."""

    def __init__(self, audio: Any, text: Any, classes: int) -> None:
        from transformers import Qwen3Model
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

        super().__init__()
        self.audio_tower = Qwen3OmniMoeAudioEncoder(audio)
        self.model = Qwen3Model(text)
        self.lm_head = nn.Linear(text.hidden_size, classes, bias=False)


class ForcedAlignerModel(nn.Module):  # type: ignore[misc]
    """Qwen3-ForcedAligner's network: audio and text in, one class per token out."""

    def __init__(self, audio: Any, text: Any, classes: int) -> None:
        super().__init__()
        self.thinker = _Thinker(audio, text, classes)

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor, audio_token_id: int) -> torch.Tensor:
        """Logits ``(tokens, classes)`` for one prompt (``input_ids``, 1-D) and its mel ``features``
        ``(bins, frames)``, whose encodings fill the prompt's ``audio_token_id`` places."""
        thinker = self.thinker
        embeds = thinker.model.embed_tokens(input_ids)
        frames = torch.tensor([features.shape[1]], device=features.device)
        audio = thinker.audio_tower(features, feature_lens=frames).last_hidden_state
        places = input_ids == audio_token_id
        if int(places.sum()) != audio.shape[0]:
            raise ValueError(f"{int(places.sum())} audio places for {audio.shape[0]} audio embeddings")
        embeds = embeds.masked_scatter(places.unsqueeze(-1), audio.to(embeds.dtype))
        hidden = thinker.model(inputs_embeds=embeds.unsqueeze(0), use_cache=False).last_hidden_state
        logits: torch.Tensor = thinker.lm_head(hidden[0])
        return logits


def _network(section: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in section.items() if key not in _NOT_NETWORK}


def build_model(config: dict[str, Any], attention: str = "sdpa") -> ForcedAlignerModel:
    """The network a ``config.json`` of the published layout describes, with its weights uninitialized."""
    from transformers import Qwen3Config
    from transformers.modeling_utils import no_init_weights
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig

    thinker = config["thinker_config"]
    text = _network(thinker["text_config"])
    rope = text.pop("rope_scaling", None) or {}
    # Multimodal RoPE (``mrope_section``, interleaved or not) with equal positions on its three axes is
    # plain RoPE; any other scaling would change the network.
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        raise ValueError(f"text_config.rope_scaling {rope!r} is not the default RoPE this aligner runs")
    audio = Qwen3OmniMoeAudioEncoderConfig(**_network(thinker["audio_config"]))
    text_config = Qwen3Config(**text)
    for part in (audio, text_config):
        part._attn_implementation = attention
    if audio.output_dim != text_config.hidden_size:
        raise ValueError(f"audio_config.output_dim {audio.output_dim} != text_config.hidden_size")
    with no_init_weights():
        return ForcedAlignerModel(audio, text_config, int(thinker["classify_num"]))


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: ``model.safetensors``, or the shards its index names."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(str(folder / shard)))
    return tensors


def checkpoint_folder(value: str) -> Path:
    """The aligner's checkpoint folder, checked for the files it needs."""
    if not value:
        raise ConfigError(
            "TTSQ_QWEN_ALIGNER_MODEL",
            "is required for TTSQ_ALIGNER=qwen-aligner: a local Qwen3-ForcedAligner checkpoint folder",
        )
    path = Path(value).expanduser()
    for name in ("config.json", "preprocessor_config.json", "tokenizer_config.json"):
        if not (path / name).is_file():
            raise ConfigError("TTSQ_QWEN_ALIGNER_MODEL", f"{value} is not a Qwen3-ForcedAligner checkpoint (no {name})")
    return path


class QwenForcedAligner:
    """Qwen3-ForcedAligner word times (the ``Aligner`` protocol). Loads its checkpoint on first use,
    on ``TTSQ_QWEN_DEVICE`` in ``TTSQ_QWEN_DTYPE``, as the qwen engines do."""

    name = "qwen-aligner"

    def __init__(self, settings: Settings) -> None:
        self.path = checkpoint_folder(settings.qwen_aligner_model)
        self.device_setting = settings.qwen_device
        self.dtype_setting = settings.qwen_dtype
        self._lock = threading.Lock()
        self._model: ForcedAlignerModel | None = None
        self._tokenizer: Any = None
        self._features: Any = None
        self.device = "cpu"
        self.dtype: torch.dtype = torch.float32
        self.audio_token_id = 0
        self.timestamp_token_id = 0
        self.segment_ms = 0.0

    def load(self) -> None:
        """Read the checkpoint (offline), build the network, load its weights strictly."""
        with self._lock:
            if self._model is None:
                self._load()

    def _load(self) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from transformers import Qwen2TokenizerFast, WhisperFeatureExtractor

        device = self.device_setting
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineUnavailable(f"TTSQ_QWEN_DEVICE={device} but torch sees no CUDA device")
        dtype_name = self.dtype_setting
        if dtype_name == "auto":
            dtype_name = "bfloat16" if device.startswith("cuda") else "float32"
        try:
            config = json.loads((self.path / "config.json").read_text(encoding="utf-8"))
            thinker = config["thinker_config"]
            if "forced_aligner" not in str(thinker.get("model_type", "")) or "classify_num" not in thinker:
                raise ValueError("config.json's thinker_config is not a forced aligner's (model_type, classify_num)")
            model = build_model(config)
            missing, unexpected = model.load_state_dict(read_weights(self.path), strict=False)
            if missing or unexpected:
                raise ValueError(f"weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
            tokenizer = Qwen2TokenizerFast.from_pretrained(str(self.path))
            features = WhisperFeatureExtractor.from_pretrained(str(self.path))
        except Exception as exc:
            raise EngineUnavailable(f"cannot load {self.path}: {type(exc).__name__}: {exc}") from exc
        self.audio_token_id = int(thinker["audio_token_id"])
        self.timestamp_token_id = int(config["timestamp_token_id"])
        self.segment_ms = float(config["timestamp_segment_time"])
        for token, expected in ((AUDIO_PAD, self.audio_token_id), (TIMESTAMP, self.timestamp_token_id)):
            found = tokenizer.convert_tokens_to_ids(token)
            if found != expected:
                raise EngineUnavailable(
                    f"{self.path}: the tokenizer reads {token} as {found}, config.json as {expected}"
                )
        if int(features.feature_size) != int(thinker["audio_config"].get("num_mel_bins", 128)):
            raise EngineUnavailable(f"{self.path}: {features.feature_size} mel bins, the encoder wants another count")
        self.device, self.dtype = device, getattr(torch, dtype_name)
        self._model = model.to(device=device, dtype=self.dtype).eval()
        self._tokenizer, self._features = tokenizer, features
        logger.info("qwen-aligner %s loaded on %s as %s", self.path.name, device, dtype_name)

    def slot_times(self, samples: npt.NDArray[Any], rate: int, unit_list: list[str]) -> list[float]:
        """The raw time of every ``<timestamp>`` slot, in milliseconds: the argmax class times
        ``timestamp_segment_time``, two per unit, in order, not yet repaired."""
        self.load()
        assert self._model is not None  # for mypy: loaded above
        audio = to_whisper_rate(samples, rate)
        peak = float(np.abs(audio).max()) if audio.size else 0.0
        if peak > 1.0:  # float samples past full scale: brought into [-1, 1] as the reference does
            audio = audio / peak
        found = self._features(
            audio, sampling_rate=RATE, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt"
        )
        frames = int(found["attention_mask"].sum())
        features = found["input_features"][0, :, :frames].to(device=self.device, dtype=self.dtype)
        text = prompt(unit_list, audio_tokens(frames))
        input_ids = self._tokenizer(text, return_tensors="pt")["input_ids"][0].to(self.device)
        with torch.inference_mode():
            logits = self._model(input_ids, features, self.audio_token_id)
        classes = logits[input_ids == self.timestamp_token_id].argmax(dim=-1)
        if classes.shape[0] != 2 * len(unit_list):
            raise ValueError(f"{classes.shape[0]} timestamp slots for {len(unit_list)} units")
        return [float(value) * self.segment_ms for value in classes.cpu().tolist()]

    def align(self, samples: npt.NDArray[Any], rate: int, text: str, language: str) -> list[Word]:
        """Every word of ``text`` with the times the aligner gives its units."""
        words = [word for word, _, _ in text_words(text)]
        per_word = [units(word) for word in words]
        unit_list = [unit for found in per_word for unit in found]
        clip_s = duration(samples, rate)
        # Under 20 ms of audio makes no mel frame; a text of punctuation alone has nothing to time.
        if not unit_list or samples.shape[0] * RATE < 2 * _HOP * rate:
            return fill_gaps(words, [None] * len(words), clip_s)
        if clip_s > REFERENCE_LONGEST_S:
            logger.warning(
                "qwen-aligner: a %.0f s clip, past the %d s qwen-asr aligns at once: its times may drift",
                clip_s,
                REFERENCE_LONGEST_S,
            )
        slots_ms = monotonic(self.slot_times(np.asarray(samples), rate, unit_list))
        return times_of_words(text, [len(found) for found in per_word], [ms / 1000 for ms in slots_ms], clip_s)
