"""The qwen engine on tiny random-weight checkpoints: the real qwen-tts load, generate and decode path.

Random weights almost never sample the end token, so every row runs to its frame cap: the tests can
predict each output's length exactly, and a seed makes them deterministic.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile
from faulty_qwen import OutOfMemoryQwen

from ttsq.batching.batcher import Batcher
from ttsq.batching.batches import length_bucket
from ttsq.config import Settings
from ttsq.engines.base import EngineOutput, frame_cap
from ttsq.engines.qwen.engine import QwenEngine, checkpoint_revision
from ttsq.errors import ConfigError, InvalidRequest
from ttsq.job import SynthesisRequest
from ttsq.storage import LocalStorage
from ttsq.voices import add_voice
from ttsq.worker.metrics import Metrics

#: Whole-file: real engines or processes, minutes on two cores; `pytest -m "not slow"` skips it.
pytestmark = pytest.mark.slow

SAMPLES_PER_FRAME = 1920  # 24 kHz / 12.5 frames per second


def request(text: str, **fields: object) -> SynthesisRequest:
    return SynthesisRequest.from_dict({"text": text, **fields})


def loaded(model: Path, **settings: object) -> QwenEngine:
    engine = QwenEngine(Settings(engine="qwen", qwen_model=str(model), **settings))  # type: ignore[arg-type]
    engine.load()
    return engine


@pytest.fixture(scope="module")
def design(qwen_checkpoints: dict[str, Path]) -> Iterator[QwenEngine]:
    engine = loaded(qwen_checkpoints["voice_design"], qwen_max_frames=64)
    engine.warmup()
    yield engine
    engine.close()


def output(item: EngineOutput | Exception) -> EngineOutput:
    assert isinstance(item, EngineOutput), item
    return item


def test_identity_names_the_mode_languages_speakers_and_revision(
    qwen_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    modes = {
        kind: QwenEngine(Settings(engine="qwen", qwen_model=str(path))).identity
        for kind, path in qwen_checkpoints.items()
    }
    assert modes["voice_design"].modes == ("voice_design",)
    assert modes["custom_voice"].modes == ("custom_voice",)
    assert modes["base"].modes == ("voice_clone",)
    assert modes["custom_voice"].speakers == ("ryan", "sohee", "vivian")
    assert "korean" in modes["voice_design"].languages and "auto" in modes["voice_design"].languages
    assert modes["voice_design"].sample_rate == 24_000

    # The revision is the checkpoint's, plus the frame-cap policy (it shapes truncated audio).
    original = checkpoint_revision(qwen_checkpoints["voice_design"])
    assert modes["voice_design"].revision == f"{original}.cap1-2048"
    assert (
        QwenEngine(
            Settings(engine="qwen", qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=512)
        ).identity.revision
        == f"{original}.cap1-512"
    )
    # A copy elsewhere is the same model; another config, or other weights of the same size, is not.
    copy = Path(shutil.copytree(qwen_checkpoints["voice_design"], tmp_path / "copy"))
    assert checkpoint_revision(copy) == original
    generation = json.loads((copy / "generation_config.json").read_text())
    (copy / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.5}))
    assert checkpoint_revision(copy) != original
    retrained = Path(shutil.copytree(qwen_checkpoints["voice_design"], tmp_path / "retrained"))
    weights = retrained / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 + 100] ^= 0xFF  # same size, other bytes (a fine-tune changes them everywhere)
    weights.write_bytes(bytes(data))
    assert checkpoint_revision(retrained) != original
    # A hub cache folder is named by its repository and commit.
    snapshot = tmp_path / "models--Qwen--Qwen3-TTS-12Hz-1.7B-VoiceDesign" / "snapshots" / ("ab" * 20)
    shutil.copytree(qwen_checkpoints["voice_design"], snapshot)
    hub = QwenEngine(Settings(engine="qwen", qwen_model=str(snapshot))).identity
    assert hub.model == "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign" and hub.revision == f"{'ab' * 20}.cap1-2048"


def test_a_folder_that_is_not_a_checkpoint_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"TTSQ_QWEN_MODEL: .* is not a checkpoint folder"):
        QwenEngine(Settings(engine="qwen", qwen_model=str(tmp_path)))
    (tmp_path / "config.json").write_text('{"tts_model_type": "llm"}')
    (tmp_path / "speech_tokenizer").mkdir()
    (tmp_path / "speech_tokenizer" / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a Qwen3-TTS checkpoint"):
        QwenEngine(Settings(engine="qwen", qwen_model=str(tmp_path)))


def test_mixed_lengths_share_a_batch_and_each_is_cut_to_its_own_cap(design: QwenEngine) -> None:
    texts = ["Hi.", "A medium sentence.", "안녕하세요. 오늘은 날씨가 정말 좋네요."]
    outputs = [output(o) for o in design.synthesize_batch([request(t, seed=3) for t in texts])]
    caps = [frame_cap(t, 64) for t in texts]
    assert len(set(caps)) == 3 and caps[-1] == 64  # three different caps, the last one the hard cap
    for out, cap in zip(outputs, caps, strict=True):
        assert out.sample_rate == 24_000
        # Random weights never stop on their own: every row ran to its own cap, and says so.
        assert out.samples.size == cap * SAMPLES_PER_FRAME
        assert out.truncated
        assert np.abs(out.samples).max() > 0.01


def test_an_explicit_max_new_tokens_caps_the_item_and_the_hard_cap_caps_everything(design: QwenEngine) -> None:
    long_text = "Hello there, friend, how are you doing today?"
    assert frame_cap(long_text, 10_000) > 64
    short, long, refused = design.synthesize_batch(
        [
            request("Hello there, friend.", max_new_tokens=10, seed=1),
            request(long_text, seed=1),
            request("Hello there, friend.", max_new_tokens=65, seed=1),
        ]
    )
    assert output(short).samples.size == 10 * SAMPLES_PER_FRAME
    assert output(long).samples.size == 64 * SAMPLES_PER_FRAME  # TTSQ_QWEN_MAX_FRAMES of this engine
    assert isinstance(refused, InvalidRequest) and refused.field == "max_new_tokens"  # above the hard cap


def test_same_seed_same_batch_is_reproducible_and_batching_changes_sampled_rows(design: QwenEngine) -> None:
    """What holds on a CPU, measured (docs/qwen.md, "Reproducibility", quotes it)."""
    a = request("Hello there.", seed=7, max_new_tokens=12)
    b = request("A second, longer sentence for the batch.", seed=7, max_new_tokens=12)
    first = [output(o).samples for o in design.synthesize_batch([a, b])]
    again = [output(o).samples for o in design.synthesize_batch([a, b])]
    assert all(np.array_equal(x, y) for x, y in zip(first, again, strict=True))
    alone_output = output(design.synthesize_batch([a])[0])
    alone = alone_output.samples
    # Length and the truncated flag do not depend on the batch: each row has its own cap.
    assert alone.size == first[0].size and alone_output.truncated
    # Rows of one call draw from one random stream: a sampled row depends on its neighbours.
    same = float(np.mean(alone == first[0]))
    print(f"sampled row alone vs in a batch of 2: {same:.1%} of samples equal")
    assert not np.array_equal(alone, first[0])

    # Greedy decoding (the package's do_sample=False): batching changes nothing but float rounding.
    texts = ["Hello there.", "A second, longer sentence for the batch."]
    greedy = {"do_sample": False, "subtalker_dosample": False, "max_new_tokens": 12}
    batched, _ = design._tts.generate_voice_design(text=texts, instruct=["", ""], language=["auto"] * 2, **greedy)
    for text, row in zip(texts, batched, strict=True):
        single, _ = design._tts.generate_voice_design(text=[text], instruct=[""], language=["auto"], **greedy)
        difference = float(np.max(np.abs(row - single[0])))
        print(f"greedy row alone vs batched: max abs difference {difference:.2e}")
        assert row.shape == single[0].shape and difference < 1e-4


def test_out_of_memory_splits_the_batch_and_remembers_what_fits(qwen_checkpoints: dict[str, Path]) -> None:
    # The test engine raises torch's real OutOfMemoryError at the device boundary for any batch above
    # 2, the way a full GPU would; the batcher must split and finish every job.
    engine = OutOfMemoryQwen(
        Settings(engine="qwen", qwen_model=str(qwen_checkpoints["voice_design"]), qwen_max_frames=24)
    )
    metrics = Metrics(node="oom@test")
    batcher = Batcher(engine, max_batch=8, max_wait_s=0.5, observer=metrics)
    batcher.start()
    try:
        jobs = [request(f"Sentence number {i}.", seed=5) for i in range(8)]
        items = [future.result(120) for future in [batcher.submit(job) for job in jobs]]
        assert all(item.output.samples.size > 0 for item in items)
        # They arrived as one batch of 8, which ran as halves, then quarters, which fit; each job reports
        # the engine call it really rode in.
        assert [item.batch_size for item in items] == [2] * 8
        bucket = length_bucket(jobs)
        assert batcher.scheduler.largest_fit == {bucket: 2}  # type: ignore[attr-defined]
        splits = batcher.scheduler.oom_splits  # type: ignore[attr-defined]
        # 8 -> 4 + 4; the first 4 -> 2 + 2; the second 4 is already cut to 2 + 2 before it runs.
        assert splits == 2
        assert metrics.registry.get_sample_value("ttsq_oom_splits_total") == 2  # what Prometheus sees

        # The next batch of similar texts is cut to the size that fits up front: no new failure.
        again = [batcher.submit(request(f"Sentence number {i}!", seed=6)) for i in range(8)]
        assert all(future.result(120).output.samples.size > 0 for future in again)
        assert batcher.scheduler.oom_splits == splits  # type: ignore[attr-defined]
    finally:
        batcher.stop()


def test_custom_voice_checks_speakers_per_item_and_reports_an_ignored_instruct(
    qwen_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    engine = loaded(qwen_checkpoints["custom_voice"], qwen_max_frames=16)
    good, bad = engine.synthesize_batch(
        [
            request("안녕하세요.", mode="custom_voice", speaker="Sohee", language="korean", instruct="밝게"),
            request("Hello.", mode="custom_voice", speaker="nobody"),
        ]
    )
    assert output(good).ignored == ()  # the 1.7B CustomVoice follows an instruct
    assert isinstance(bad, InvalidRequest) and bad.field == "speaker"
    engine.close()

    # The 0.6B CustomVoice drops an instruct (qwen-tts does it silently): the result says so.
    small = Path(shutil.copytree(qwen_checkpoints["custom_voice"], tmp_path / "small"))
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "tts_model_size": "0b6"}))
    engine = loaded(small, qwen_max_frames=16)
    with_instruct, without = engine.synthesize_batch(
        [
            request("Hello.", mode="custom_voice", speaker="ryan", instruct="whisper"),
            request("Hello.", mode="custom_voice", speaker="ryan"),
        ]
    )
    assert output(with_instruct).ignored == ("instruct",)
    assert output(without).ignored == ()
    engine.close()


def reference_wav(seconds: float = 2.0, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    voice = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    buffer = io.BytesIO()
    soundfile.write(buffer, voice.astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


def test_voice_clone_loads_the_reference_itself_and_computes_its_prompt_once(
    qwen_checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    storage_url = str(tmp_path / "store")
    storage = LocalStorage(storage_url)
    voice = add_voice(storage, reference_wav(1.5), "This is my reference voice.")
    plain = add_voice(storage, reference_wav(1.2), "")  # no transcript: speaker embedding only
    assert voice.startswith("voices/") and voice != plain
    garbage = "voices/" + "0" * 64 + ".wav"
    storage.put(garbage, b"this is not audio at all", "audio/wav")

    engine = loaded(qwen_checkpoints["base"], qwen_max_frames=16, storage_url=storage_url, qwen_clone_cache=1)
    clone = {"mode": "voice_clone", "seed": 2}
    outputs = engine.synthesize_batch(
        [
            request("First line.", reference=voice, **clone),
            request("Second line.", reference=voice, **clone),
            request("Third.", reference="voices/" + "1" * 64 + ".wav", **clone),
            request("Fourth.", reference=garbage, **clone),
            request("Fifth.", reference=plain, **clone),
        ]
    )
    assert [type(o).__name__ for o in outputs] == [
        "EngineOutput",
        "EngineOutput",
        "InvalidRequest",
        "InvalidRequest",
        "EngineOutput",
    ]
    missing, not_audio = outputs[2], outputs[3]
    assert isinstance(missing, InvalidRequest) and "no voice" in str(missing)
    assert isinstance(not_audio, InvalidRequest) and "not audio" in str(not_audio)
    assert engine.prompts_computed == 2  # one per reference, not one per job

    # The cache holds one prompt here (TTSQ_QWEN_CLONE_CACHE=1): the newest stays, the oldest is dropped.
    engine.synthesize_batch([request("Again.", reference=plain, **clone)])
    assert engine.prompts_computed == 2
    engine.synthesize_batch([request("Again.", reference=voice, **clone)])
    assert engine.prompts_computed == 3
    engine.close()
