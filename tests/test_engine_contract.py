"""One contract, every engine: espeak, qwen (all three checkpoint kinds), qwen-fast, the GPU stand-in and a
plug-in engine.

The same tests run on each engine ttsq ships and on one loaded through the ``package.module:Factory``
plug-in point, so a new engine proves it keeps the protocol the batcher and the workers rely on
(``ttsq/engines/base.py``): an identity that is stable, serializable and refuses what the engine
cannot serve, naming the field; one output per request, in order, a bad row failing alone; the frame
cap and the ``truncated`` flag; ``close``; and, for a ``ContinuousEngine``, its slot protocol.

Every engine is built by ``create_engine(Settings(...))`` (the registry or the plug-in path), then
loaded and warmed up as a worker does. The qwen engines run the tiny random-weight checkpoints of
``conftest.qwen_checkpoints`` on the CPU: random weights never sample the end token, so every row runs
to its frame cap and its length is known exactly; the tests keep the caps small to bound the CPU time.

To run the contract on an engine of your own: ``CONTRACT_ENGINE=package.module:Factory pytest
tests/test_engine_contract.py -k package.module`` (comma-separated for several). The factory gets the
settings a worker would (``TTSQ_*`` from the environment), with a scratch storage folder.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile

from ttsq.config import Settings
from ttsq.engines import create_engine
from ttsq.engines.base import FRAMES_PER_SECOND, Engine, EngineIdentity, EngineOutput, is_continuous
from ttsq.errors import EngineError, InvalidRequest
from ttsq.job import LANGUAGES, MODES, SynthesisRequest
from ttsq.storage import LocalStorage
from ttsq.voices import add_voice

#: Frames per item for the qwen engines (TTSQ_QWEN_MAX_FRAMES): small, since on a CPU the codec decode
#: of each frame is most of the cost.
QWEN_FRAMES = 16
#: Long enough that a few frames never hold it all (about a second and a half each, read by espeak),
#: short enough for the 16-frame (1.3 s) model limit, which refuses what would need over 2.6 s read slowly.
TEXTS = ("The quick brown fox jumps.", "A second line, in order.", "The third line, at last.")
#: Each short enough for that limit too.
SENTENCES = {
    "auto": "오늘 날씨 좋네요.",
    "chinese": "今天天气很好。",
    "english": "The weather is nice today.",
    "japanese": "こんにちは。",
    "korean": "안녕하세요.",
    "german": "Heute ist schönes Wetter.",
    "french": "Il fait beau aujourd'hui.",
    "russian": "Сегодня хорошая погода.",
    "portuguese": "Hoje o tempo está bom.",
    "spanish": "Hoy hace buen tiempo.",
    "italian": "Oggi fa bel tempo.",
}
#: The languages a costly engine is tried in (every announced language on a cheap one).
SAMPLED_LANGUAGES = ("auto", "english", "korean", "chinese")
#: A request of each mode, for an engine that serves another (its identity refuses it before any lookup).
OTHER_MODE = {
    "voice_design": {},
    "custom_voice": {"mode": "custom_voice", "speaker": "vivian"},
    "voice_clone": {"mode": "voice_clone", "reference": "voices/" + "0" * 64 + ".wav"},
}
REQUEST_FIELDS = frozenset(f.name for f in fields(SynthesisRequest))


@dataclass(frozen=True)
class Spec:
    """How to build one engine under test."""

    #: Settings for ``create_engine``: (the checkpoint folder, or None; a storage folder) -> Settings.
    settings: Callable[[Path | None, str], Settings]
    checkpoint: str = ""
    #: Loading costs seconds: one engine per module instead of one per test.
    costly: bool = False
    #: A text this engine cannot speak, whose row must fail alone (None: every text is speakable).
    unspeakable: str | None = None
    #: The request fields it cannot honour, which its outputs must name in ``ignored`` (None: unknown).
    ignores: frozenset[str] | None = frozenset()


def _qwen(engine: str, **extra: Any) -> Callable[[Path | None, str], Settings]:
    return lambda checkpoint, store: Settings(
        engine=engine, qwen_model=str(checkpoint), qwen_max_frames=QWEN_FRAMES, storage_url=store, **extra
    )


def _plugin(path: str, *, from_env: bool = False) -> Callable[[Path | None, str], Settings]:
    if from_env:  # an engine of your own reads its settings (TTSQ_*) from the environment, as a worker does
        return lambda _, store: Settings.from_env(engine=path, storage_url=store)
    return lambda _, store: Settings(engine=path, storage_url=store)


#: espeak follows neither a voice description nor sampling settings.
ESPEAK_IGNORES = frozenset({"instruct", "seed", "temperature", "top_p", "top_k", "repetition_penalty"})

SPECS: dict[str, Spec] = {
    "espeak": Spec(lambda _, store: Settings(storage_url=store), unspeakable="...", ignores=ESPEAK_IGNORES),
    "qwen": Spec(_qwen("qwen"), checkpoint="voice_design", costly=True),
    "qwen-custom_voice": Spec(_qwen("qwen"), checkpoint="custom_voice", costly=True),
    # qwen-tts's generate_voice_clone takes no instruct: a clone cannot follow one.
    "qwen-voice_clone": Spec(_qwen("qwen"), checkpoint="base", costly=True, ignores=frozenset({"instruct"})),
    "qwen-fast": Spec(_qwen("qwen-fast", max_batch=4), checkpoint="voice_design", costly=True),
    # The GPU stand-in of the benchmarks (ttsq.testing.standin), at no device cost so the tests stay short.
    "standin": Spec(
        lambda _, store: Settings(engine="standin", standin_a_us=0, standin_b_us=0, storage_url=store),
        unspeakable="...",
        ignores=ESPEAK_IGNORES,
    ),
    # The fault-injecting test engine, through the plug-in point; no fault is cued here.
    "plugin": Spec(_plugin("faulty_engine:FaultyEngine"), unspeakable="...", ignores=ESPEAK_IGNORES),
}
#: Engines of your own, through the plug-in point (see the module docstring).
EXTRA = [path.strip() for path in os.environ.get("CONTRACT_ENGINE", "").split(",") if path.strip()]
# Built afresh for each test: nothing is known of what they share within a process (espeak-based ones
# would take each other's synthesis callback if one were kept beside another).
SPECS.update({path: Spec(_plugin(path, from_env=True), ignores=None) for path in EXTRA})

#: Every engine ttsq ships, once, and the plug-ins.
CORE = ["espeak", "qwen", "qwen-fast", "standin", "plugin", *EXTRA]
#: Also the other checkpoint kinds, for what is about modes and speakers.
ALL_MODES = ["espeak", "qwen", "qwen-custom_voice", "qwen-voice_clone", "qwen-fast", "standin", "plugin", *EXTRA]
CONTINUOUS = ["qwen-fast", *EXTRA]


def on(names: list[str]) -> pytest.MarkDecorator:
    # The qwen engines load a checkpoint per case: the inner loop (``-m "not slow"``) keeps espeak and the plug-in.
    params = [pytest.param(name, marks=pytest.mark.slow) if SPECS[name].costly else name for name in names]
    return pytest.mark.parametrize("subject", params, indirect=True)


@dataclass
class Subject:
    """One engine under test, loaded and warmed up, and how to make requests of the mode it serves."""

    name: str
    spec: Spec
    settings: Settings
    engine: Engine
    #: A stored reference voice, for an engine that serves voice_clone.
    reference: str
    closed: bool = False

    @property
    def identity(self) -> EngineIdentity:
        return self.engine.identity

    def fields(self) -> dict[str, Any]:
        """The request fields of the (first) mode this engine serves."""
        mode = self.identity.modes[0]
        if mode == "custom_voice":
            return {"mode": mode, "speaker": self.identity.speakers[0]}
        if mode == "voice_clone":
            return {"mode": mode, "reference": self.reference}
        return {"mode": mode}

    def request(self, text: str, **extra: Any) -> SynthesisRequest:
        return SynthesisRequest.from_dict({"text": text, **self.fields(), **extra})

    def build(self) -> Engine:
        """Another engine from the same settings, as on another worker (not loaded)."""
        return create_engine(self.settings)


class Pool:
    """The module's engines: costly ones built once and kept, cheap ones built for each test.

    An espeak engine is never kept beside another: libespeak-ng is one per process, and a second
    engine's ``load`` takes its synthesis callback from the first."""

    def __init__(self, request: pytest.FixtureRequest, folder: Path) -> None:
        self._request = request
        self.store = str(folder / "store")
        # No transcript: the clone prompt is the speaker embedding alone. With one, the reference's codes
        # are decoded again in front of every clip (tests/test_engine_qwen.py covers that path).
        self.reference = add_voice(LocalStorage(self.store), reference_wav(), "")
        self.kept: dict[str, Subject] = {}

    def subject(self, name: str) -> Subject:
        spec = SPECS[name]
        if spec.costly and name in self.kept and not self.kept[name].closed:
            return self.kept[name]
        checkpoint = None
        if spec.checkpoint:
            pytest.importorskip("qwen_tts")
            checkpoint = self._request.getfixturevalue("qwen_checkpoints")[spec.checkpoint]
        settings = spec.settings(checkpoint, self.store)
        engine = create_engine(settings)
        engine.load()
        engine.warmup()
        subject = Subject(name, spec, settings, engine, self.reference)
        if spec.costly:
            self.kept[name] = subject
        return subject

    def close(self) -> None:
        for subject in self.kept.values():
            if not subject.closed:
                subject.engine.close()


