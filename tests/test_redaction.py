from __future__ import annotations

from ttsq.redaction import describe_kwargs, redact_result, redact_url


def test_redact_url() -> None:
    assert redact_url("redis://user:pw@host:6379/0") == "redis://user:***@host:6379/0"
    # Every address of a Sentinel URL (ttsq writes the data nodes' password on each, for kombu).
    assert redact_url("sentinel://:pw@h1:26379/0;sentinel://:pw@h2:26379/0") == (
        "sentinel://:***@h1:26379/0;sentinel://:***@h2:26379/0"
    )
    assert redact_url("redis://:pw@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_kwargs_are_described_by_names_and_sizes_never_by_text() -> None:
    described = describe_kwargs({"text": "secret words", "language": "korean", "seed": 7, "instruct": "calm"})
    assert "secret" not in described and "calm" not in described
    assert "text=<12 chars>" in described and "language=korean" in described and "seed=7" in described
    assert describe_kwargs(["not", "a", "mapping"]) == "<redacted>"


def test_a_result_repr_loses_its_url() -> None:
    text = "{'key': 'ab', 'url': 'https://s3/x?X-Amz-Signature=abc', 'duration_s': 1.0}"
    assert "Signature" not in redact_result(text) and "'url': '<url>'" in redact_result(text)
