"""The tasks a worker runs: ``ttsq.synthesize``, ``ttsq.document`` and ``ttsq.stitch``, registered on the app.

Thin by design: each task hands its JSON kwargs to the job pipeline (``ttsq.worker.pipeline``) or the
document side (``ttsq.worker.documents``), and every message is checked by the envelope gate
(``ttsq.worker.gate``) before Celery takes it apart. Producers never import this module; they send by
name through ``ttsq.app``. The contract for backends that do not import ttsq (kwargs, queues, result,
errors): docs/task-contract.md.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from celery import Celery, states
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import task_postrun, task_success

import ttsq.tracing as tracing
from ttsq.app import make_app
from ttsq.constants import CLAIM_HEADER, DOCUMENT_TASK_NAME, SENT_AT_HEADER, STITCH_TASK_NAME, TASK_NAME
from ttsq.delivery.transport import BULK_CAP_OPTION, BULK_SHARE_OPTION, GATE_OPTION, GatedConsumer, gated_transport
from ttsq.errors import InvalidRequest, JobCancelled
from ttsq.job import lane_of
from ttsq.records.holders import held_key, incarnation
from ttsq.results import FAILURE, SUCCESS
from ttsq.worker.documents import Documents
from ttsq.worker.gate import Gate
from ttsq.worker.recovery import Recovery

if TYPE_CHECKING:
    from ttsq.config import Settings
    from ttsq.job import JobResult
    from ttsq.worker.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

#: The tasks a ttsq worker runs; a message for any other task is refused at the gate.
TASKS = (TASK_NAME, DOCUMENT_TASK_NAME, STITCH_TASK_NAME)

#: Every ttsq task: acked after it returns (late acks), never added to other apps (``shared=False``:
#: a second app in one process, as in tests and the embedded mode, would otherwise run the first
#: app's closure with the first runtime), events and inspect replies redacted.
_TASK_OPTIONS: dict[str, Any] = {
    "bind": True,
    "acks_late": True,
    "shared": False,
    "Request": "ttsq.redaction:RedactedRequest",
}


def worker_app(settings: Settings, runtime: WorkerRuntime) -> Celery:
    """The Celery app of a worker: ttsq's tasks registered over a started ``WorkerRuntime`` (engine
    loaded and warmed first, so a broken model stops the process before it consumes anything), and
    every message it receives checked by the envelope gate (``ttsq.worker.gate``) before Celery parses it.
    The runtime's sweeper starts here, sending lost jobs again through this app."""
    app = make_app(settings, worker=True)
    register_tasks(app, runtime)
    name = incarnation(runtime.node, os.getpid())
    gate = Gate(
        tasks=TASKS,
        observer=runtime.observer,
        accepted=runtime.accepted,
        dead_letters=runtime.redis.dead_letters,
        held_key=held_key(name),
        revoke=lambda task_id: app.backend.mark_as_revoked(task_id, "cancelled"),
    )
    # The transport checks each popped list item, the consumer (``ttsq.delivery.transport``) each message.
    app.conf.broker_transport = gated_transport(settings.broker_url)
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        GATE_OPTION: gate,
        BULK_SHARE_OPTION: settings.bulk_share_percent,
        # Half a batch of prefetch slots kept for interactive work while it is coming (``ttsq.worker.lanes``).
        BULK_CAP_OPTION: settings.concurrency - max(1, settings.max_batch // 2),
    }
    # Any worker made from this app gets the gated consumer, not only those that name it.
    app.conf.worker_consumer = f"{GatedConsumer.__module__}:{GatedConsumer.__qualname__}"
    app.ttsq_gate = gate
    runtime.sweep(app)
    # What a dead worker process held goes back within seconds (``ttsq.worker.recovery``); this one
    # beats as a holder before it takes its first message.
    app.ttsq_recovery = Recovery(
        app,
        runtime.redis.holders,
        runtime.observer,
        name=name,
        node=runtime.node,
        stopping=lambda: runtime.stopping,
        acks=gate.acks,
    )
    app.ttsq_recovery.start()
    return app


