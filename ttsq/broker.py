"""What the broker holds, read straight from Redis: queue depths and messages delivered but unacked.

Celery's Redis transport (kombu) keeps each queue as a list (one more per priority level) and every
message a worker has taken but not acknowledged in the ``unacked`` hash. Workers export these as
metrics; ``ttsq stats`` prints them.
"""

from __future__ import annotations

import redis

# kombu's Redis transport keeps priority levels other than 0 in lists named queue + sep + level.
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = (3, 6, 9)
#: kombu's hash of delivered, unacknowledged messages (delivery tag -> message), all queues.
UNACKED_KEY = "unacked"


def queue_depth(client: redis.Redis, queue: str) -> int:
    """Messages waiting in ``queue`` on a kombu Redis broker, every priority level included."""
    names = [queue, *(f"{queue}{_PRIORITY_SEP}{step}" for step in _PRIORITY_STEPS)]
    with client.pipeline(transaction=False) as pipe:
        for name in names:
            pipe.llen(name)
        return sum(int(n) for n in pipe.execute())


def unacked(client: redis.Redis) -> int:
    """Messages delivered to a worker and not yet acknowledged, all queues."""
    return int(client.hlen(UNACKED_KEY))
