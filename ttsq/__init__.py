"""ttsq: distributed text-to-speech on Celery and Redis.

The public face::

    from ttsq import Client, Settings, SynthesisRequest, JobResult, TTSQError

``Client()`` with no argument reads its settings from ``TTSQ_*`` as the command line does;
``Client(Settings.from_env(redis_url=...))`` overrides some of them.

Follow one job through the code in the order of the data flow: ``job`` (what a job is) → ``keys``
(its content hash) → ``client`` (cache short-circuit, single flight, ``records.submit.send_job``) →
``worker.tasks`` (the Celery task) → ``worker.pipeline`` (re-check, batch, store, index) →
``batching`` → ``engines`` → ``audio`` → ``storage`` → ``records.cache``. docs/development.md draws
the layers.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ttsq.config import Settings
from ttsq.constants import VERSION
from ttsq.errors import (
    BrokerError,
    ConfigError,
    CorruptRecord,
    DeadlineExceeded,
    EngineError,
    EngineOutOfMemory,
    EngineUnavailable,
    InvalidRequest,
    JobError,
    JobFailed,
    JobParked,
    JobTimeout,
    StorageError,
    StreamBroken,
    TTSQError,
    UnknownJob,
)
from ttsq.job import JobResult, SynthesisRequest

if TYPE_CHECKING:
    from ttsq.client import Client

__version__ = VERSION

__all__ = [
    "BrokerError",
    "Client",
    "ConfigError",
    "CorruptRecord",
    "DeadlineExceeded",
    "EngineError",
    "EngineOutOfMemory",
    "EngineUnavailable",
    "InvalidRequest",
    "JobError",
    "JobFailed",
    "JobParked",
    "JobResult",
    "JobTimeout",
    "Settings",
    "StorageError",
    "StreamBroken",
    "SynthesisRequest",
    "TTSQError",
    "UnknownJob",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # ``Client`` pulls in Celery and the records: loaded on first use, so a worker or a tool that
    # imports only ``ttsq.errors`` or ``ttsq.job`` pays nothing for it (PEP 562).
    if name == "Client":
        from ttsq.client import Client

        return Client
    raise AttributeError(f"module 'ttsq' has no attribute {name!r}")


# A library logs where its user configures logging, and nowhere else: without this, a warning from a
# producer (a storage retry) would reach the command line's stderr through Python's last resort handler.
logging.getLogger(__name__).addHandler(logging.NullHandler())
