"""A test-only engine that misbehaves on cue, loaded through the real plugin point.

Workers run it with ``TTSQ_ENGINE=faulty_engine:FaultyEngine`` (``tests/`` on ``PYTHONPATH``). It is
espeak, plus faults triggered by markers in the text, at the engine boundary, where a real model
would fail:

- ``[crash]``: the process dies with SIGKILL mid-batch, as on a segfault or an out-of-memory kill
  (unless ``FAULTY_ENGINE_ARMED`` names a file that does not exist: the bug has been fixed);
- ``[hang]``: the engine call never returns, as on a stuck kernel;
- ``[slow]``: the batch takes ``SLOW_S`` seconds longer, so a test can act while it is in flight.

If ``FAULTY_ENGINE_EVENTS`` names a file, each batch appends ``<pid> <size>`` to it as it starts.
Nothing in ttsq is mocked: the batcher, worker, Celery and Redis are the real ones.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ttsq.engines.espeak import EspeakEngine

if TYPE_CHECKING:
    from ttsq.engines.base import EngineOutput
    from ttsq.request import SynthesisRequest

SLOW_S = 1.0


class FaultyEngine(EspeakEngine):
    def synthesize_batch(self, requests: Sequence[SynthesisRequest]) -> list[EngineOutput | Exception]:
        events = os.environ.get("FAULTY_ENGINE_EVENTS")
        if events:
            with open(events, "a") as log:
                log.write(f"{os.getpid()} {len(requests)}\n")
        texts = [request.text for request in requests]
        armed = os.environ.get("FAULTY_ENGINE_ARMED")
        if any("[crash]" in text for text in texts) and (armed is None or os.path.exists(armed)):
            os.kill(os.getpid(), signal.SIGKILL)
        if any("[hang]" in text for text in texts):
            threading.Event().wait()
        if any("[slow]" in text for text in texts):
            time.sleep(SLOW_S)
        return super().synthesize_batch(requests)
