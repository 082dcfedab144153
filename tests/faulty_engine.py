"""A test-only engine that misbehaves on cue, loaded through the real plugin point.

Workers run it with ``TTSQ_ENGINE=faulty_engine:FaultyEngine`` (``tests/`` on ``PYTHONPATH``). It is
espeak, plus faults triggered by markers in the text, at the engine boundary, where a real model
would fail:

- ``[crash]``: the process dies with SIGKILL mid-batch, as on a segfault or an out-of-memory kill
  (unless ``FAULTY_ENGINE_ARMED`` names a file that does not exist: the bug has been fixed);
- ``[hang]``: the engine call never returns, as on a stuck kernel;
- ``[slow]``: the batch takes ``SLOW_S`` seconds longer, so a test can act while it is in flight;
- ``[held]``: the batch waits while the file ``FAULTY_ENGINE_HOLD`` names exists (at most ``HOLD_S``), so
  a test acts while it is in flight however slowly the machine lets the test run, then removes the file;
- ``[crash-after-audio]``: a streaming row is handed its audio, then (a second later, once its pieces
  are in its stream) the process dies with SIGKILL, once: while the file ``FAULTY_ENGINE_ONCE`` names
  exists (it is removed first);
- ``[flaky]``: the item fails (an ``EngineError`` in its slot) while the file ``FAULTY_ENGINE_FLAKY``
  names exists, as on a transient device fault.

If ``FAULTY_ENGINE_EVENTS`` names a file, each batch appends ``<pid> <size>`` to it as it starts; if
``FAULTY_ENGINE_DONE`` does, each item synthesized appends ``<pid> <sha256 of its text>`` once its batch
returns (what was synthesized, and by whom: a text twice is work done twice).
Nothing in ttsq is mocked: the batcher, worker, Celery and Redis are the real ones.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ttsq.engines.espeak import EspeakEngine
from ttsq.errors import EngineError

if TYPE_CHECKING:
    from ttsq.engines.base import EngineOutput, Piece
    from ttsq.job import SynthesisRequest

SLOW_S = 1.0
HOLD_S = 120.0


class FaultyEngine(EspeakEngine):
    def synthesize_batch(
        self, requests: Sequence[SynthesisRequest], pieces: Sequence[Piece | None] | None = None
    ) -> list[EngineOutput | Exception]:
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
        hold = os.environ.get("FAULTY_ENGINE_HOLD")
        if hold and any("[held]" in text for text in texts):
            deadline = time.monotonic() + HOLD_S
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.02)
        once = os.environ.get("FAULTY_ENGINE_ONCE")
        if any("[crash-after-audio]" in text for text in texts) and once and os.path.exists(once):
            super().synthesize_batch(requests, pieces)
            time.sleep(SLOW_S)
            os.remove(once)
            os.kill(os.getpid(), signal.SIGKILL)
        outputs = super().synthesize_batch(requests, pieces)
        done = os.environ.get("FAULTY_ENGINE_DONE")
        if done:
            with open(done, "a") as log:
                log.writelines(f"{os.getpid()} {hashlib.sha256(text.encode()).hexdigest()}\n" for text in texts)
        flaky = os.environ.get("FAULTY_ENGINE_FLAKY")
        if flaky and os.path.exists(flaky):
            outputs = [
                EngineError("flaky device fault") if "[flaky]" in request.text else output
                for request, output in zip(requests, outputs, strict=True)
            ]
        return outputs
