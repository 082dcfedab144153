"""The one way a job is sent: accepted (recorded) first, then sent, and withdrawn if it was not sent.

A producer's submit, ``ttsq retry``, a document's fan-out (each chunk), the worker's sweeper and the
release of deferred jobs all send through here, and every message is built by one function,
``publish``: it carries the seq of its accepted record (``ttsq.records.accepted``), the trace it
continues, and, for a document's chunk, its place in the document's chord (``CHORD_HEADER``). A job
whose send failed leaves no record behind for the sweeper to send later, behind the back of a caller
who was told it failed. The sweeper alone keeps the record (``withdraw=False``): it re-sends a job
someone was already told is accepted, so a failed re-send must leave it for the next sweep.

A job may wait instead of being sent while its queue is full or its tenant is at its in-flight cap
(``AcceptedJobs.defer``): then "sent" means deferred, and a worker releases it later
(``send_released``; docs/scheduling.md). A document's chunks wait the same way, in their tenant's
chunk place (``CHUNKS_SUFFIX``), under the window and never under the cap.

Traced (``ttsq.tracing``): ``ttsq.accept`` and ``ttsq.send``, whose W3C ``traceparent`` the message
carries to the worker that continues the trace; a deferred job keeps it in its record, so the message
its release sends continues the same trace.

The one message ttsq does not send here: a document's stitch, which Celery's chord sends when the
last chunk returns (``ttsq.worker.documents``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ttsq.tracing as tracing
from ttsq.constants import CHORD_HEADER, SEQ_HEADER
from ttsq.errors import BrokerError

if TYPE_CHECKING:
    from celery import Celery

    from ttsq.records.accepted import AcceptedJob, AcceptedJobs

logger = logging.getLogger(__name__)

#: How long a sender keeps trying to withdraw the record of a job it could not send (seconds): Redis
#: may be restarting, which is often why the send failed.
WITHDRAW_PATIENCE_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Outgoing:
    """A job to send: what its message carries, and what logs and Flower show instead of its kwargs."""

    task_id: str
    task: str
    queue: str
    kwargs: dict[str, Any]
    headers: dict[str, Any]
    kwargsrepr: str
    #: Whose turn it waits for, for fair shares (``ttsq.job.turn_of``): it may be deferred while its queue
    #: is full. None: send it now whatever the queue holds (a job sent again: it waited its turn once).
    tenant: str | None = None


@contextmanager
def sending(
    app: Celery,
    accepted: AcceptedJobs,
    job: Outgoing,
    *,
    withdraw: bool = True,
    patience_s: float = WITHDRAW_PATIENCE_S,
    window: int = 0,
    cap: int = 0,
    scope: str = "",
    traced: bool = True,
) -> Iterator[Callable[[], None]]:
    """Accept ``job``, then hand over the call that sends it; unless that call returned, withdraw the
    record on the way out (an exception, Ctrl-C, or a caller that decided not to send after all).

    The caller's steps between the accept and the send run inside the block: a submit claims the
    job's content key there, so a job that owns a claim always has a record until it finishes.
    The broker's own exception propagates from the send; the caller says what failed. With a
    ``window`` or a per-tenant ``cap`` (counted in the deployment ``scope``, its base queue) and a
    tenant, the send may defer the job instead (``AcceptedJobs.defer``). Not ``traced``: no spans of
    its own, the message carries the trace its headers carry (a document's chunks: the fan-out's)."""
    attributes = {"messaging.destination.name": job.queue, "messaging.message.id": job.task_id, "ttsq.task": job.task}
    with tracing.span("ttsq.accept", attributes) if traced else nullcontext():
        seq = accepted.accept(
            job.task_id,
            task=job.task,
            queue=job.queue,
            kwargs=job.kwargs,
            headers=job.headers,
            owner=str(job.kwargs.get("tenant") or ""),  # whose job it is: the jobs API answers only them
        )
    sent = False

    def send() -> None:
        nonlocal sent
        tenant = job.tenant
        spanned = {**attributes, "messaging.operation.type": "send"}
        with tracing.span("ttsq.send", spanned, kind="producer") if traced else nullcontext():
            headers = dict(job.headers)
            if traced:
                tracing.inject(headers)  # the message carries the send span: the worker's task continues it
            if (
                (window > 0 or cap > 0)
                and tenant is not None
                and accepted.defer(
                    job.task_id, queue=job.queue, tenant=tenant, window=window, cap=cap, scope=scope, headers=headers
                )
            ):
                # Accepted, waiting for its tenant's turn: a worker releases it, with these headers.
                tracing.annotate({"ttsq.deferred": True})
                sent = True
                return
            publish(
                app,
                job.task,
                task_id=job.task_id,
                queue=job.queue,
                kwargs=job.kwargs,
                headers=headers,
                seq=seq,
                kwargsrepr=job.kwargsrepr,
            )
        sent = True

    try:
        yield send
    finally:
        if not sent and withdraw:
            _withdraw(accepted, job.task_id, patience_s)


def send_job(app: Celery, accepted: AcceptedJobs, job: Outgoing, *, withdraw: bool = True) -> None:
    """Accept, send, and withdraw the record if the send fails (``sending`` with nothing in between)."""
    with sending(app, accepted, job, withdraw=withdraw) as send:
        send()


def send_released(app: Celery, job: AcceptedJob) -> None:
    """Send a job a worker released from its tenant's place, with its new seq (``AcceptedJobs.release``)
    and the headers it was deferred with (its trace among them). If this send fails, the job is unseen
    and the sweeper sends it again: it is never lost."""
    publish(
        app,
        job.task,
        task_id=job.task_id,
        queue=job.queue,
        kwargs=job.kwargs,
        headers=job.headers,
        seq=job.seq,
        kwargsrepr=f"released job {job.task_id}",
    )


def publish(
    app: Celery,
    task: str,
    *,
    task_id: str,
    queue: str,
    kwargs: dict[str, Any],
    headers: dict[str, Any],
    seq: int,
    kwargsrepr: str,
) -> None:
    """Build and publish the message of an accepted job: the one place ttsq sends a task. ``headers`` as
    recorded; a document chunk's ``CHORD_HEADER`` becomes its place in the chord (Celery's group id,
    index and the chord's body), so the chunk counts towards its stitch whoever sends it."""
    headers = {**headers, SEQ_HEADER: seq}
    chord = headers.pop(CHORD_HEADER, None)
    options: dict[str, Any] = {}
    if isinstance(chord, dict):  # a record's is checked where it is read (``ttsq.records.accepted``)
        options = {"group_id": chord["group"], "group_index": chord["index"], "chord": chord["body"]}
    app.send_task(task, kwargs=kwargs, task_id=task_id, queue=queue, headers=headers, kwargsrepr=kwargsrepr, **options)


def _withdraw(accepted: AcceptedJobs, task_id: str, patience_s: float) -> None:
    give_up = time.monotonic() + patience_s
    while True:
        try:
            accepted.forget(task_id)
            return
        except BrokerError as exc:
            if time.monotonic() >= give_up:  # the job may yet run once (a rerun of it is harmless)
                logger.warning("job %s was not sent, and its record could not be withdrawn: %s", task_id, exc)
                return
            time.sleep(0.5)