def register_tasks(app: Celery, runtime: WorkerRuntime) -> Documents:
    """Register ``ttsq.synthesize``, ``ttsq.document`` and ``ttsq.stitch`` on ``app``."""
    documents = Documents(app, runtime)

    @app.task(name=TASK_NAME, **_TASK_OPTIONS)  # type: ignore[untyped-decorator]
    def synthesize(self: Any, *args: Any, **kwargs: Any) -> JobResult:
        if args:
            raise InvalidRequest("args", "ttsq.synthesize takes keyword arguments only (kwargs=...)")
        sent_at = self.request.get(SENT_AT_HEADER)
        queue_wait = max(0.0, time.time() - float(sent_at)) if isinstance(sent_at, (int, float)) else None
        claim = self.request.get(CLAIM_HEADER)
        routing_key = (self.request.delivery_info or {}).get("routing_key")
        if "lane" not in kwargs and isinstance(routing_key, str) and lane_of(routing_key) == "bulk":
            # A raw send_task to a bulk queue: its rows wait behind interactive ones too.
            kwargs = {**kwargs, "lane": "bulk"}
        if (self.request.delivery_info or {}).get("redelivered"):
            # A worker died holding it (or it outlived the visibility timeout): the rerun is harmless.
            logger.info("job %s: redelivered", self.request.id)
        try:
            with _traced(self, TASK_NAME):
                # It settles a success itself, before its stream's end: a cancel that came first ends it here.
                return runtime.pipeline.run(
                    kwargs,
                    task_id=self.request.id,
                    queue_wait_s=queue_wait,
                    claimed_key=claim if isinstance(claim, str) else None,
                )
        except JobCancelled:
            raise _revoked(self, runtime) from None
        except Exception as exc:
            if runtime.stopping:
                # A cold shutdown closed this worker's connections under the job: give the message
                # back (or leave it unacked for redelivery) instead of recording a failure.
                raise Reject(exc, requeue=True) from exc
            _settle(self, runtime, FAILURE)
            raise

    @app.task(name=DOCUMENT_TASK_NAME, **_TASK_OPTIONS)  # type: ignore[untyped-decorator]
    def document(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            raise InvalidRequest("args", "ttsq.document takes keyword arguments only (kwargs=...)")
        with _traced(self, DOCUMENT_TASK_NAME):
            return documents.fan_out(self, kwargs)

    # The stitch carries the document's id: a STARTED stored over its PROGRESS would take the document's
    # progress back; the stitch stores PROGRESS (phase stitching) itself.
    @app.task(name=STITCH_TASK_NAME, track_started=False, **_TASK_OPTIONS)  # type: ignore[untyped-decorator]
    def stitch(self: Any, results: Any = None, *, plan: Any, key: Any = None) -> Any:
        # The stitch finishes the document: its outcome is settled against a cancel of the document.
        try:
            with _traced(self, STITCH_TASK_NAME):
                result = documents.stitch(self, results, plan, key)
        except (Retry, Ignore, Reject):
            raise
        except Exception:
            if not runtime.stopping:
                _settle(self, runtime, FAILURE)
            raise
        _settle(self, runtime, SUCCESS)
        return result

    # A chunk of a document is an ordinary job; the document side counts it once it has succeeded.
    task_success.connect(documents.chunk_succeeded, sender=synthesize, weak=False)

    def finished(task_id: str = "", state: str | None = None, **_: Any) -> None:
        # A final result is stored: the job leaves the accepted-job ledger. (A document is replaced by its
        # chord, state IGNORED: it stays until its stitch, which carries its id, finishes.)
        if state in (states.SUCCESS, states.FAILURE):
            try:
                runtime.accepted.finish(task_id)
            except Exception as exc:  # the sweeper drops records of finished jobs it comes across
                logger.warning("job %s: could not close its ledger record: %s", task_id, type(exc).__name__)

    for task in (synthesize, document, stitch):
        task_postrun.connect(finished, sender=task, weak=False)
    return documents


def _settle(task: Any, runtime: WorkerRuntime, state: str) -> None:
    """Settle the job's outcome (``state``) against a cancel; ``Ignore`` (raised) if the cancel came first."""
    # Kept while the job can be in flight (see Pipeline.run): after that its stored result answers.
    if not runtime.accepted.settle(str(task.request.id), state, ttl_s=runtime.settings.inflight_ttl_s):
        raise _revoked(task, runtime)


def _revoked(task: Any, runtime: WorkerRuntime) -> Ignore:
    """The job was cancelled before its outcome was settled: REVOKED is its final state (stored again
    here, over the STARTED Celery stored, in case its canceller did not live to store it), its record
    goes, and Celery stores nothing over it (``Ignore``: the message is acked)."""
    task_id = str(task.request.id)
    logger.info("job %s: cancelled before it finished; it ends REVOKED", task_id)
    task.backend.mark_as_revoked(task_id, "cancelled")
    try:
        runtime.accepted.finish(task_id)
    except Exception as exc:  # the canceller finished it already, or the sweeper drops it
        logger.warning("job %s: could not close its ledger record: %s", task_id, type(exc).__name__)
    return Ignore()


def _traced(task: Any, name: str) -> Any:
    """The task's span, continuing the trace its message carries (``ttsq.tracing.task``), open on this
    task thread for as long as the task runs."""
    if not tracing.enabled():
        return tracing.span(name)  # off: the shared no-op, nothing read from the request
    request = task.request
    sent_at = request.get(SENT_AT_HEADER)
    return tracing.task(
        name,
        {header: request.get(header) for header in tracing.PROPAGATED},
        task_id=str(request.id),
        queue=(request.delivery_info or {}).get("routing_key"),
        sent_at=float(sent_at) if isinstance(sent_at, (int, float)) else None,
    )
