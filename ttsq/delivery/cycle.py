"""Which queue a worker takes its next message from: kombu's queue cycle, for lanes (docs/scheduling.md).

``LaneCycle`` orders the queues of kombu's ``BRPOP``: interactive queues first, except that every Nth
message is offered to the bulk lane first (``TTSQ_BULK_SHARE_PERCENT``), so a bulk backlog never starves.
While interactive work is coming (a message in the last ``INTERACTIVE_RECENT_S``), bulk messages may not
take the last ``reserve`` of the worker's prefetch slots: an interactive message is then taken in at
once, instead of waiting in Redis for a batch of bulk work to finish and free a slot. Each lane is still
FIFO, which the lost-job sweeper relies on (a job is suspect once its queue moved past it); priorities
inside one queue would break that, which is why lanes are queues. No I/O: the channel
(``ttsq.delivery.transport.GatedChannel``) asks it and tells it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ttsq.job import lane_of

#: Interactive work counts as coming for this long after its last message (seconds).
INTERACTIVE_RECENT_S = 5.0
#: While bulk is held to its cap, ``BRPOP`` asks the interactive queues alone, this briefly (seconds), so
#: that a bulk slot freed meanwhile is filled within this long (kombu's own wait is a second).
CAPPED_BRPOP_TIMEOUT_S = 0.02


class LaneCycle:
    """kombu's queue cycle (the interface of ``kombu.utils.scheduling.round_robin_cycle``) for lanes:
    ``consume`` gives the order ``BRPOP`` tries the queues in, ``rotate`` hears which queue a message
    came from. Round robin between the queues of one lane (the modes a worker serves)."""

    def __init__(
        self, bulk_share_percent: int, *, bulk_cap: int = 0, bulk_held: Callable[[], int] | None = None
    ) -> None:
        """``bulk_cap``: the most bulk messages the worker holds while interactive work is coming (0: no
        cap); ``bulk_held`` counts those it holds now."""
        self.items: list[str] = []
        #: Every ``every``-th message, the bulk lane is asked first.
        self.every = max(1, round(100 / bulk_share_percent))
        self.taken = 0
        self.bulk_cap = bulk_cap
        self._bulk_held = bulk_held
        self._interactive_at = -INTERACTIVE_RECENT_S

    @property
    def bulk_capped(self) -> bool:
        """Whether bulk messages must wait: interactive work is coming and bulk holds its share of slots."""
        return (
            self.bulk_cap > 0
            and self._bulk_held is not None
            and time.monotonic() - self._interactive_at < INTERACTIVE_RECENT_S
            and self._bulk_held() >= self.bulk_cap
        )

    def update(self, it: list[str]) -> None:
        self.items[:] = it

    def consume(self, n: int) -> list[str]:
        items = self.items[:n]
        interactive = [queue for queue in items if lane_of(queue) == "interactive"]
        bulk = [queue for queue in items if lane_of(queue) == "bulk"]
        if interactive and self.bulk_capped:
            return interactive
        return bulk + interactive if self.taken % self.every == self.every - 1 else interactive + bulk

    def rotate(self, last_used: str) -> str:
        self.taken += 1
        if lane_of(last_used) == "interactive":
            self._interactive_at = time.monotonic()
        items = self.items
        if last_used in items:
            items.append(items.pop(items.index(last_used)))
        return last_used
