"""Which worker processes holding messages are dead, so that recovery gives back what they held, without I/O.

Recovery (``ttsq.worker.recovery``) keeps one ``DeadHolders`` per worker process. Every look it reads
every holder's state (``ttsq.records.holders.Holders.states``: ``alive``, ``dead`` or ``silent``) and
hands them to ``look``, with the Redis's run id; it gives back the messages of each holder ``look``
answers (each tag claimed, then kombu's ``restore_by_tag``), forgets the holder once it holds nothing,
and says so with ``gave_back``. The rules:

- A holder its launcher marked **dead** (it saw the process exit) is given back at the next look.
- A **silent** holder (its heartbeat, ``HOLDER_TTL_S`` long and renewed every ``HOLDER_BEAT_S``, is gone)
  is given back once it stayed silent, at every look, for ``confirm_s``: a Redis restart that lost the
  heartbeats, or a jump of Redis's clock that expired them early, silences live holders too, and they
  beat again within ``HOLDER_BEAT_S``. A holder seen **alive** starts its silence over.
- A look that finds another Redis than the look before (restarted or failed over: its run id changed)
  starts every silence over: the restart may have lost the heartbeats, and a holder that beat just
  before it, between two looks, would otherwise be given back at once on a silence begun earlier.
- A holder that is no longer listed (another worker gave back what it held and forgot it) is forgotten.
- A process never gives back its own messages, whatever its state reads.

Durations are measured on the caller's own clock (a monotonic one: recovery's), never on Redis's: a jump
of the server's clock can silence a holder early, never shorten a confirmation.

What the rules cannot tell apart: a process that is alive but paused (stopped, a frozen VM, a stall
longer than its heartbeat and the confirmation) reads as silent, and what it held goes back while it
may still run it. How often, and what then guards the job: ``tests/test_delivery_holders_sim.py``.
"""

from __future__ import annotations

from collections.abc import Mapping

from ttsq.records.holders import DEAD

#: The state a holder with a heartbeat reads (``Holders.states``).
ALIVE = "alive"
#: Why a holder's messages go back, as recovery logs it.
WHY_MARKED = "its launcher saw it exit"
WHY_SILENT = "it fell silent"


class DeadHolders:
    """One worker process's view of the other holders, from look to look."""

    def __init__(self, *, me: str, confirm_s: float) -> None:
        """``me``: this process's incarnation, never given back."""
        self.me = me
        self.confirm_s = confirm_s
        self._silent_since: dict[str, float] = {}  # holder -> since
        self._server: object = None

    @property
    def tracked(self) -> int:
        """Holders this view remembers as silent: bounded by the holders listed."""
        return len(self._silent_since)

    def look(self, now: float, states: Mapping[str, str], *, server: object = None) -> list[tuple[str, str]]:
        """A look read every listed holder's state (and ``server``, the Redis it read them from: its run
        id): the holders whose messages go back now, each with why, in the order ``states`` lists them."""
        if server != self._server:
            self._silent_since.clear()
            self._server = server
        for name in set(self._silent_since) - set(states):
            del self._silent_since[name]
        dead: list[tuple[str, str]] = []
        for name, state in states.items():
            if name == self.me:
                continue
            if state == ALIVE:
                self._silent_since.pop(name, None)
                continue
            if state == DEAD:
                dead.append((name, WHY_MARKED))
            elif now - self._silent_since.setdefault(name, now) >= self.confirm_s:
                dead.append((name, WHY_SILENT))
        return dead

    def gave_back(self, name: str) -> None:
        """What ``name`` held went back and it was forgotten: a holder of that name is new from now on."""
        self._silent_since.pop(name, None)
