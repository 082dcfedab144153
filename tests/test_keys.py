from __future__ import annotations

import subprocess
import sys

import pytest

from ttsq.engines.base import EngineIdentity
from ttsq.job import SynthesisRequest
from ttsq.keys import content_key, object_key

IDENTITY = EngineIdentity(engine="espeak", model="espeak-ng", revision="1.52.0", sample_rate=22050)
REQUEST = {
    "text": "안녕하세요. 오늘 날씨가 좋네요.",
    "language": "korean",
    "instruct": "차분하고 따뜻한 30대 여성 목소리",
    "seed": 7,
    "format": "wav",
}
# Pinned: if this changes, every cached object in every deployment is orphaned. Bump
# KEY_SCHEMA_VERSION on purpose instead, and update this literal in the same commit.
PINNED = "db3d4d8c3187c98dff61f6fe1ac69f952975568aa49efc597544c2074469bf8d"


def key_of(**changes: object) -> str:
    return content_key(SynthesisRequest.from_dict({**REQUEST, **changes}), IDENTITY)


def test_key_of_a_fixed_request_is_pinned() -> None:
    assert key_of() == PINNED


def test_key_is_the_same_in_another_process_with_another_hash_seed() -> None:
    from pathlib import Path

    code = "from tests.test_keys import key_of; print(key_of())"
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).parent.parent,
        )
        assert out.stdout.strip() == PINNED


def other_pythons() -> list[str]:
    """Other CPython 3.10+ interpreters on this machine (pyenv's, or python3.X on PATH)."""
    import shutil
    from pathlib import Path

    found = {str(p) for p in Path.home().glob(".pyenv/versions/3.1[0-9]*/bin/python3")}
    found |= {w for v in range(10, 16) if (w := shutil.which(f"python3.{v}"))}
    mine = sys.version_info[:2]
    return sorted(
        p
        for p in found
        if subprocess.run(
            [p, "-c", f"import sys; print(sys.version_info[:2] >= (3, 10) and sys.version_info[:2] != {mine!r})"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        == "True"
    )


def test_key_is_the_same_on_other_python_versions() -> None:
    """keys.py and request.py use only the standard library, so any CPython 3.10+ can check the pin."""
    interpreters = other_pythons()
    if not interpreters:  # the project's machines carry pyenv's 3.10, 3.12 and 3.13; others may not
        pytest.skip("no other CPython 3.10+ on this machine to compare with")
    from pathlib import Path

    root = str(Path(__file__).parent.parent)
    code = (
        f"import sys; sys.path.insert(0, {root!r})\n"
        "from types import SimpleNamespace\n"
        "from ttsq.keys import content_key\n"
        "from ttsq.job import SynthesisRequest\n"
        f"identity = SimpleNamespace(engine='espeak', model='espeak-ng', revision='1.52.0', sample_rate=22050)\n"
        f"print(content_key(SynthesisRequest.from_dict({REQUEST!r}), identity))\n"
    )
    for python in interpreters:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == PINNED, python


def test_key_ignores_spelling_that_does_not_change_the_audio() -> None:
    assert key_of(text="  안녕하세요.\n 오늘   날씨가 좋네요. ") == PINNED
    assert key_of(language="ko") == PINNED
    # NFD-composed Hangul normalizes to the same NFC text
    import unicodedata

    assert key_of(text=unicodedata.normalize("NFD", REQUEST["text"])) == PINNED  # type: ignore[arg-type]


def test_everything_that_shapes_the_audio_changes_the_key() -> None:
    variants = {
        key_of(text="다른 문장입니다."),
        key_of(language="english"),
        key_of(instruct="낮은 남성 목소리"),
        key_of(seed=8),
        key_of(format="flac"),
        key_of(temperature=0.5),
        key_of(max_new_tokens=100),
    }
    other_model = content_key(
        SynthesisRequest.from_dict(REQUEST),
        EngineIdentity(engine="espeak", model="espeak-ng", revision="1.53.0", sample_rate=22050),
    )
    assert len(variants | {other_model, PINNED}) == 9


def test_object_key_carries_the_extension() -> None:
    assert object_key(PINNED, "mp3") == f"audio/db/{PINNED}.mp3"
