"""The corpus of broken requests in ``tests/data/bad_requests.json``, expanded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

CORPUS_PATH = Path(__file__).parent / "data" / "bad_requests.json"


def load() -> list[Any]:
    cases = []
    for case in json.loads(CORPUS_PATH.read_text(encoding="utf-8")):
        request = dict(case["request"])
        if "_repeat" in request:
            request["text"] = request["text"] * request.pop("_repeat")
        if "_repeat_instruct" in request:
            request["instruct"] = request["instruct"] * request.pop("_repeat_instruct")
        cases.append(pytest.param(request, case["field"], id=case["name"],
                                  marks=[] if case.get("cli", True) else [pytest.mark.no_cli]))
    return cases


BAD_REQUESTS = load()
#: The cases a shell can express with ttsq's flags (no JSON types, no fields without a flag).
BAD_CLI_REQUESTS = [case for case in BAD_REQUESTS if not any(m.name == "no_cli" for m in case.marks)]
