"""The envelope gate: every message a ttsq worker receives is checked before Celery touches it.

``GatedChannel`` checks each raw list item before kombu builds a message from it; ``Gate.admit``, called
by ``GatedConsumer`` before Celery's strategy, checks the task headers and body and marks the job
received in the accepted-job ledger. A refused message is acknowledged, dead-lettered, counted and
logged, and the worker keeps consuming. Why two places, and what a refusal leaves: docs/guarantees.md,
"How recovery works" (the envelope gate).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from queue import Empty
from typing import TYPE_CHECKING, Any

import redis
from celery.worker.consumer import Consumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from ttsq.app import lane_of
from ttsq.constants import DOCUMENT_HEADER, SEQ_HEADER
from ttsq.records.accepted import AcceptedJobs, Receipt
from ttsq.records.connection import SentinelConnection
from ttsq.worker.envelope import MAX_MESSAGE_BYTES, Refused, check_raw, check_task
from ttsq.worker.lanes import CAPPED_BRPOP_TIMEOUT_S, LaneCycle

if TYPE_CHECKING:
    from ttsq.observer import Observer
    from ttsq.records.deadletters import DeadLetters

logger = logging.getLogger(__name__)

#: The transport option that carries a worker's ``Gate`` to its channels.
GATE_OPTION = "ttsq_gate"
#: The transport options carrying ``TTSQ_BULK_SHARE_PERCENT``, and the most bulk messages a worker holds
#: while interactive work is coming, to the channel's ``LaneCycle``.
BULK_SHARE_OPTION = "ttsq_bulk_share_percent"
BULK_CAP_OPTION = "ttsq_bulk_cap"


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
        #: The delivery tags this process holds on its live broker connection, for the heartbeat to keep
        #: alive (``ttsq.worker.recovery``). Emptied when the connection is lost: those messages' acks
        #: cannot go on the connection they came on, and wait in ``late_acks``.
        self.live_tags: set[str] = set()
        #: Tags of messages finished after the connection they came on was lost, whose acks the recovery
        #: thread makes on a new connection (``Holders.acknowledge``). Left alone, their entries stayed in
        #: kombu's ``unacked`` hash until the visibility timeout (an hour) and ran once more then. Bounded
        #: by what the process held when the connection went: its prefetch.
        self._late_acks: set[str] = set()
        self._late_lock = threading.Lock()
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

    def ack_later(self, delivery_tag: Any, multiple: bool = False) -> None:
        """``basic_ack`` of a channel whose connection was lost: the ack is made later, on a new one."""
        with self._late_lock:
            self._late_acks.add(str(delivery_tag))

    def late_acks(self) -> frozenset[str]:
        """The acks still to make on a new connection."""
        with self._late_lock:
            return frozenset(self._late_acks)

    def acked_late(self, tags: Collection[str]) -> None:
        """``tags`` were acknowledged on a new connection."""
        with self._late_lock:
            self._late_acks.difference_update(tags)

    def close(self) -> None:
        """Nothing to release: the connections are closed with the process."""


def raw_of(message: Any) -> bytes:
    """A message as the broker held it (kombu keeps the popped payload), for a dead letter."""
    raw = getattr(message, "_raw", None)
    if isinstance(raw, dict):
        return json.dumps(raw).encode("utf-8")
    body = message.body
    return body if isinstance(body, bytes) else str(body).encode("utf-8", "replace")


def _headers_of(item: bytes | str, refused: Refused) -> Any:
    """The headers of a list item ``check_raw`` refused, if it has any, for the letter's id and task."""
    if refused.reason not in ("envelope", "encoding", "body") or len(item) > MAX_MESSAGE_BYTES:
        return None
    try:
        payload = json.loads(item)
    except ValueError:
        return None
    return payload.get("headers") if isinstance(payload, dict) else None


