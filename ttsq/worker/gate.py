"""The envelope gate: every message a ttsq worker receives is checked before Celery touches it.

kombu's channel (``ttsq.delivery.transport.GatedChannel``) checks each raw list item before kombu builds
a message from it; ``Gate.admit``, called by the consumer (``ttsq.delivery.transport.GatedConsumer``)
before Celery's strategy, checks the task headers and body and marks the job received in the
accepted-job ledger. A refused message is acknowledged, dead-lettered, counted and
logged, and the worker keeps consuming. Why two places, and what a refusal leaves: docs/guarantees.md,
"How recovery works" (the envelope gate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from ttsq.constants import ACKS_REMEMBERED_S, DOCUMENT_HEADER, SEQ_HEADER
from ttsq.delivery.acks import Acks
from ttsq.delivery.envelope import Refused, check_task
from ttsq.delivery.transport import raw_of
from ttsq.records.accepted import AcceptedJobs, Receipt

if TYPE_CHECKING:
    from ttsq.observer import Observer
    from ttsq.records.deadletters import DeadLetters

logger = logging.getLogger(__name__)


class Gate:
    """Checks, dead-letters and marks received every message one worker takes in."""

    def __init__(
        self,
        *,
        tasks: Collection[str],
        observer: Observer,
        accepted: AcceptedJobs,
        dead_letters: DeadLetters,
        held_key: str | None = None,
        revoke: Callable[[str], object] | None = None,
    ) -> None:
        """``held_key``: this process's set of held delivery tags (``ttsq.records.holders``), kept by
        ``HeldQoS``; None keeps kombu's bookkeeping alone. ``revoke``: stores REVOKED as a job's result
        (the app's result backend), for a cancelled job whose message the gate drops."""
        self.revoke = revoke
        self.held_key = held_key
        #: Which of this process's acks go on its broker connection and which on a new one, later
        #: (``ttsq.delivery.acks``): kept by the transport, made by the recovery thread.
        self.acks = Acks(remember_s=ACKS_REMEMBERED_S)
        self.tasks = frozenset(tasks)
        self.observer = observer
        self.accepted = accepted
        self.dead_letters = dead_letters

    def refuse(self, raw: bytes | str, *, queue: str, refused: Refused, headers: Any = None) -> None:
        """Keep a refused message in the dead-letter list, count it and log it (never its text)."""
        task_id = headers.get("id") if isinstance(headers, dict) and isinstance(headers.get("id"), str) else None
        task = headers.get("task") if isinstance(headers, dict) and isinstance(headers.get("task"), str) else None
        # The id and queue come from the message: cut here, escaped by the log guard (ttsq.logs).
        logger.warning(
            "message %s on %s refused (%s) and dead-lettered; see `ttsq dead`",
            task_id[:80] if task_id is not None else "without an id",
            queue[:80],
            str(refused)[:200],
        )
        self.observer.message_refused(refused.reason)
        try:
            self.dead_letters.put(
                raw, queue=queue, reason=refused.reason, detail=refused.detail, task_id=task_id, task=task
            )
        except Exception as exc:  # the message is refused either way; losing its copy loses no job
            logger.warning("could not keep the refused message: %s", type(exc).__name__)

    def admit(self, message: Any) -> bool:
        """Whether Celery may take ``message`` in. A refused message is acked and dead-lettered here."""
        queue = str((message.delivery_info or {}).get("routing_key") or "")
        try:
            checked = check_task(
                message.headers,
                message.body,
                content_type=message.content_type,
                content_encoding=message.content_encoding,
                tasks=self.tasks,
            )
        except Refused as refused:
            self.refuse(raw_of(message), queue=queue, refused=refused, headers=message.headers)
            message.ack()
            return False
        headers = message.headers
        seq = headers.get(SEQ_HEADER)
        plain = (
            not headers.get("redelivered")
            and not (message.delivery_info or {}).get("redelivered")
            and not headers.get("retries")
        )
        document = headers.get(DOCUMENT_HEADER)
        document_id = document.get("id") if isinstance(document, dict) else None
        try:
            receipt = self.accepted.received(
                checked.task_id,
                task=checked.task,
                queue=queue,
                seq=seq if isinstance(seq, int) else None,
                plain=plain,
                document=document_id if isinstance(document_id, str) else None,
            )
        except Exception as exc:  # the ledger is a safety net: a Redis hiccup here must not stop the job
            logger.warning("job %s: could not mark it received: %s", checked.task_id, type(exc).__name__)
            return True
        if receipt is Receipt.DUPLICATE:
            logger.info("job %s: a second copy (a worker already received this job); dropped", checked.task_id)
            self.observer.duplicate_dropped()
        elif receipt is Receipt.CANCELLED:
            logger.info("job %s: cancelled before it ran; dropped", checked.task_id)
            if document_id is None and self.revoke is not None:
                # Its canceller stores REVOKED once its cancel won; one that died before it did left
                # the job with no final state, and this copy is the last the job will see.
                try:
                    self.revoke(checked.task_id)
                except Exception as exc:  # back to its queue: the worker that takes it next stores it
                    logger.warning("job %s: could not store REVOKED: %s", checked.task_id, type(exc).__name__)
                    message.reject(requeue=True)
                    return False
        else:
            return True
        message.ack()
        return False

    def close(self) -> None:
        """Nothing to release: the connections are closed with the process."""