def reference_wav(seconds: float = 1.5, rate: int = 16_000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    voice = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))
    buffer = io.BytesIO()
    soundfile.write(buffer, voice.astype(np.float32), rate, format="WAV")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def pool(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    engines = Pool(request, tmp_path_factory.mktemp("contract"))
    yield engines
    engines.close()


@pytest.fixture
def subject(request: pytest.FixtureRequest, pool: Pool) -> Iterator[Subject]:
    subject = pool.subject(request.param)
    yield subject
    if not subject.spec.costly and not subject.closed:
        subject.engine.close()


def frames_of_audio(frames: int, sample_rate: int) -> float:
    """How many samples ``frames`` codec frames (12.5 per second, what ``max_new_tokens`` counts) last."""
    return frames / FRAMES_PER_SECOND * sample_rate


def assert_output(identity: EngineIdentity, item: EngineOutput | Exception, request: SynthesisRequest) -> EngineOutput:
    """What every output must be: 1-D audio at the identity's rate, flags of the right types."""
    assert isinstance(item, EngineOutput), f"expected an EngineOutput, got {item!r}"
    samples = item.samples
    assert isinstance(samples, np.ndarray) and samples.ndim == 1, samples.shape
    assert samples.dtype in (np.float32, np.int16), samples.dtype
    if samples.dtype == np.float32:
        assert np.all(np.isfinite(samples)) and float(np.abs(samples).max(initial=0.0)) <= 1.0
    assert samples.size > 0 and np.any(samples != 0), "silent or empty audio"
    assert item.sample_rate == identity.sample_rate
    assert type(item.truncated) is bool, type(item.truncated)
    assert isinstance(item.ignored, tuple) and all(isinstance(name, str) for name in item.ignored)
    assert len(set(item.ignored)) == len(item.ignored), item.ignored
    for name in item.ignored:  # only fields the request really set can have been ignored
        assert name in REQUEST_FIELDS, name
        assert getattr(request, name) not in (None, ""), f"{name} reported ignored but was not set"
    return item


def refusals(subject: Subject) -> list[tuple[str, dict[str, Any]]]:
    """(field, request fields) of requests this engine's identity says it cannot serve."""
    identity = subject.identity
    cases: list[tuple[str, dict[str, Any]]] = []
    other = next((mode for mode in MODES if mode not in identity.modes), None)
    if other is not None:
        cases.append(("mode", OTHER_MODE[other]))
    unspoken = next((lang for lang in LANGUAGES if identity.languages and lang not in identity.languages), None)
    if unspoken is not None:
        cases.append(("language", {**subject.fields(), "language": unspoken}))
    if "custom_voice" in identity.modes:
        cases.append(("speaker", {"mode": "custom_voice", "speaker": "nobody-at-all"}))
    if identity.max_frames:
        cases.append(("max_new_tokens", {**subject.fields(), "max_new_tokens": identity.max_frames + 1}))
    return cases


# -- 1. identity -----------------------------------------------------------------------------------


@on(ALL_MODES)
def test_identity_is_complete_serializable_and_stable(subject: Subject) -> None:
    identity = subject.identity
    for name in ("engine", "model", "revision"):
        value = getattr(identity, name)
        assert isinstance(value, str) and value.strip(), f"identity.{name} is {value!r}"
    assert isinstance(identity.sample_rate, int) and identity.sample_rate > 0
    assert identity.modes and set(identity.modes) <= set(MODES), identity.modes
    assert set(identity.languages) <= set(LANGUAGES), identity.languages
    if "custom_voice" in identity.modes:
        assert identity.speakers, "a custom_voice engine must name its speakers"
    assert all(speaker == speaker.lower() for speaker in identity.speakers)  # requests lowercase them
    assert identity.max_frames >= 0 and identity.max_prompt_bytes >= 0

    # Workers publish it as JSON in Redis; producers read it back to predict content keys.
    published = EngineIdentity.from_dict(json.loads(json.dumps(identity.to_dict())))
    assert published == identity
    # Two workers with the same settings build the same identity (the loaded one: see test_close_...).
    assert subject.build().identity == subject.build().identity


@on(ALL_MODES)
def test_identity_check_accepts_what_the_engine_serves_and_names_the_field_it_refuses(subject: Subject) -> None:
    published = EngineIdentity.from_dict(subject.identity.to_dict())
    published.check(subject.request(TEXTS[0]))
    published.check(subject.request(TEXTS[0], max_new_tokens=3, seed=1))
    cases = refusals(subject)
    if not cases:
        pytest.skip("this engine serves every mode and language, and has no frame cap")
    for name, extra in cases:
        with pytest.raises(InvalidRequest) as refused:
            published.check(SynthesisRequest.from_dict({"text": TEXTS[0], **extra}))
        assert refused.value.field == name, (name, str(refused.value))


# -- 2. languages ----------------------------------------------------------------------------------


@on(CORE)
def test_every_announced_language_speaks(subject: Subject) -> None:
    announced = subject.identity.languages or SAMPLED_LANGUAGES
    languages = [lang for lang in (announced if not subject.spec.costly else SAMPLED_LANGUAGES) if lang in announced]
    assert languages
    requests = [subject.request(SENTENCES[lang], language=lang, max_new_tokens=2, seed=1) for lang in languages]
    outputs = subject.engine.synthesize_batch(requests)
    assert len(outputs) == len(requests)
    for lang, request, item in zip(languages, requests, outputs, strict=True):
        assert isinstance(item, EngineOutput), f"{lang}: {item!r}"
        assert_output(subject.identity, item, request)


# -- 3. batch shapes and order ---------------------------------------------------------------------


@on(ALL_MODES)
@pytest.mark.parametrize("size", [1, 3])
def test_a_batch_gives_one_output_per_request_in_order(subject: Subject, size: int) -> None:
    caps = [3, 2, 5][:size]  # each row its own frame cap: their lengths tell the rows apart
    requests = [
        subject.request(text, max_new_tokens=cap, seed=1, **({"instruct": "A calm voice."} if i == 1 else {}))
        for i, (text, cap) in enumerate(zip(TEXTS, caps, strict=False))
    ]
    outputs = subject.engine.synthesize_batch(requests)
    assert isinstance(outputs, list) and len(outputs) == size
    rate = subject.identity.sample_rate
    for request, item, cap in zip(requests, outputs, caps, strict=True):
        out = assert_output(subject.identity, item, request)
        # A few frames never hold the whole sentence: every row was cut at exactly its own cap.
        assert out.truncated
        assert out.samples.size == pytest.approx(frames_of_audio(cap, rate), abs=1)


@on(["espeak", "qwen", "qwen-custom_voice", "qwen-voice_clone", "qwen-fast", "standin", "plugin", *EXTRA])
def test_ignored_names_exactly_the_fields_the_engine_cannot_honour(subject: Subject) -> None:
    request = subject.request(
        TEXTS[0], instruct="A calm, low voice.", seed=4, temperature=0.9, top_k=50, max_new_tokens=2
    )
    (item,) = subject.engine.synthesize_batch([request])
    out = assert_output(subject.identity, item, request)
    if subject.spec.ignores is None:
        pytest.skip("what this engine cannot honour is not known here; only checked that ignored names set fields")
    assert set(out.ignored) == {name for name in subject.spec.ignores if getattr(request, name) not in (None, "")}


# -- 4. a bad row fails alone ----------------------------------------------------------------------


@on(ALL_MODES)
def test_a_row_the_engine_cannot_serve_fails_alone_in_its_slot(subject: Subject) -> None:
    bad = [(name, SynthesisRequest.from_dict({"text": "Hello there.", **extra})) for name, extra in refusals(subject)]
    if subject.identity.modes[0] == "voice_clone":  # a reference that is not in storage
        bad.append(("reference", subject.request("Hello there.", reference="voices/" + "1" * 64 + ".wav")))
    if subject.spec.unspeakable is not None:
        # The edge refuses a text with nothing to speak; an engine handed one anyway (a bug upstream)
        # must still fail only that row.
        bad.append(("", dataclasses.replace(subject.request("x"), text=subject.spec.unspeakable)))
    assert bad, "no request to refuse"
    good = [subject.request(TEXTS[0], max_new_tokens=2, seed=1), subject.request(TEXTS[1], max_new_tokens=3, seed=1)]
    batch = [good[0], *(request for _, request in bad), good[1]]
    outputs = subject.engine.synthesize_batch(batch)
    assert len(outputs) == len(batch)
    rate = subject.identity.sample_rate
    for request, item, frames in ((good[0], outputs[0], 2), (good[1], outputs[-1], 3)):
        out = assert_output(subject.identity, item, request)
        assert out.samples.size == pytest.approx(frames_of_audio(frames, rate), abs=1)
    for (name, _), item in zip(bad, outputs[1:-1], strict=True):
        assert isinstance(item, Exception), f"{name or 'unspeakable'} row: {item!r}"
        if name:
            assert isinstance(item, InvalidRequest) and item.field == name, (name, repr(item))


# -- 5. truncated ----------------------------------------------------------------------------------


@on(CORE)
def test_max_new_tokens_cuts_the_audio_and_says_so(subject: Subject) -> None:
    rate = subject.identity.sample_rate
    request = subject.request(TEXTS[0], max_new_tokens=4, seed=2)
    (item,) = subject.engine.synthesize_batch([request])
    out = assert_output(subject.identity, item, request)
    assert out.truncated is True
    assert out.samples.size == pytest.approx(frames_of_audio(4, rate), abs=1)  # 4 frames of 12.5 Hz audio


@on(CORE)
def test_without_max_new_tokens_the_engines_own_cap_bounds_the_audio(subject: Subject) -> None:
    request = subject.request("Hi there.", seed=2)
    (item,) = subject.engine.synthesize_batch([request])
    out = assert_output(subject.identity, item, request)
    identity = subject.identity
    if identity.max_frames == 0:
        assert out.truncated is False  # no frame cap: nothing to cut
    else:
        limit = frames_of_audio(identity.max_frames, identity.sample_rate)
        assert out.samples.size <= limit + 1
        if out.truncated:  # cut at a whole frame (random weights always are)
            frames = out.samples.size / identity.sample_rate * FRAMES_PER_SECOND
            assert frames == pytest.approx(round(frames), abs=1e-3), frames


# -- 7. the continuous protocol --------------------------------------------------------------------


class Recorder:
    """A ``done`` callback that records every call (it may come from the engine's decode thread)."""

    def __init__(self) -> None:
        self.calls: list[EngineOutput | Exception] = []
        self.event = threading.Event()

    def __call__(self, output: EngineOutput | Exception) -> None:
        self.calls.append(output)
        self.event.set()


@on(CONTINUOUS)
def test_a_continuous_engine_keeps_its_slot_protocol(subject: Subject) -> None:
    engine: Any = subject.engine
    if not is_continuous(engine):
        pytest.skip(f"{subject.name} is not a ContinuousEngine")
    slots = engine.free_slots()
    assert slots > 0 and engine.active == 0

    done = Recorder()
    engine.admit(subject.request(TEXTS[0], max_new_tokens=4, seed=3), done)
    assert engine.active == 1 and engine.free_slots() == slots - 1
    for _ in range(40):
        if not engine.active:
            break
        engine.step()
    assert engine.active == 0 and engine.free_slots() == slots
    assert done.event.wait(60), "done was never called"
    engine.step()  # nothing decoding: a no-op, and the finished request is not answered twice
    (output,) = done.calls
    out = assert_output(subject.identity, output, subject.request(TEXTS[0], max_new_tokens=4, seed=3))
    assert out.truncated and out.samples.size == pytest.approx(frames_of_audio(4, out.sample_rate), abs=1)
    assert engine.cancel(done) is False  # finished: nothing to cancel

    # Cancelling a request that is decoding frees its slot and answers it once, with an error.
    running = Recorder()
    engine.admit(subject.request(TEXTS[1], max_new_tokens=8, seed=3), running)
    engine.step()
    assert engine.active == 1
    assert engine.cancel(running) is True
    assert running.event.wait(60)
    assert engine.active == 0 and engine.free_slots() == slots
    assert engine.cancel(running) is False
    engine.step()
    (cancelled,) = running.calls
    assert isinstance(cancelled, Exception)

    # A request the engine refuses takes no slot; its done gets the refusal, naming the field.
    cases = refusals(subject)
    if not cases:
        return
    name, extra = cases[0]
    refused = Recorder()
    engine.admit(SynthesisRequest.from_dict({"text": "Hello there.", **extra}), refused)
    assert refused.event.wait(60)
    assert engine.active == 0 and engine.free_slots() == slots
    (failure,) = refused.calls
    assert isinstance(failure, InvalidRequest) and failure.field == name


# -- 6. close (last: it closes the module's engine) -------------------------------------------------


@on(CORE)
def test_close_releases_the_model_and_a_fresh_engine_loads_again(subject: Subject) -> None:
    engine = subject.engine
    identity = engine.identity
    request = subject.request(TEXTS[0], max_new_tokens=2, seed=1)
    subject.closed = True  # the pool builds a new one if a later test needs this engine
    engine.close()
    with pytest.raises(EngineError):
        engine.synthesize_batch([request])
    engine.close()  # twice: no error

    # Another worker with the same settings: it loads after this one closed, and announces the same
    # identity, so both compute the same content keys.
    fresh = subject.build()
    fresh.load()
    try:
        assert fresh.identity == identity
        (item,) = fresh.synthesize_batch([request])  # no warmup: it only saves the first job time
        assert_output(fresh.identity, item, request)
    finally:
        fresh.close()