class HeldQoS(kombu_redis.QoS):
    """kombu's bookkeeping of unacknowledged messages, plus this process's own set of the tags it holds
    (``ttsq.records.holders``), written in the same pipelines: a tag is in the set exactly while it is
    in kombu's ``unacked`` hash on this process's behalf, so a dead process's set is what to give back."""

    def _gate(self) -> Any:
        return self.channel.connection.client.transport_options.get(GATE_OPTION)

    @property
    def held_key(self) -> str | None:
        return getattr(self._gate(), "held_key", None)

    def append(self, message: Any, delivery_tag: Any) -> None:
        held = self.held_key
        if held is None:
            super().append(message, delivery_tag)  # type: ignore[no-untyped-call]
            return
        delivery = message.delivery_info
        with self.pipe_or_acquire() as pipe:
            # kombu 5.7's ``append``, with the tag added to this process's set in the same round trip.
            pipe.zadd(self.unacked_index_key, {delivery_tag: time.time()}).hset(
                self.unacked_key,
                delivery_tag,
                dumps([message._raw, delivery["exchange"], delivery["routing_key"]]),  # type: ignore[no-untyped-call]
            ).sadd(held, delivery_tag).execute()
        virtual.QoS.append(self, message, delivery_tag)  # type: ignore[no-untyped-call]
        self._gate().live_tags.add(str(delivery_tag))

    def ack(self, delivery_tag: Any) -> None:
        """kombu's ack; one that cannot reach Redis (the connection dropped as the job finished, before the
        consumer noticed) is made later on a new connection (``Gate.ack_later``), where kombu would log
        "Couldn't ack" and leave the entry to the visibility timeout."""
        try:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            gate = self._gate()
            if gate is None or self.held_key is None:
                raise
            gate.ack_later(delivery_tag)
            virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # settled here, as kombu's would be

    def _remove_from_indices(self, delivery_tag: Any, pipe: Any = None) -> Any:
        pipe = super()._remove_from_indices(delivery_tag, pipe)  # type: ignore[no-untyped-call]
        held = self.held_key
        if held is None:
            return pipe
        self._gate().live_tags.discard(str(delivery_tag))
        return pipe.srem(held, delivery_tag)


class GatedChannel(kombu_redis.Channel):
    """kombu's Redis channel, with the list item it pops checked before kombu turns it into a message.

    ``_brpop_read`` is kombu 5.7's, with ``check_raw`` in place of a bare ``loads``: kombu would raise on
    a body that is not JSON (or of the wrong shape) inside the worker's event loop, after the message
    has left the queue.
    """

    QoS = HeldQoS
    _sync_client: redis.Redis | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # Interactive queues first, bulk its guaranteed share (``ttsq.worker.lanes``).
        options = self.connection.client.transport_options
        share = options.get(BULK_SHARE_OPTION)
        if share is not None:
            self._queue_cycle = LaneCycle(
                int(share), bulk_cap=int(options.get(BULK_CAP_OPTION, 0)), bulk_held=self._bulk_held
            )

    def _bulk_held(self) -> int:
        """Bulk messages this channel holds (delivered, not yet acknowledged)."""
        qos = self.qos
        dirty = qos._dirty
        return sum(
            1
            for tag, message in list(qos._delivered.items())
            if tag not in dirty and lane_of(str(message.delivery_info.get("routing_key", ""))) == "bulk"
        )

    def _brpop_start(self, timeout: Any = None) -> None:
        cycle = self._queue_cycle
        if isinstance(cycle, LaneCycle) and cycle.bulk_capped:
            timeout = CAPPED_BRPOP_TIMEOUT_S  # a bulk slot may free meanwhile: look again soon
        super()._brpop_start(timeout)  # type: ignore[no-untyped-call]

    def _create_client(self, asynchronous: bool = False) -> redis.Redis:
        """kombu builds a new ``redis.Redis`` around the same pool for every publish and ack (its
        ``conn_or_acquire``), and redis-py's constructor builds a table of ~200 response callbacks
        each time: a tenth of a worker's Python time per job went there (task events, acks). One
        client per pool serves them all: a ``redis.Redis`` holds no connection of its own, each
        command takes one from the pool, so it is safe to share between threads."""
        if asynchronous:
            return super()._create_client(asynchronous=True)  # type: ignore[no-untyped-call,no-any-return]
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client()  # type: ignore[no-untyped-call]
        return client

    def _brpop_read(self, **options: Any) -> bool:
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                # if there's a ConnectionError, disconnect so the next iteration will reconnect automatically.
                self.client.connection.disconnect()
                raise
            if dest__item:
                dest, item = dest__item
                dest = (dest.decode() if isinstance(dest, bytes) else str(dest)).rsplit(self.sep, 1)[0]
                self._queue_cycle.rotate(dest)
                try:
                    payload = check_raw(item)
                except Refused as refused:
                    gate = self.connection.client.transport_options.get(GATE_OPTION)
                    if gate is None:
                        raise
                    gate.refuse(item, queue=dest, refused=refused, headers=_headers_of(item, refused))
                    return True
                self.connection._deliver(payload, dest)
                return True
            raise Empty()
        finally:
            self._in_poll = None  # type: ignore[assignment]
            flush = getattr(self, "_flush_brpop_reauth", None)
            if flush is not None:
                flush()


