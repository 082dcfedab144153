"""What the broker holds, read straight from Redis: queue depths and messages delivered but unacked.

Celery's Redis transport (kombu) keeps each queue as a list (one more per priority level) and every
message a worker has taken but not acknowledged in the ``unacked`` hash. Workers export these as
metrics; ``ttsq stats`` prints them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ttsq.constants import UNACKED_KEY
from ttsq.records.connection import within

if TYPE_CHECKING:
    import redis

# kombu's Redis transport keeps priority levels other than 0 in lists named queue + sep + level.
_PRIORITY_SEP = "\x06\x16"
_PRIORITY_STEPS = (3, 6, 9)


def _lists(queue: str) -> list[str]:
    """The broker's lists of ``queue``: one per priority level."""
    return [queue, *(f"{queue}{_PRIORITY_SEP}{step}" for step in _PRIORITY_STEPS)]


def queue_depth(client: redis.Redis, queue: str) -> int:
    """Messages waiting in ``queue`` on a kombu Redis broker, every priority level included."""
    with client.pipeline(transaction=False) as pipe:
        for name in _lists(queue):
            pipe.llen(name)
        return sum(int(n) for n in pipe.execute())


def queued_within(client: redis.Redis, queues: list[str], timeout_s: float) -> int:
    """Messages waiting in all of ``queues``, if Redis answers within ``timeout_s`` (else
    ``redis.TimeoutError``): for the batcher, which must never wait on a broker that stopped answering."""
    lists = [name for queue in queues for name in _lists(queue)]
    return sum(int(n) for n in within(client, timeout_s, *(("LLEN", name) for name in lists)))


def unacked(client: redis.Redis) -> int:
    """Messages delivered to a worker and not yet acknowledged, all queues."""
    return int(client.hlen(UNACKED_KEY))


def unacked_by_queue(client: redis.Redis) -> dict[str, int]:
    """Messages delivered and not yet acknowledged, per queue. kombu stores each as
    ``[message, exchange, routing_key]`` (JSON); ttsq's queues are direct, so the routing key is the
    queue's name. A value that does not parse is counted under ``""``: it is held all the same."""
    counts: dict[str, int] = {}
    for raw in client.hvals(UNACKED_KEY):
        try:
            entry = json.loads(raw)
            queue = entry[2] if isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], str) else ""
        except (ValueError, UnicodeDecodeError):
            queue = ""
        counts[queue] = counts.get(queue, 0) + 1
    return counts


#: How many list items one read of a queue takes while looking for messages.
_PAGE = 500


def held(client: redis.Redis, task_ids: set[str], queues: list[str], *, unacked_too: bool = True) -> set[str]:
    """Which of ``task_ids`` have a message in one of ``queues`` (any priority) or, with ``unacked_too``,
    delivered to a worker and not yet acknowledged. Reads the lists page by page and stops once every
    id is found: for an operator's look-up or the sweeper's rare suspicion, never per job."""
    needles = {task_id: f'"id": "{task_id}"'.encode() for task_id in task_ids}
    found: set[str] = set()

    def look(items: list[bytes | str]) -> None:
        for item in items:
            raw = item if isinstance(item, bytes) else item.encode()
            found.update(task_id for task_id, needle in needles.items() if needle in raw)

    for queue in queues:
        for name in _lists(queue):
            start = 0
            while needles.keys() - found:
                page = client.lrange(name, start, start + _PAGE - 1)
                if not page:
                    break
                look(page)
                start += _PAGE
    # The lists first: a message a worker pops in between is in the unacked hash when that is read
    # (but for the instant between kombu's BRPOP and its record, which a second look covers).
    if unacked_too and needles.keys() - found:
        look(client.hvals(UNACKED_KEY))
    return found


def message_held(client: redis.Redis, task_id: str, queues: list[str]) -> bool:
    """Whether a message for ``task_id`` is queued or with a worker (``held``)."""
    return bool(held(client, {task_id}, queues))
