"""The worker's per-batch limit (``TTSQ_BATCH_TIMEOUT_S``, else half the job timeout) ends a worker whose
engine call outlasts it, as stuck. A worker refuses to start where a full batch of the longest texts
would outlast it on its engine: a healthy worker would otherwise be ended by its first such batch, and
its jobs, sent again, would end the next one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support import WorkerProcess

from ttsq.config import Settings

StartWorker = Callable[..., WorkerProcess]


def test_a_worker_refuses_a_limit_a_full_batch_of_the_longest_texts_cannot_fit(
    settings: Settings, start_worker: StartWorker
) -> None:
    # Eight texts of 200 characters: about 14 s of audio each, 7.2 s of device time for the batch.
    heavy = settings.replace(engine="standin", standin_a_us=500_000, standin_b_us=0, max_batch=8, max_text_chars=200)
    with pytest.raises(RuntimeError, match="did not start") as refused:
        start_worker(heavy.replace(job_timeout_s=12), name="short")  # a limit of 6 s
    message = str(refused.value)
    assert "TTSQ_BATCH_TIMEOUT_S" in message and "a full batch (8 texts of up to 200 characters)" in message
    assert "7.2 s" in message and "6.0 s" in message
    # Room for the batch: the worker starts.
    start_worker(heavy.replace(job_timeout_s=16), name="room")  # a limit of 8 s