class GatedTransport(kombu_redis.Transport):
    """kombu's Redis transport with ``GatedChannel``: what ttsq workers consume through."""

    Channel = GatedChannel


class GatedSentinelChannel(GatedChannel, kombu_redis.SentinelChannel):
    """``GatedChannel`` on kombu's Sentinel channel: its pool asks the Sentinels for the primary, on
    every connection (``SentinelConnection``: an ack or a restore never goes to the old primary's address)."""

    connection_class = SentinelConnection


class GatedSentinelTransport(kombu_redis.SentinelTransport):
    """kombu's Sentinel transport with the gated channel: what ttsq workers consume through behind Sentinel."""

    Channel = GatedSentinelChannel


def gated_transport(broker_url: str) -> type[kombu_redis.Transport]:
    """The gated transport for ``broker_url``: naming a transport class overrides the URL's scheme, so
    a ``sentinel://`` broker needs the Sentinel one."""
    return GatedSentinelTransport if broker_url.startswith("sentinel://") else GatedTransport


class GatedConsumer(Consumer):  # type: ignore[misc]
    """Celery's consumer, with the envelope gate in front of its task handler, surviving a broker that
    vanishes while the worker holds messages.

    With Celery 5.7 and kombu 5.7, losing Redis while messages are unacknowledged ends the worker:
    Celery detaches the dead connection's transport, then closes its channel, whose attempt to
    push the held messages back (and, later, each ack of a task still running) needs that
    transport and raises ``AttributeError``, which Celery takes for an "Unrecoverable error".
    Before Celery's clean-up, the dead channel is told not to push messages back; the consumer
    reconnects as after any connection loss. The worker finishes the messages it held, and their acks,
    which cannot go on the dead channel, are kept for the recovery thread to make on a new connection
    (``Gate.ack_later``, ``Holders.acknowledge``): they leave no entry in kombu's ``unacked`` hash. A
    reject on the dead channel fails as the connection error it is (Celery logs it and carries on):
    that message stays unacknowledged and comes back after the visibility timeout.
    """

    def create_task_handler(self, *args: Any, **kwargs: Any) -> Any:
        handle = super().create_task_handler(*args, **kwargs)
        # The worker's gate rides on its app (``ttsq.worker.tasks.worker_app``); without one, a plain app.
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
        gate: Gate | None = getattr(self.app, "ttsq_gate", None)
        if gate is not None:
            gate.live_tags.clear()  # their acks cannot reach Redis now: no longer kept alive
        channel = getattr(self.connection, "_default_channel", None)
        if channel is not None:
            channel.do_restore = False
            channel.basic_reject = _dead_channel
            # Without a held set there is no recovery thread to make the ack later.
            channel.basic_ack = gate.ack_later if gate is not None and gate.held_key is not None else _dead_channel
        super().on_connection_error_after_connected(exc)


def _dead_channel(*args: Any, **kwargs: Any) -> None:
    raise redis.exceptions.ConnectionError(
        "the broker connection this message came on was lost; Redis redelivers it after the visibility timeout"
    )
