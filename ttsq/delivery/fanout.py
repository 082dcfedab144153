"""Which chunks of a document a fan-out sends, without I/O.

A document's fan-out (``ttsq.worker.documents``) sends each chunk through ``ttsq.sending``: accepted
(recorded) first, then sent. A fan-out whose worker died half way is resumed on the document's
redelivery with the same chunk ids, and must send only the chunks no fan-out sent before: the first one
sent some, and those may be anywhere by now (queued, popped, running, finished, lost). ``unsent`` is the
rule; ``choose`` asks for what the rule needs, in the order it must be read, and the fan-out answers
each ask from Redis (``drive``) and sends what it returns. ``tests/test_fanout_simulation.py`` drives the
same ``choose`` through many thousands of resumed fan-outs, other steps between its two reads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Generator, Sequence


class Read(enum.Enum):
    """What ``choose`` asks to be read, for all the chunk ids: the ids it answers with."""

    #: The ids with an accepted record.
    RECORDS = "records"
    #: The ids with a result (of any state).
    RESULTS = "results"


def choose(ids: Sequence[str]) -> Generator[Read, Collection[str], list[str]]:
    """The chunks to send of ``ids``: asks for the records, then the results (the order ``unsent`` needs),
    and returns what ``unsent`` answers."""
    recorded = yield Read.RECORDS
    finished = yield Read.RESULTS
    return unsent(ids, recorded, finished)


def drive(chooser: Generator[Read, Collection[str], list[str]], read: Callable[[Read], Collection[str]]) -> list[str]:
    """Answer each of ``chooser``'s asks with ``read``, at once; what it returns."""
    ask = next(chooser)
    while True:
        try:
            ask = chooser.send(read(ask))
        except StopIteration as done:
            chosen: list[str] = done.value
            return chosen


def unsent(ids: Sequence[str], recorded: Collection[str], finished: Collection[str]) -> list[str]:
    """The chunk ids of ``ids`` (in their order) to send: those with neither an accepted record
    (``recorded``, read first) nor a result (``finished``: a result of any state, read after).

    A chunk with a record was sent: its record is written before its message, and stays until its result
    is stored (it is queued, held, waiting its turn, or lost, and then the sweeper sends it again from the
    record). A chunk with a result was run; its record is dropped only after its result is stored. So
    every chunk ever sent is in one of the two sets, provided the records are read before the results: a
    chunk that finishes between the reads (its result stored, then its record dropped) is seen by the
    second read. Read the other way round, such a chunk is in neither and is sent a second time.

    The broker is not asked: a message a worker is popping is in no list and not yet in kombu's unacked
    hash (its fetch window), and a rule that went by the broker sent such a chunk twice."""
    return [task_id for task_id in ids if task_id not in recorded and task_id not in finished]
