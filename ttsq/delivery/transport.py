"""kombu's Redis transport and Celery's consumer as ttsq's workers consume through them: the one module
that overrides kombu's transport (``ttsq.delivery.broker`` writes down its key layout, and
``ttsq.delivery.connection`` keeps a producer's transport across a failover).

``GatedChannel`` checks each raw list item before kombu builds a message from it (``check_raw``) and
serves the lanes (``LaneCycle``); ``HeldQoS`` keeps, beside kombu's ``unacked`` hash, this process's set of
the tags it holds (``ttsq.records.holders``), and hands an ack that cannot reach Redis to the gate to be
made later; ``GatedConsumer`` puts ``ttsq.worker.gate.Gate.admit`` in front of Celery's task handler and
survives a broker that vanishes while the worker holds messages. Every kombu and Celery method copied or
overridden here is fenced against the version it was written for (``tests/test_fence.py``). Why kombu's
list transport and not Redis Streams: docs/guarantees.md, "Why not Redis Streams".
"""

from __future__ import annotations

import json
import time
from queue import Empty
from typing import Any, Protocol

import redis
from celery.worker.consumer import Consumer
from kombu.transport import redis as kombu_redis
from kombu.transport import virtual
from kombu.utils.json import dumps

from ttsq.delivery.acks import Acks
from ttsq.delivery.cycle import CAPPED_BRPOP_TIMEOUT_S, LaneCycle
from ttsq.delivery.envelope import MAX_MESSAGE_BYTES, Refused, check_raw
from ttsq.job import lane_of
from ttsq.records.connection import SentinelConnection

#: The transport option that carries a worker's ``Gate`` to its channels.
GATE_OPTION = "ttsq_gate"
#: The transport options carrying ``TTSQ_BULK_SHARE_PERCENT``, and the most bulk messages a worker holds
#: while interactive work is coming, to the channel's ``LaneCycle``.
BULK_SHARE_OPTION = "ttsq_bulk_share_percent"
BULK_CAP_OPTION = "ttsq_bulk_cap"


class Gate(Protocol):
    """What the transport asks of the worker's envelope gate (``ttsq.worker.gate.Gate``), which rides on
    the transport options (``GATE_OPTION``) and on the worker's app."""

    held_key: str | None
    acks: Acks

    def admit(self, message: Any) -> bool: ...

    def refuse(self, raw: bytes | str, *, queue: str, refused: Refused, headers: Any = None) -> None: ...


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
        self._gate().acks.held(str(delivery_tag))

    def ack(self, delivery_tag: Any) -> None:
        """kombu's ack, remembered a while (a failover may lose it: ``ttsq.delivery.acks``); one that
        cannot reach Redis (the connection dropped as the job finished, before the consumer noticed) is
        made later on a new connection, where kombu would log "Couldn't ack" and leave the entry to the
        visibility timeout."""
        try:
            super().ack(delivery_tag)  # type: ignore[no-untyped-call]
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
            gate = self._gate()
            if gate is None or self.held_key is None:
                raise
            gate.acks.failed(str(delivery_tag))
            virtual.QoS.ack(self, delivery_tag)  # type: ignore[no-untyped-call]  # settled here, as kombu's would be
            return
        if self.held_key is not None:
            self._gate().acks.acked(str(delivery_tag), time.monotonic())

    def _remove_from_indices(self, delivery_tag: Any, pipe: Any = None) -> Any:
        pipe = super()._remove_from_indices(delivery_tag, pipe)  # type: ignore[no-untyped-call]
        held = self.held_key
        if held is None:
            return pipe
        self._gate().acks.dropped(str(delivery_tag))
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
    (``ttsq.delivery.acks``, ``Holders.acknowledge``): they leave no entry in kombu's ``unacked`` hash. A
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
            # What it held is no longer kept alive; its recent acks, which a failover may have lost, and
            # those still to come are made on a new connection.
            gate.acks.lost()
        channel = getattr(self.connection, "_default_channel", None)
        if channel is not None:
            channel.do_restore = False
            channel.basic_reject = _reject_dead(gate.acks) if gate is not None else _dead_channel
            # Without a held set there is no recovery thread to make the ack later.
            acks = gate.acks if gate is not None and gate.held_key is not None else None
            channel.basic_ack = _ack_later(acks) if acks is not None else _dead_channel
        super().on_connection_error_after_connected(exc)


def _ack_later(acks: Acks) -> Any:
    """``basic_ack`` of a channel whose connection was lost: the ack is made later, on a new one."""

    def basic_ack(delivery_tag: Any, multiple: bool = False) -> None:
        acks.later(str(delivery_tag))

    return basic_ack


def _reject_dead(acks: Acks) -> Any:
    """``basic_reject`` of a channel whose connection was lost: the message stays unacknowledged."""

    def basic_reject(delivery_tag: Any, requeue: bool = False) -> None:
        acks.abandoned(str(delivery_tag))
        _dead_channel()

    return basic_reject


def _dead_channel(*args: Any, **kwargs: Any) -> None:
    raise redis.exceptions.ConnectionError(
        "the broker connection this message came on was lost; Redis redelivers it after the visibility timeout"
    )
