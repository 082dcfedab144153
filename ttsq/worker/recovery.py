"""Recovery in seconds: what a dead worker process held goes back to its queue at once.

Every worker process beats as a *holder* (``ttsq.records.holders``) and keeps the set of delivery tags
it holds beside kombu's ``unacked`` hash (``ttsq.delivery.transport.HeldQoS``). Every second, each worker
looks for holders that are dead: marked so by the launcher that saw the process exit, or silent (no
heartbeat for ``HOLDER_TTL_S``) in two looks ``CONFIRM_S`` apart, so that a Redis restart, after which
live workers beat again within ``HOLDER_BEAT_S``, never passes for a death (these rules live without
I/O in ``ttsq.delivery.holders``, driven through a simulated fleet by
``tests/test_delivery_holders_sim.py``). It gives each of their tags back with kombu's own
``restore_by_tag`` (one transaction: a tag acknowledged meanwhile is not pushed), each claimed first
(moved from the dead holder's held set to this process's own, refused while the holder beats: of two
looks that give back one holder only the one that moved a tag restores it, where the other would find
the entry of the worker that popped it again, same tag, and push it twice), marks the job ``REQUEUED``
unless it has a final result (``ttsq status`` says its worker died), and forgets the holder once it
holds nothing.

A live process renews the delivery time of what it holds on its live broker connection with every beat
(``Holders.keep_alive``): a long stitch or batch is never given to a second worker by kombu's visibility
timeout while the first still works on it. Messages it held on a connection it lost (a Redis restart, a
failover) it still finishes; their acks, which cannot go on that connection, it makes here on a new one
(``Holders.acknowledge``) at its next look, with the acks it made on the lost one in its last moments,
which a failover may have lost (``ttsq.delivery.acks``). A message a worker of an older ttsq held is left to the
visibility timeout. A
message no holder recorded (the worker died between kombu popping it and recording it) is in no
record of the broker's: the accepted-job ledger's sweeper sends it again (``ttsq.worker.sweeper``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.states import READY_STATES

from ttsq.app import stored_result
from ttsq.constants import ACKS_REMEMBERED_S, HOLDER_BEAT_S, HOLDER_TTL_S, REQUEUED_STATE
from ttsq.delivery.acks import ACK, GIVE_BACK, LEAVE, Acks, on_new_connection
from ttsq.delivery.holders import DeadHolders
from ttsq.errors import CorruptRecord
from ttsq.records.holders import Holders
from ttsq.records.scripts import register

if TYPE_CHECKING:
    from celery import Celery

    from ttsq.observer import Observer

logger = logging.getLogger(__name__)

#: How often a worker looks for dead holders (seconds).
LOOK_INTERVAL_S = 1.0
#: How long a holder must stay silent, seen so in two looks, before its messages go back (seconds).
CONFIRM_S = 2 * HOLDER_BEAT_S


class Recovery:
    """This process's heartbeat as a holder, and the return of what dead holders held."""

    def __init__(
        self,
        app: Celery,
        holders: Holders,
        observer: Observer,
        *,
        name: str,
        node: str,
        stopping: Callable[[], bool] = lambda: False,
        acks: Acks | None = None,
    ) -> None:
        """``name``: this process's incarnation; ``app``: the worker's own, whose channel gives tags back;
        ``acks``: what it holds on its live broker connection and the acks to make on a new one
        (``ttsq.worker.gate.Gate.acks``)."""
        self.name = name
        self.node = node
        self.holders = holders
        self.observer = observer
        self._app = app
        self._stopping = stopping  # the runtime's: this ends with the worker it serves
        self.acks = acks if acks is not None else Acks(remember_s=ACKS_REMEMBERED_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ttsq-recovery", daemon=True)
        #: Which other holders are dead, from look to look (time.monotonic()).
        self.dead = DeadHolders(me=name, confirm_s=CONFIRM_S)
        self._store_unless_done: Any = None

    def start(self) -> None:
        """Beat and look, on a thread of its own, from now on. Until its first beat nobody lists this
        process as a holder (only a beat does): what it holds meanwhile is never taken for a dead one's."""
        self._thread.start()

    def stop(self) -> None:
        """Stop beating: what this process still holds goes back once its heartbeat runs out."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=LOOK_INTERVAL_S + 10)

    def _run(self) -> None:
        last_beat = -HOLDER_BEAT_S  # the first beat at once
        while not self._stopping():
            try:
                if time.monotonic() - last_beat >= HOLDER_BEAT_S:
                    self.holders.beat(self.name, ttl_s=HOLDER_TTL_S, info={"node": self.node})
                    self.holders.keep_alive(self.acks.live())
                    last_beat = time.monotonic()
                self.acknowledge_late()
                self.recover()
            except Exception as exc:  # Redis restarting, most likely: the next look tries again
                logger.warning("looking for dead workers failed: %s: %s", type(exc).__name__, exc)
            if self._stop.wait(LOOK_INTERVAL_S):
                return

    def acknowledge_late(self) -> int:
        """Make the acks due on a new connection (``ttsq.delivery.acks``: of messages finished after
        their connection was lost, and the acks made on it lately, which a failover may have lost); return
        how many entries of kombu's ``unacked`` hash they removed. A message of this process's whose job
        has no final result (lost with the same writes as its ack, most likely) goes back to the head of
        its queue instead, to run now. Redis still away: they wait for the next look."""
        tags = self.acks.due()
        if not tags:
            return 0
        entries = self.holders.entries(self.name, tags)
        decided: dict[str, list[str]] = {ACK: [], GIVE_BACK: [], LEAVE: []}
        for tag, (raw, mine) in entries.items():
            present, running = raw is not None, self.acks.running(tag)
            over = self._over(raw) if present and mine and not running else True
            decided[on_new_connection(present=present, mine=mine, running=running, over=over)].append(tag)
        acked, again = decided[ACK], decided[GIVE_BACK]
        removed = self.holders.acknowledge(self.name, acked)
        if again:
            with self._app.connection_for_write() as connection:
                qos = connection.default_channel.qos
                for tag in again:
                    qos.restore_by_tag(tag, leftmost=False)  # to the head of its queue: next to run
            self.observer.jobs_requeued(len(again))
            logger.warning(
                "%d message(s) acknowledged before Redis lost its last writes have no result: back to the queue",
                len(again),
            )
        self.acks.made(acked, time.monotonic())
        self.acks.gave_back(again)
        self.acks.left(decided[LEAVE])
        logger.info(
            "acknowledged %d message(s) on a new broker connection after the last was lost (%d still unacknowledged)",
            len(acked),
            removed,
        )
        return removed

    def _over(self, raw: Any) -> bool:
        """Whether the job of an ``unacked`` entry has a final result (or the entry names no job: a
        refused message's), or one that is not ttsq's. The result backend away: ``BrokerError``, and the
        acks wait for the next look."""
        task_id = _task_id_of(raw)
        if task_id is None:
            return True
        try:
            return stored_result(self._app, task_id).state in READY_STATES
        except CorruptRecord:
            return True

    def recover(self) -> int:
        """Give back what every dead holder held (``ttsq.delivery.holders`` decides who is dead); return how
        many messages went back."""
        returned = 0
        now, server = time.monotonic(), self.holders.server()
        for name, why in self.dead.look(now, self.holders.states(), server=server):
            returned += self._give_back(name, why=why)
            self.dead.gave_back(name)
        return returned

    def _give_back(self, name: str, *, why: str) -> int:
        tags = self.holders.held(name)
        returned = 0
        if tags:
            with self._app.connection_for_write() as connection:
                qos = connection.default_channel.qos
                client = connection.default_channel.client
                for tag in tags:
                    # Claimed first (moved to this process's own held set, which the restore empties in
                    # its transaction): another look giving back the same holder, or one that sees it
                    # beat again, leaves the tag alone.
                    if not self.holders.claim(name, tag, into=self.name):
                        continue
                    self._mark_requeued(client.hget(qos.unacked_key, tag), name)
                    qos.restore_by_tag(tag, leftmost=False)  # to the head of its queue: next to run
                    returned += 1
            if returned:
                self.observer.jobs_requeued(returned)
                logger.warning(
                    "worker process %s died (%s): %d message(s) it held went back to the queue", name, why, returned
                )
        self.holders.retire(name)
        return returned

    def _mark_requeued(self, raw: Any, holder: str) -> None:
        """``ttsq status`` of a job given back says its worker died, unless the job has a final result."""
        task_id = _task_id_of(raw)
        if task_id is None:
            return  # the message goes back all the same; its state only says less
        backend = self._app.backend
        if self._store_unless_done is None:
            self._store_unless_done = register(backend.client, "progress_unless_done")
        meta: dict[str, Any] = {
            "status": REQUEUED_STATE,
            "result": {"reason": f"its worker {holder.split('#', 1)[0]} died; waiting to run again"},
            "traceback": None,
            "children": [],
            "date_done": None,
            "task_id": task_id,
        }
        try:
            self._store_unless_done(
                keys=[backend.get_key_for_task(task_id)],
                args=[backend.encode(meta), int(backend.expires or 0)],
                client=backend.client,
            )
        except Exception as exc:  # the state is for watching; the message goes back regardless
            logger.debug("could not mark job %s requeued: %s", task_id, type(exc).__name__)


def _task_id_of(raw: Any) -> str | None:
    """The job id of an entry of kombu's ``unacked`` hash (its message, exchange and routing key)."""
    try:
        payload = json.loads(raw) if raw else None
        task_id = payload[0]["headers"]["id"] if isinstance(payload, list) else None
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return task_id if isinstance(task_id, str) else None
