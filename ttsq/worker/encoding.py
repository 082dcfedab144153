"""Where a worker encodes finished audio: a pool of threads off the engine's path, and what it still
has to do, in seconds, for the batcher to read (``Encoders.busy_s``).

The encoders (libsndfile's, through soundfile) release the interpreter lock while they work, so the
pool encodes on every core. It is bounded because more encodes than cores only share the same cores:
without it, every task thread of a batch that has just returned (up to twice the batch) encodes at
once, all of them finish together at the end, and meanwhile they hand the lock back and forth with the
consumer that takes messages off the broker and with the batcher. Bounded, encodes run first come
first served, and the waiting task threads hold no lock.

Where the encoders are slower than the engine, the jobs in a worker wait for the encoders, not for the
engine; an engine that runs whatever has arrived then makes small batches whose audio only queues
behind the encodes already there. The batcher reads ``busy_s``: a group whose audio would queue waits
at the batcher instead, for company, until the encoders are about to run dry, and leaves as a full
batch. Each job's turn counts from the moment its batch returns (a callback on its future, on the
batcher thread, so the batcher's next choice already sees it) until its file is encoded or the job has
left. Measured in docs/benchmarks.md, "The fleet at GPU speed".
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ttsq.audio import EncodedAudio, encode
from ttsq.batching.jobs import audio_seconds, recent_mean

if TYPE_CHECKING:
    import numpy.typing as npt

    from ttsq.batching.jobs import BatchItem
    from ttsq.job import SynthesisRequest

#: Formats whose encoding costs next to nothing (a header and a copy): encoded on the task thread, a hop
#: through the pool would cost more than the work.
CHEAP_FORMATS = frozenset({"wav"})


class Encoders:
    """The worker's encoder pool of ``threads`` (``TTSQ_ENCODE_THREADS``; 0: the cores this process may
    use), and its backlog (module docstring)."""

    def __init__(self, threads: int = 0) -> None:
        self.threads = threads or _usable_cores()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="ttsq-encode")
        self._lock = threading.Lock()
        #: Format -> audio seconds whose encode has a turn (batch returned) and has not finished.
        self._held: dict[str, float] = {}
        #: Format -> recent wall seconds a pool thread took per audio second (learnt from each encode).
        self._cost: dict[str, float] = {}

    def turn(self, audio_format: str) -> Turn:
        """A job's place in the backlog: hand ``Turn.batched`` to its batch future, and the turn to
        ``encode``; ``close`` it once the job leaves, whatever happened (idempotent)."""
        return Turn(self if audio_format not in CHEAP_FORMATS else None, audio_format)

    def encode(
        self, samples: npt.NDArray[Any], sample_rate: int, audio_format: str, turn: Turn | None = None
    ) -> EncodedAudio:
        """``ttsq.audio.encode`` on the pool, waited for (on the caller's thread, for a cheap format). The
        caller holds the job's encode span around the wait: the trace shows the queueing too."""
        if audio_format in CHEAP_FORMATS:
            return encode(samples, sample_rate, audio_format)
        if turn is None:  # a caller without a batch (the document stitch): counted from now
            turn = self.turn(audio_format)
            turn.hold(len(samples) / sample_rate if sample_rate > 0 else 0.0)
        return self._pool.submit(self._encode, samples, sample_rate, audio_format, turn).result()

    def busy_s(self, requests: Iterable[SynthesisRequest]) -> float:
        """Seconds the pool needs for the encodes it has been handed, when the audio of ``requests``
        would join them; 0 when one of them is not encoded on the pool (nothing of it would queue).
        Fast, never raises: the batcher thread asks it."""
        if any(request.format in CHEAP_FORMATS for request in requests):
            return 0.0
        with self._lock:
            work = sum(seconds * self._cost.get(name, 0.0) for name, seconds in self._held.items())
        return work / self.threads

    def close(self) -> None:
        """Let the encodes under way finish, then end the threads."""
        self._pool.shutdown(wait=True)

    def _encode(self, samples: npt.NDArray[Any], sample_rate: int, audio_format: str, turn: Turn) -> EncodedAudio:
        try:
            started = time.perf_counter()
            audio = encode(samples, sample_rate, audio_format)
            if audio.duration_s > 0:
                per_audio_s = (time.perf_counter() - started) / audio.duration_s
                with self._lock:
                    self._cost[audio_format] = recent_mean(self._cost.get(audio_format), per_audio_s)
            return audio
        finally:
            turn.close()

    def _add(self, audio_format: str, audio_s: float) -> None:
        """Under ``_lock``."""
        self._held[audio_format] = max(0.0, self._held.get(audio_format, 0.0) + audio_s)


class Turn:
    """One job's encode in the backlog: counted from ``batched`` (or ``hold``) until ``close``."""

    def __init__(self, encoders: Encoders | None, audio_format: str) -> None:
        self._encoders = encoders  # None: a cheap format, never counted
        self._format = audio_format
        self._audio_s = 0.0
        self._closed = False

    def batched(self, future: Future[BatchItem]) -> None:
        """The job's batch future resolved (a done callback: on the batcher thread, before the batcher
        chooses again): count its audio, if it has any."""
        if future.cancelled() or future.exception() is not None:
            return
        self.hold(audio_seconds(future.result().output))

    def hold(self, audio_s: float) -> None:
        """Count ``audio_s`` seconds to encode (once; never after ``close``)."""
        encoders = self._encoders
        if encoders is None or audio_s <= 0:
            return
        with encoders._lock:
            if not self._closed and not self._audio_s:
                self._audio_s = audio_s
                encoders._add(self._format, audio_s)

    def close(self) -> None:
        """The encode finished, or the job left without it: the backlog no longer counts it."""
        encoders = self._encoders
        if encoders is None:
            return
        with encoders._lock:
            if not self._closed:
                self._closed = True
                if self._audio_s:
                    encoders._add(self._format, -self._audio_s)


def _usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, which a container's cpuset narrows)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)
