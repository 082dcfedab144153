"""The baseline: the Celery task a user would write in an afternoon around the same engine.

One message, one engine call, the audio back in the result. No cache, no batching, no storage, no
single flight, no validation beyond what the engine does. ``benchmarks/compare.py`` runs it with
``celery -A benchmarks.bare_task worker -P solo`` (one process owns the model, as it would a GPU) and
Celery's defaults otherwise, next to ttsq's own workers on the same Redis.

Configured from the environment like any afternoon project: ``BARE_BROKER_URL``,
``BARE_RESULT_BACKEND``; the engine from ``TTSQ_ENGINE`` (and its ``TTSQ_*`` settings).
"""

from __future__ import annotations

import base64
import io
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import soundfile as sf
from celery import Celery

from ttsq.config import Settings
from ttsq.engines import create_engine
from ttsq.job import SynthesisRequest

if TYPE_CHECKING:
    from ttsq.engines.base import Engine

app = Celery("bare", broker=os.environ.get("BARE_BROKER_URL"), backend=os.environ.get("BARE_RESULT_BACKEND"))
app.conf.broker_connection_retry_on_startup = True

_engine: Engine | None = None


def engine() -> Engine:
    """The model, loaded by the first task (the usual module-level global)."""
    global _engine
    if _engine is None:
        loaded = create_engine(Settings.from_env())
        loaded.load()
        _engine = loaded
    return _engine


@app.task(name="bare.synthesize")  # type: ignore[untyped-decorator]
def synthesize(text: str, language: str = "auto", max_new_tokens: int | None = None, **_: Any) -> dict[str, Any]:
    """Synthesize one text and return the WAV in the result."""
    request = SynthesisRequest(text=text, language=language, max_new_tokens=max_new_tokens)
    output = engine().synthesize_batch([request])[0]
    if isinstance(output, Exception):
        raise output
    buffer = io.BytesIO()
    sf.write(buffer, np.asarray(output.samples), output.sample_rate, format="WAV", subtype="PCM_16")
    return {
        "audio_wav_b64": base64.b64encode(buffer.getvalue()).decode("ascii"),
        "sample_rate": output.sample_rate,
        "duration_s": len(output.samples) / output.sample_rate,
    }
