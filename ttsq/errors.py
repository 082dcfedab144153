"""One error tree for everything ttsq raises on purpose.

    TTSQError
    ├── ConfigError          a TTSQ_* setting is missing or malformed (startup)
    │   └── FleetConflict    the worker's model differs from the one its queue's live workers serve
    ├── InvalidRequest       a request field is wrong (at the edge; nothing is queued)
    ├── EngineError          the engine could not synthesize an item
    │   ├── EngineUnavailable  the engine cannot be loaded here (missing extra, bad model path)
    │   └── EngineOutOfMemory  the device ran out of memory for a batch (the batcher splits it)
    ├── StorageError         the object store refused or could not be reached
    ├── BrokerError          Redis (broker, results or cache) could not be reached
    ├── CorruptRecord        a record read back (a result, an index entry) is not what ttsq writes
    └── JobError             a job did not produce a result
        ├── JobFailed        the worker ran it and it failed
        ├── JobParked        it entered the engine too often without finishing; parked for an operator
        ├── DeadlineExceeded its deadline passed before synthesis; dropped unsynthesized
        ├── JobCancelled     it was cancelled before its worker settled it; it ends REVOKED
        ├── JobTimeout       no result within the caller's timeout
        └── UnknownJob       ttsq never accepted a job with this id (or its result has expired)

Every class keeps its constructor arguments in ``args`` so that Celery's JSON result backend can
rebuild it on the client side: a producer that imports ttsq gets the same typed exception back.
"""

from __future__ import annotations


class TTSQError(Exception):
    """Base of every error ttsq raises on purpose."""


class ConfigError(TTSQError):
    """A TTSQ_* setting is missing or malformed."""

    def __init__(self, variable: str, reason: str) -> None:
        super().__init__(variable, reason)
        self.variable = variable
        self.reason = reason

    def __str__(self) -> str:
        return f"{self.variable}: {self.reason}"


class FleetConflict(ConfigError):
    """The worker's model differs from the one the live workers on its queue serve (one queue, one model)."""


class InvalidRequest(TTSQError):
    """A request field failed validation; the message names the field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"invalid {self.field}: {self.reason}"


class EngineError(TTSQError):
    """The engine could not synthesize an item."""


class EngineUnavailable(EngineError):
    """The engine cannot be loaded on this machine (missing extra, bad model path)."""


class EngineOutOfMemory(EngineError):
    """The device ran out of memory for this batch; a smaller batch may fit."""


class SharedFailure(EngineError):
    """A failure shared by several jobs that ran together (a continuous engine's frame), any one of
    which may be its cause: the batcher runs each of them again, alone, so only the culprit fails."""


class StorageError(TTSQError):
    """The object store refused a request or could not be reached."""


class BrokerError(TTSQError):
    """Redis (broker, result backend or cache index) could not be reached."""


class CorruptRecord(TTSQError):
    """A record read back from Redis (a job's result, a cache index entry) is not what ttsq writes: one
    who can write to Redis forged or damaged it. The message names the field; nothing is read or written
    through it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(field, reason)
        self.field = field
        self.reason = reason

    def __str__(self) -> str:
        return f"refused {self.field}: {self.reason}"


class JobError(TTSQError):
    """A job did not produce a result."""


class JobFailed(JobError):
    """The worker ran the job and it failed."""


class JobParked(JobError):
    """The job entered the engine too often without finishing (it kills or hangs its worker); it
    is parked: ``ttsq failed`` lists it, ``ttsq retry ID`` re-queues it."""


class DeadlineExceeded(JobError):
    """The job's deadline passed before it was synthesized; it was dropped, nothing was made."""


class JobCancelled(JobError):
    """The job was cancelled before its worker settled its outcome: it ends REVOKED, with no result."""


class JobTimeout(JobError):
    """No result arrived within the caller's timeout."""


class StreamBroken(JobError):
    """A job's stream cannot be continued from where its reader is: the job was run again after part of
    its audio was read (its worker died), its worker stalled, or pieces were trimmed unread. The job
    itself still completes; wait for its result for the whole file."""


class UnknownJob(JobError):
    """No job with this id was ever accepted by ttsq, or its result has expired."""
