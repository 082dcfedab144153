"""Which of a worker process's acks go on its broker connection and which are made later on a new one,
without I/O.

kombu acknowledges a message on the connection it came on: the ack deletes the message's entry in
kombu's ``unacked`` hash. A worker's broker connection can drop while it holds messages (Redis restarts,
a Sentinel failover): the worker finishes them, and their acks cannot go on the connection they came on.
kombu logs "Couldn't ack" and leaves the entry, which kombu's visibility timeout (an hour) pushes back
to the queue: the job runs again an hour later, and until then ``ttsq`` counts it unacknowledged. A
failover can also lose acks that did go through: the replica that takes over never received the writes
of the old primary's last moments (replication is asynchronous), and an entry they deleted is back,
often with the job's result, stored a moment before its ack, gone too.

The rules, kept by one ``Acks`` per worker process (``ttsq.worker.gate.Gate.acks``), fed by the
transport (``ttsq.delivery.transport``: ``HeldQoS``, ``GatedConsumer``) and read by the recovery thread
(``ttsq.worker.recovery``):

- A message popped (``held``) is **running** and **held live** until kombu drops its entry on the live
  connection (``dropped``: its ack, its reject), or its ack or reject is handed on after the connection
  was lost (``later``, ``abandoned``). The heartbeat renews the delivery time of what is held live
  (``live``), so the visibility timeout never gives a long job to a second worker.
- An ack made on the live connection (``acked``) is **remembered** while the connection made no ack
  ``remember_s`` later.
- The connection is **lost** (``lost``: the consumer saw it drop): nothing is held live any more; every
  ack remembered is **due** again (a failover may have lost it), and so is every ack from then on of a
  message that came on the lost connection (``later``), as is one that failed on a connection still
  taken for live (``failed``: it dropped as the job finished, before the consumer noticed).
- The recovery thread takes up what is **due** at its next look, on a new connection, and says what it
  did (``made``, ``gave_back``, ``left``); a look that cannot reach Redis leaves them due for the next.
  What it does with each it decides from what Redis holds then (``on_new_connection``): an entry that
  is gone, or is another process's (the message went back and another worker popped it again, same
  tag), or is of a copy this process popped again and still runs, is **left** to whoever holds it, whose
  run acks it; an entry of its own whose job has a final result is **acked**; one whose job has none
  is **given back** to the head of its queue, to run now (the writes a failover lost held its result
  too: an ack made blindly would leave the job with neither its result nor a message, and the ledger's
  sweeper sends again only a job no worker received).

What is due is bounded by what the process held when the connection went (its prefetch) and the acks of
its last ``remember_s``; what is running, by its prefetch. ``tests/test_delivery_holders_sim.py`` drives
these rules through a simulated fleet with Redis restarts that cut every connection and lose their last
writes.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Collection
from typing import Literal

#: What the recovery thread does with an ack due on a new connection (``on_new_connection``).
ACK: Literal["ack"] = "ack"
GIVE_BACK: Literal["give back"] = "give back"
LEAVE: Literal["leave"] = "leave"
Decision = Literal["ack", "give back", "leave"]


def on_new_connection(*, present: bool, mine: bool, running: bool, over: bool) -> Decision:
    """An ack due on a new connection: ``present``, its entry is in kombu's ``unacked`` hash; ``mine``,
    the tag is in this process's held set; ``running``, this process runs a copy popped under the tag
    since; ``over``, the entry's job has a final result (or it names no job)."""
    if not present or not mine or running:
        return LEAVE
    return ACK if over else GIVE_BACK


class Acks:
    """One worker process's acks, by connection; safe to share between its consumer and recovery threads."""

    def __init__(self, *, remember_s: float) -> None:
        """``remember_s``: how long an ack made is kept to be made again after a lost connection."""
        self.remember_s = remember_s
        self._running: Counter[str] = Counter()  # a message given back keeps its tag: copies are counted
        self._live: set[str] = set()
        self._due: set[str] = set()
        self._recent: deque[tuple[float, str]] = deque()  # (made at, tag), oldest first
        self._lock = threading.Lock()

    def held(self, tag: str) -> None:
        """``tag`` was popped on the live connection."""
        with self._lock:
            self._running[tag] += 1
            self._live.add(tag)

    def dropped(self, tag: str) -> None:
        """kombu is dropping ``tag``'s entry on the live connection (an ack, a reject, a restore)."""
        with self._lock:
            self._done(tag)
            self._live.discard(tag)

    def acked(self, tag: str, now: float) -> None:
        """``tag``'s ack (its entry dropped) went through on the live connection at ``now`` (the caller's
        monotonic clock)."""
        with self._lock:
            self._forget(now)
            self._recent.append((now, tag))

    def lost(self) -> None:
        """The connection dropped: what it held is no longer kept alive, and the acks made on it in its
        last ``remember_s`` are made again on a new one. Counted back from its last ack, not from now: a
        process paused across a failover notices the loss when it wakes, long after."""
        with self._lock:
            self._live.clear()
            self._due.update(tag for _, tag in self._recent)
            self._recent.clear()

    def failed(self, tag: str) -> None:
        """``tag``'s ack (its entry dropped) failed on the connection still taken for live: it is made on
        a new one."""
        with self._lock:
            self._live.discard(tag)
            self._due.add(tag)

    def later(self, tag: str) -> None:
        """``tag``'s message came on a connection lost since: its ack is made on a new one."""
        with self._lock:
            self._done(tag)
            self._due.add(tag)

    def abandoned(self, tag: str) -> None:
        """``tag``'s reject could not go on the connection its message came on: the message stays
        unacknowledged, for the visibility timeout; this process no longer runs it."""
        with self._lock:
            self._done(tag)

    def live(self) -> frozenset[str]:
        """The tags held on the live connection, for the heartbeat to keep alive."""
        with self._lock:
            return frozenset(self._live)

    def due(self) -> frozenset[str]:
        """The acks to take up on a new connection."""
        with self._lock:
            return frozenset(self._due)

    def running(self, tag: str) -> bool:
        """Whether this process runs a copy of ``tag``'s message."""
        with self._lock:
            return self._running[tag] > 0

    def made(self, tags: Collection[str], now: float) -> None:
        """``tags`` were acknowledged on a new connection at ``now``: remembered like any ack made, since
        another failover may lose them too."""
        with self._lock:
            self._due.difference_update(tags)
            self._forget(now)
            self._recent.extend((now, tag) for tag in tags)

    def gave_back(self, tags: Collection[str]) -> None:
        """``tags`` went back to their queue instead: not remembered (made again, that could give back a
        copy this process popped since and runs)."""
        with self._lock:
            self._due.difference_update(tags)

    def left(self, tags: Collection[str]) -> None:
        """``tags`` were left to whoever holds their entry now (``LEAVE``)."""
        with self._lock:
            self._due.difference_update(tags)

    def _done(self, tag: str) -> None:
        if self._running[tag] > 1:
            self._running[tag] -= 1
        else:
            self._running.pop(tag, None)

    def _forget(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self.remember_s:
            self._recent.popleft()
