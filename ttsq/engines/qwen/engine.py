"""Qwen3-TTS through the ``qwen-tts`` package: VoiceDesign, CustomVoice and voice cloning, batched.

One checkpoint per worker process (``TTSQ_QWEN_MODEL``), whose ``tts_model_type`` decides the one mode it
serves. A batch is one ``generate_*`` call, wrapped in per-row frame caps, ``EngineOutOfMemory`` and a
cache of clone prompts. torch, transformers and qwen_tts are imported in ``load``, on the batcher thread,
so that constructing the engine (and the identity that goes into content keys) costs nothing. Modes,
caps and cloning: docs/qwen.md.

Why one file over 400 lines: loading, frame caps, OOM handling and the clone prompt all wrap the one
``generate_*`` call, and the heavy imports must stay inside one engine module.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ttsq.engines.base import FRAME_CAP_VERSION, EngineIdentity, EngineOutput, frame_cap
from ttsq.errors import ConfigError, EngineError, EngineOutOfMemory, EngineUnavailable, TTSQError
from ttsq.job import LANGUAGES

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.engines.qwen.quant import QuantReport
    from ttsq.job import SynthesisRequest
    from ttsq.storage import Storage
    from ttsq.voices import Voice

logger = logging.getLogger(__name__)

#: ``tts_model_type`` in a checkpoint's config.json -> the ttsq mode it serves.
MODE_BY_MODEL_TYPE = {"voice_design": "voice_design", "custom_voice": "custom_voice", "base": "voice_clone"}
SAMPLE_RATE = 24_000
# Files whose names and sizes identify a checkpoint's weights (hashing gigabytes at start-up would not).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 64 * 1024
_HUB_SNAPSHOT = re.compile(r"snapshots/([0-9a-f]{40})(?:/|$)")


class QwenEngine:
    """A Qwen3-TTS checkpoint behind the batcher. Only the batcher thread calls it."""

    #: The engine name in content keys: engines that sample differently must not share cached audio.
    name = "qwen"
    #: Threads that run torch operations at the same time on a CPU: the batcher's, here.
    torch_callers = 1

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.path = _checkpoint_folder(settings.qwen_model)
        config = _read_json(self.path / "config.json")
        model_type = config.get("tts_model_type")
        if model_type not in MODE_BY_MODEL_TYPE:
            raise ConfigError(
                "TTSQ_QWEN_MODEL", f"{self.path} is not a Qwen3-TTS checkpoint (tts_model_type {model_type!r})"
            )
        self.mode = MODE_BY_MODEL_TYPE[model_type]
        talker = config.get("talker_config") or {}
        spoken = {str(name).lower() for name in talker.get("codec_language_id") or {}}
        # Only VoiceDesign and the 1.7B CustomVoice follow an instruct; qwen-tts drops it silently on the 0.6B
        # CustomVoice, and its voice-clone call takes none at all.
        self.ignores_instruct = model_type == "base" or (
            model_type == "custom_voice" and config.get("tts_model_size") == "0b6"
        )
        speakers = tuple(sorted(str(name).lower() for name in talker.get("spk_id") or {}))
        if self.mode == "custom_voice" and not speakers:
            raise ConfigError("TTSQ_QWEN_MODEL", f"{self.path} is a CustomVoice checkpoint without speakers")
        self.identity = EngineIdentity(
            engine=self.name,
            model=_model_name(self.path),
            # The frame-cap policy shapes every truncated clip, so it is part of the revision (and the key).
            # Quantized weights sound different: their audio must never answer for full precision.
            revision=f"{checkpoint_revision(self.path)}.cap{FRAME_CAP_VERSION}-{settings.qwen_max_frames}"
            + ("" if settings.qwen_quant == "none" else f".{settings.qwen_quant}"),
            sample_rate=SAMPLE_RATE,
            modes=(self.mode,),
            languages=tuple(lang for lang in LANGUAGES if lang == "auto" or lang in spoken),
            speakers=speakers,
            max_frames=settings.qwen_max_frames,
        )
        self._tts: Any = None
        self._torch: Any = None
        self._storage: Storage | None = None
        self._prompts: OrderedDict[str, Any] = OrderedDict()  # reference key -> clone prompt item
        #: What ``TTSQ_QWEN_QUANT`` did at load (None: full precision); the threads torch was given.
        self.quant_report: QuantReport | None = None
        self.torch_threads = 0
        self.prompts_computed = 0
        #: Set at load: the model computes on the CPU, out of this process's heap (``has_cpu_tensors``).
        self.tensors_on_cpu = False

    # -- lifecycle --------------------------------------------------------------------------------

    def load(self) -> None:
        """Import torch and qwen-tts, pick device, dtype and attention, load the checkpoint offline."""
        # Never the network at run time: a local folder needs no hub, and a stray repo id must fail
        # at once instead of retrying for a minute.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        try:
            # qwen-tts prints a flash-attn banner to stdout at import; keep the worker's output clean.
            with contextlib.redirect_stdout(io.StringIO()):
                import torch
                from qwen_tts import Qwen3TTSModel
        except ImportError as exc:
            raise EngineUnavailable(f"the qwen engine needs its extra: pip install 'ttsq[qwen]' ({exc})") from exc
        import transformers

        # "Setting pad_token_id to eos_token_id" on every batch says nothing an operator can act on.
        transformers.logging.set_verbosity_error()
        self._torch = torch
        device = self.settings.qwen_device
        if device == "auto":
            device = "cuda:0" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineUnavailable(f"TTSQ_QWEN_DEVICE={device} but torch sees no CUDA device")
        on_cuda = device.startswith("cuda")
        dtype_name = self.settings.qwen_dtype
        if dtype_name == "auto":
            dtype_name = "bfloat16" if on_cuda else "float32"
        attention = self._attention(on_cuda, dtype_name)
        try:
            self._tts = Qwen3TTSModel.from_pretrained(
                str(self.path), device_map=device, dtype=getattr(torch, dtype_name), attn_implementation=attention
            )
        except Exception as exc:
            raise EngineUnavailable(f"cannot load {self.path}: {type(exc).__name__}: {exc}") from exc
        codec = self._tts.model.speech_tokenizer
        if int(codec.get_output_sample_rate()) != SAMPLE_RATE:
            raise EngineUnavailable(
                f"{self.path}: codec outputs {codec.get_output_sample_rate()} Hz, expected {SAMPLE_RATE}"
            )
        self._samples_per_frame = int(codec.get_decode_upsample_rate())
        self._device, self._dtype_name, self._attention_name = device, dtype_name, attention
        self.tensors_on_cpu = not on_cuda
        if self.settings.qwen_quant != "none":
            from ttsq.engines.qwen.quant import quantize

            self.quant_report = quantize(self._tts.model, self.settings.qwen_quant)
        self.torch_threads = torch_threads(self.settings.torch_threads, self.torch_callers)
        if not on_cuda:
            torch.set_num_threads(self.torch_threads)
        logger.info(
            "qwen %s (%s) loaded on %s as %s with %s attention, weights %s; torch: %s",
            self.path.name,
            self.mode,
            device,
            dtype_name,
            attention,
            self.settings.qwen_quant,
            f"{self.torch_threads} intra-op threads per torch thread ({self.torch_callers} of them, "
            f"{usable_cores()} cores usable)"
            if not on_cuda
            else f"{torch.get_num_threads()} CPU threads (work on {device})",
        )

    def _attention(self, on_cuda: bool, dtype_name: str) -> str:
        attention = self.settings.qwen_attention
        if attention == "auto":  # flash-attn kernels exist for half precision on CUDA only
            half = dtype_name in ("bfloat16", "float16")
            attention = "flash_attention_2" if on_cuda and half and importlib.util.find_spec("flash_attn") else "sdpa"
        return attention

    def warmup(self) -> None:
        """One tiny generation of this checkpoint's mode, so the first job pays no first-call costs."""
        kwargs: dict[str, Any] = {"max_new_tokens": 4}
        with self._torch.inference_mode():
            if self.mode == "voice_design":
                self._tts.generate_voice_design(text=["Warm up."], instruct=[""], language=["auto"], **kwargs)
            elif self.mode == "custom_voice":
                self._tts.generate_custom_voice(
                    text=["Warm up."], speaker=[self.identity.speakers[0]], language=["auto"], **kwargs
                )
            else:
                rate = SAMPLE_RATE
                t = np.arange(rate, dtype=np.float32) / rate
                tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
                prompt = self._tts.create_voice_clone_prompt(ref_audio=[(tone, rate)], ref_text=["Warm up."])
                self._tts.generate_voice_clone(
                    text=["Warm up."], language=["auto"], voice_clone_prompt=prompt, **kwargs
                )

    def close(self) -> None:
        """Drop the model and give the device memory back."""
        self._tts = None
        self._prompts.clear()
        if self._torch is not None:
            release_device_memory(self._torch)

    # -- synthesis --------------------------------------------------------------------------------

    def synthesize_batch(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        """One padded ``generate`` for the rows that are servable; the others fail in their slots."""
        if self._tts is None:
            raise EngineError("qwen engine used before load()")
        outputs: list[EngineOutput | Exception | None] = [None] * len(requests)
        rows: list[int] = []
        voices: list[Any] = []
        for index, request in enumerate(requests):
            try:
                self.identity.check(request)
                if self.mode == "voice_clone":
                    voices.append(self._clone_prompt(request.reference))
                rows.append(index)
            except EngineOutOfMemory:
                raise  # the batcher splits the batch; a smaller one may leave room for the prompt
            except TTSQError as exc:
                outputs[index] = exc
        if rows:
            batch = [requests[i] for i in rows]
            for index, output in zip(rows, self._generate(batch, voices), strict=True):
                outputs[index] = output
        return [out if out is not None else EngineError("no output") for out in outputs]

    def _generate(self, batch: list[SynthesisRequest], voices: list[Any]) -> list[EngineOutput | Exception]:
        torch = self._torch
        caps = [
            min(r.max_new_tokens or frame_cap(r.text, self.settings.qwen_max_frames), self.settings.qwen_max_frames)
            for r in batch
        ]
        first = batch[0]  # the batch shares its sampling settings and seed (SynthesisRequest.group)
        sampling = {
            name: value
            for name, value in (
                ("temperature", first.temperature),
                ("top_p", first.top_p),
                ("top_k", first.top_k),
                ("repetition_penalty", first.repetition_penalty),
            )
            if value is not None
        }
        # HF generate yields one frame fewer than max_new_tokens for a row that never stops, so ask
        # for one more than the largest cap and cut every row to its own.
        kwargs: dict[str, Any] = {"max_new_tokens": max(caps) + 1, **sampling}
        # Each generate_* keeps qwen-tts's own non_streaming_mode default (True, but False for clones).
        out_of_memory = ""
        try:
            if first.seed is not None:
                torch.manual_seed(first.seed)
            with torch.inference_mode():
                wavs, rate = self._run_model(batch, voices, kwargs)
        except Exception as exc:
            if not is_out_of_memory(torch, exc):
                raise
            out_of_memory = f"out of device memory for a batch of {len(batch)}: {exc}"
        if out_of_memory:
            # Raised out here, with no traceback attached: the failed batch's frames (its KV cache and
            # activations) are released before the batcher retries the halves.
            release_device_memory(torch)
            raise EngineOutOfMemory(out_of_memory)
        return [
            self._output(request, np.asarray(wav, dtype=np.float32), int(rate), cap)
            for request, wav, cap in zip(batch, wavs, caps, strict=True)
        ]

    def _run_model(self, batch: list[SynthesisRequest], voices: list[Any], kwargs: dict[str, Any]) -> tuple[Any, int]:
        """One padded qwen-tts ``generate_*`` call for the batch: the device boundary."""
        texts = [r.text for r in batch]
        languages = [r.language for r in batch]
        if self.mode == "voice_design":
            return self._tts.generate_voice_design(  # type: ignore[no-any-return]
                text=texts, instruct=[r.instruct for r in batch], language=languages, **kwargs
            )
        if self.mode == "custom_voice":
            return self._tts.generate_custom_voice(  # type: ignore[no-any-return]
                text=texts,
                speaker=[r.speaker for r in batch],
                language=languages,
                instruct=[r.instruct for r in batch],
                **kwargs,
            )
        return self._tts.generate_voice_clone(  # type: ignore[no-any-return]
            text=texts, language=languages, voice_clone_prompt=voices, **kwargs
        )

    def _output(
        self, request: SynthesisRequest, wav: np.ndarray[Any, Any], rate: int, cap: int
    ) -> EngineOutput | Exception:
        limit = cap * self._samples_per_frame
        truncated = wav.size >= limit  # it ran to its cap without sampling its end token
        samples = wav[:limit]
        if samples.size == 0:
            return EngineError("the model ended before producing any audio")
        ignored = ("instruct",) if self.ignores_instruct and request.instruct else ()
        return EngineOutput(samples.astype(np.float32), rate, truncated=truncated, ignored=ignored)

    # -- voice cloning ----------------------------------------------------------------------------

    def _clone_prompt(self, reference: str) -> Any:
        """The clone prompt of a stored reference: computed once, then served from a bounded LRU."""
        if reference in self._prompts:
            self._prompts.move_to_end(reference)
            return self._prompts[reference]
        from ttsq.voices import load_voice

        voice = load_voice(self._open_storage(), reference)
        out_of_memory = ""
        try:
            prompt = self._compute_prompt(voice)
        except Exception as exc:
            if not is_out_of_memory(self._torch, exc):
                # The audio decoded fine (load_voice checked it): this is the model's failure, not the user's.
                raise EngineError(f"cannot make a voice prompt from {reference}: {type(exc).__name__}") from exc
            out_of_memory = f"out of device memory for a clone prompt: {exc}"
        if out_of_memory:
            release_device_memory(self._torch)
            raise EngineOutOfMemory(out_of_memory)
        self._prompts[reference] = prompt
        while len(self._prompts) > self.settings.qwen_clone_cache:
            self._prompts.popitem(last=False)
        self.prompts_computed += 1
        logger.info(
            "clone prompt computed for %s (%.1fs of reference audio)", reference, voice.samples.size / voice.sample_rate
        )
        return prompt

    def _compute_prompt(self, voice: Voice) -> Any:
        # Always an array and its rate: a string would be fetched as a URL or decoded as base64.
        with self._torch.inference_mode():
            items = self._tts.create_voice_clone_prompt(
                ref_audio=[(voice.samples, voice.sample_rate)],
                ref_text=[voice.transcript or None],
                x_vector_only_mode=[not voice.transcript],
            )
        return items[0]

    def _open_storage(self) -> Storage:
        if self._storage is None:
            from ttsq.storage import open_storage

            self._storage = open_storage(self.settings)
        return self._storage


def checkpoint_revision(path: Path) -> str:
    """What identifies the weights: the hub commit for a hub snapshot folder; otherwise a hash of the
    configs and of each weight file's name, size and bytes sampled at 16 evenly spaced places.

    Sampling reads about a megabyte per file instead of gigabytes at every start-up, and still tells
    apart two checkpoints of one architecture (a fine-tune changes the bytes everywhere). Copies of
    one folder on different hosts get the same revision, so they share cached audio.
    """
    snapshot = _HUB_SNAPSHOT.search(path.resolve().as_posix())
    if snapshot:
        return snapshot.group(1)
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        if file.suffix == ".json":
            digest.update(relative.encode() + b"\0" + file.read_bytes() + b"\0")
        elif file.suffix in _WEIGHT_SUFFIXES:
            size = file.stat().st_size
            digest.update(f"{relative}\0{size}\0".encode())
            with file.open("rb") as weights:
                for place in range(_SAMPLES_PER_FILE):
                    weights.seek(size * place // _SAMPLES_PER_FILE)
                    digest.update(weights.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _model_name(path: Path) -> str:
    """The hub id for a hub cache folder (``models--Qwen--X/snapshots/<commit>``), else the folder name."""
    resolved = path.resolve()
    if _HUB_SNAPSHOT.search(resolved.as_posix()) and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent.name.removeprefix("models--").replace("--", "/")
    return resolved.name


def _checkpoint_folder(value: str) -> Path:
    if not value:
        raise ConfigError(
            "TTSQ_QWEN_MODEL",
            "is required for TTSQ_ENGINE=qwen: a local Qwen3-TTS checkpoint folder (workers never download weights)",
        )
    path = Path(value).expanduser()
    if not (path / "config.json").is_file():
        raise ConfigError("TTSQ_QWEN_MODEL", f"{value} is not a checkpoint folder (no config.json)")
    if not (path / "speech_tokenizer" / "config.json").is_file():
        raise ConfigError("TTSQ_QWEN_MODEL", f"{value} has no speech_tokenizer/ (the 12 Hz codec)")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError("TTSQ_QWEN_MODEL", f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError("TTSQ_QWEN_MODEL", f"{path} is not a JSON object")
    return data


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def torch_threads(configured: int, callers: int) -> int:
    """Intra-op threads for each of ``callers`` threads that run torch at once on a CPU.

    Every thread that runs a torch operation gets its own OpenMP team of this size. torch's default
    is every core for each team, so a second torch thread (qwen-fast's codec) oversubscribes the
    machine: a small ``linear`` was measured 6x slower on 2 cores once one had run. The cores are
    shared out instead; ``TTSQ_TORCH_THREADS`` overrides.
    """
    if configured:
        return configured
    return max(1, usable_cores() // max(1, callers))


def release_device_memory(torch: Any) -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def is_out_of_memory(torch: Any, exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    # The CPU allocator raises a plain RuntimeError.
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
