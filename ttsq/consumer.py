"""The worker's Celery consumer: messages pass the envelope gate first, and a lost broker is survived.

Celery takes a message apart in its consumer and strategy code before any task runs, and an exception
there ends the whole worker. Here every task message goes through ``Gate.admit`` first; a message
Celery still cannot take (a case no check foresaw) is refused and dead-lettered the same way, instead of
ending the worker, unless the failure is the broker connection itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import redis
from celery.worker.consumer import Consumer

from ttsq.envelope import Refused
from ttsq.gate import raw_of

if TYPE_CHECKING:
    from ttsq.gate import Gate

logger = logging.getLogger(__name__)


class GatedConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, with the envelope gate in front of its task handler, surviving a broker that
    vanishes while the worker holds messages.

    With Celery 5.7 and kombu 5.7, losing Redis while messages are unacknowledged ends the worker:
    Celery detaches the dead connection's transport, then closes its channel, whose attempt to
    push the held messages back (and, later, each ack of a task still running) needs that
    transport and raises ``AttributeError``, which Celery takes for an "Unrecoverable error".
    Before Celery's clean-up, the dead channel is told not to push messages back, and acks on it
    fail as the connection errors they are (Celery logs "Couldn't ack" and carries on). The
    consumer reconnects as after any connection loss; the messages it held stay in Redis' unacked
    set and come back after the visibility timeout, like those of a worker that died, and their
    rerun is answered from the cache.
    """

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)
        # The worker's gate rides on its app (``ttsq.tasks.worker_app``); an app without one is a plain Celery app.
        gate: Gate | None = getattr(self.app, "ttsq_gate", None)
        if gate is None:
            return handle
        passing = (*self.connection_errors, *self.channel_errors, redis.exceptions.ConnectionError)

        def gated(message: Any) -> Any:
            if not gate.admit(message):
                return None
            try:
                return handle(message)
            except passing:
                raise  # the broker went away: the consumer reconnects, the message stays unacked
            except Exception as exc:  # Celery could not take it apart: it would end the worker
                queue = str((message.delivery_info or {}).get("routing_key") or "")
                gate.refuse(
                    raw_of(message), queue=queue, refused=Refused("celery", type(exc).__name__), headers=message.headers
                )
                if not message.acknowledged:
                    message.ack()
                return None

        return gated

    def on_connection_error_after_connected(self, exc: Any) -> None:
        channel = getattr(self.connection, "_default_channel", None)
        if channel is not None:
            channel.do_restore = False
            channel.basic_ack = channel.basic_reject = _dead_channel
        super().on_connection_error_after_connected(exc)


def _dead_channel(*args: Any, **kwargs: Any) -> None:
    raise redis.exceptions.ConnectionError(
        "the broker connection this message came on was lost; Redis redelivers it after the visibility timeout"
    )
