"""A job's delivery lifecycle as data, without I/O: its states, the events that move it, and for each move
the code that makes it and the guarantee it serves (docs/guarantees.md, "A job's lifecycle").

This module describes the lifecycle; it does not own it. A job has one record in the accepted-job ledger,
whose ``state`` field each of the ledger's scripts writes as it moves the job (``RECORDED`` says what it
reads in each state), and where cancel and settle decide the job's outcome. Where its message is lives
in kombu's lists and ``unacked`` hash and the holders' sets; the ledger's unseen and received sets and
the tenants' deferred lists index the records; the attempts, the parked jobs, the dead letters and
Celery's result states are kept apart. Each is written by the script or function a transition names.
``tests/test_lifecycle.py`` ties the description to the code: every Lua script and ``module:qualname``
named here exists, every script of the accepted-job ledger is a transition here or says why it is none,
every state is reachable and can end, and the diagram in docs/guarantees.md is the one ``mermaid``
draws. ``tests/test_delivery_simulation.py`` moves each simulated job through ``step``.

    python -m ttsq.delivery.lifecycle    # the diagram, in Mermaid
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Mapping
from dataclasses import dataclass


class State(str, enum.Enum):
    """Where one job is in its delivery."""

    #: A producer recorded it (``accept.lua``), about to send it.
    ACCEPTED = "accepted"
    #: Waiting in its tenant's place while its queue is full or its tenant at its cap (docs/scheduling.md).
    DEFERRED = "deferred"
    #: Its message is in its queue's list.
    QUEUED = "queued"
    #: No copy of its message anywhere (not queued, not held), yet its record says it is unseen: only
    #: the sweeper can tell, and it sends the job again.
    LOST = "lost"
    #: A worker popped its message and holds it (kombu's ``unacked`` hash, the worker's ``ttsq:held`` set),
    #: not yet marked received by the worker's gate.
    HELD = "held"
    #: The gate marked it received; the worker runs it, or will once a task thread is free (a document:
    #: from its fan-out until its stitch).
    RUNNING = "running"
    #: Its audio is stored and indexed and its outcome settled: SUCCESS.
    DONE = "done"
    #: It failed (deadline passed, storage out of tries, invalid for the worker's model...): FAILURE.
    FAILED = "failed"
    #: It crashed or hung ``TTSQ_MAX_ATTEMPTS`` workers: FAILURE with ``JobParked``, kept for ``ttsq retry``.
    PARKED = "parked"
    #: Its message was refused by the envelope gate, kept raw in ``ttsq:dead``: it never runs.
    DEAD_LETTERED = "dead_lettered"
    #: Cancelled before its worker settled it: REVOKED.
    CANCELLED = "cancelled"
    #: Never sent after all (the send failed, or the submit joined an identical job or found it cached):
    #: its record is withdrawn and its id is unknown.
    WITHDRAWN = "withdrawn"


@dataclass(frozen=True)
class Shown:
    """What an operator sees of a state."""

    #: The state the result backend answers (``ttsq status``, ``Client.status``, ``GET /v1/jobs/{id}``).
    celery: str
    #: Where else it shows (Flower's task list, ``ttsq failed``, ``ttsq dead``...).
    elsewhere: str


SHOWN: Mapping[State, Shown] = {
    State.ACCEPTED: Shown("PENDING", "nothing yet: the submit has not returned"),
    State.DEFERRED: Shown("PENDING", "`ttsq stats`: deferred, per tenant"),
    State.QUEUED: Shown("PENDING", "REQUEUED once its dead worker's message went back; `ttsq stats`: depth"),
    State.LOST: Shown("PENDING", "as queued (REQUEUED too): only the sweeper can tell"),
    State.HELD: Shown("PENDING", "`ttsq stats`: in flight; not in Flower yet"),
    State.RUNNING: Shown("STARTED", "PENDING until a task thread takes it (Flower: RECEIVED); PROGRESS for a document"),
    State.DONE: Shown("SUCCESS", "Flower: SUCCESS"),
    State.FAILED: Shown("FAILURE", "Flower: FAILURE"),
    State.PARKED: Shown("FAILURE", "`JobParked`; `ttsq failed` lists it"),
    State.DEAD_LETTERED: Shown("unknown job", "`ttsq dead` lists it; never shown in Flower"),
    State.CANCELLED: Shown("REVOKED", "Flower: REVOKED"),
    State.WITHDRAWN: Shown(
        "unknown job", "the submit raised `BrokerError`, or answered from the cache or a job it joined"
    ),
}

#: What the job's one record in the ledger says while the job is in each state (its ``state`` field,
#: written by the ledger's scripts as they move it: ``ttsq.records.accepted``); empty where it keeps no
#: record. The record cannot tell a message queued, lost or held apart (kombu's lists and the holders'
#: sets can), and a job given back after its worker died says ``running`` until a worker receives it again.
RECORDED: Mapping[State, frozenset[str]] = {
    State.ACCEPTED: frozenset({"accepted"}),
    State.DEFERRED: frozenset({"deferred"}),
    State.QUEUED: frozenset({"accepted", "running"}),
    State.LOST: frozenset({"accepted", "running"}),
    State.HELD: frozenset({"accepted", "running"}),
    State.RUNNING: frozenset({"running"}),
    State.DONE: frozenset({"done"}),
    State.FAILED: frozenset({"failed"}),
    State.PARKED: frozenset({"failed"}),
    State.DEAD_LETTERED: frozenset(),
    State.CANCELLED: frozenset({"cancelled"}),
    State.WITHDRAWN: frozenset(),
}

#: Where every job starts: a ttsq producer records it before anything else (a raw ``send_task`` from a web
#: backend has no record: it enters at ``queued``, and nothing sends it again if it is lost).
INITIAL = State.ACCEPTED
#: States a job ends in. Only an operator takes a job out of one (``FINAL_EXITS``).
FINAL: frozenset[State] = frozenset(
    {State.DONE, State.FAILED, State.PARKED, State.DEAD_LETTERED, State.CANCELLED, State.WITHDRAWN}
)


class Event(str, enum.Enum):
    """What moves a job: an act of ttsq's code, of kombu's, or a fault."""

    SENT = "sent"
    DEFERRED = "deferred"
    WITHDRAWN = "withdrawn"
    RELEASED = "released"
    POPPED = "popped"
    MESSAGE_LOST = "message_lost"
    SENT_AGAIN = "sent_again"
    RECEIVED = "received"
    REFUSED = "refused"
    HOLDER_DIED = "holder_died"
    VISIBILITY_PASSED = "visibility_passed"
    STALE = "stale"
    STOPPED = "stopped"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    PARKED = "parked"
    CANCELLED = "cancelled"
    RETRIED = "retried"


@dataclass(frozen=True)
class Transition:
    """One move: ``source`` --``event``--> ``target``."""

    source: State
    event: Event
    target: State
    #: The code that performs it: a script of ``ttsq/records/lua`` (``name.lua``) or a ``module:qualname``
    #: (kombu's own for what kombu does). Empty only for a fault, which no code performs.
    by: tuple[str, ...]
    #: The guarantee it serves: a page of docs/ and a phrase of that page that states it.
    serves: tuple[str, str]
    fault: bool = False


_LOST_JOBS = ("guarantees.md", "## Lost jobs")
_KILLED = ("guarantees.md", "**A worker killed**")
_CANCEL = ("guarantees.md", "**Cancel says what then happens:**")
_FAIR = ("scheduling.md", "**Fair shares** separate tenants")
_POISON = ("guarantees.md", "**A poison job**")
_CANCELLING = ("cancel.lua", "ttsq.client:Client.cancel")

S, E, T = State, Event, Transition
#: Every move a job can make, in the order of its delivery.
TRANSITIONS: tuple[Transition, ...] = (
    T(S.ACCEPTED, E.SENT, S.QUEUED, ("ttsq.sending:sending", "ttsq.sending:publish"), _LOST_JOBS),
    T(S.ACCEPTED, E.DEFERRED, S.DEFERRED, ("defer.lua", "ttsq.sending:sending"), _FAIR),
    # The sender died between the record and the send (a producer process, a fan-out's worker): the
    # record stays unseen and no message was ever sent; the sweeper sends it as lost.
    T(S.ACCEPTED, E.MESSAGE_LOST, S.LOST, (), _LOST_JOBS, fault=True),
    T(
        S.ACCEPTED,
        E.WITHDRAWN,
        S.WITHDRAWN,
        ("finish.lua", "ttsq.records.accepted:AcceptedJobs.forget", "ttsq.sending:sending"),
        ("guarantees.md", "withdraws its record"),
    ),
    T(
        S.DEFERRED,
        E.RELEASED,
        S.QUEUED,
        ("release.lua", "ttsq.worker.lanes:Releaser.release", "ttsq.sending:send_released"),
        _FAIR,
    ),
    T(S.DEFERRED, E.CANCELLED, S.CANCELLED, _CANCELLING, _CANCEL),
    T(
        S.QUEUED,
        E.POPPED,
        S.HELD,
        ("ttsq.delivery.transport:GatedChannel._brpop_read", "ttsq.delivery.transport:HeldQoS.append"),
        _KILLED,
    ),
    # A Redis restart or failover that lost the message, kombu's fetch window (popped, not yet recorded as
    # unacknowledged), a release whose send failed: the record stays unseen, the message is nowhere.
    T(S.QUEUED, E.MESSAGE_LOST, S.LOST, (), _LOST_JOBS, fault=True),
    T(S.QUEUED, E.CANCELLED, S.CANCELLED, (*_CANCELLING, "received.lua"), _CANCEL),
    T(
        S.LOST,
        E.SENT_AGAIN,
        S.QUEUED,
        ("ttsq.delivery.lost:UnseenJobs.looked", "ttsq.worker.sweeper:Sweeper._send_again", "accept.lua"),
        _LOST_JOBS,
    ),
    T(S.LOST, E.CANCELLED, S.CANCELLED, _CANCELLING, _CANCEL),
    T(S.HELD, E.RECEIVED, S.RUNNING, ("ttsq.worker.gate:Gate.admit", "received.lua"), _LOST_JOBS),
    # Final for the message. The gate refuses shapes ttsq's producers do not send (a raw send_task, a
    # hostile envelope: no record); a job ttsq accepted whose message it refused keeps its record, and
    # the sweeper sends it again from there as lost (docs/guarantees.md, "A job's lifecycle").
    T(
        S.HELD,
        E.REFUSED,
        S.DEAD_LETTERED,
        ("ttsq.worker.gate:Gate.refuse",),
        ("guarantees.md", "**A hostile envelope**"),
    ),
    T(
        S.HELD,
        E.HOLDER_DIED,
        S.QUEUED,
        (
            "ttsq.delivery.holders:DeadHolders.look",
            "claim_held.lua",
            "ttsq.worker.recovery:Recovery._give_back",
            "progress_unless_done.lua",
        ),
        _KILLED,
    ),
    # kombu's last resort, whoever holds the message: for one no holder recorded (a worker of an older
    # ttsq). A live worker's are renewed by its beat; what it finished after losing its connection, and
    # what it acknowledged in that connection's last moments (a failover may have lost it), it
    # acknowledges on a new one (``ttsq.delivery.acks``, ``Recovery.acknowledge_late``).
    T(S.HELD, E.VISIBILITY_PASSED, S.QUEUED, ("kombu.transport.redis:QoS.restore_visible",), _KILLED),
    T(S.HELD, E.CANCELLED, S.CANCELLED, _CANCELLING, _CANCEL),
    T(
        S.RUNNING,
        E.SUCCEEDED,
        S.DONE,
        ("ttsq.worker.pipeline:Pipeline.run", "settle.lua", "ttsq.worker.tasks:register_tasks", "finish.lua"),
        _CANCEL,
    ),
    T(S.RUNNING, E.FAILED, S.FAILED, ("ttsq.worker.tasks:_settle", "settle.lua", "finish.lua"), _CANCEL),
    T(
        S.RUNNING,
        E.PARKED,
        S.PARKED,
        (
            "ttsq.worker.pipeline:Pipeline._park",
            "ttsq.worker.documents:Documents._park",
            "ttsq.records.attempts:Ledger.park",
        ),
        _POISON,
    ),
    T(
        S.RUNNING,
        E.HOLDER_DIED,
        S.QUEUED,
        (
            "ttsq.delivery.holders:DeadHolders.look",
            "claim_held.lua",
            "ttsq.worker.recovery:Recovery._give_back",
            "progress_unless_done.lua",
        ),
        _KILLED,
    ),
    T(S.RUNNING, E.VISIBILITY_PASSED, S.QUEUED, ("kombu.transport.redis:QoS.restore_visible",), _KILLED),
    # Received, and no progress for a visibility timeout (a document: two graces, none of its messages
    # anywhere): the broker's record of it was lost too.
    T(S.RUNNING, E.STALE, S.QUEUED, ("ttsq.worker.sweeper:Sweeper._sweep_received", "accept.lua"), _LOST_JOBS),
    # A cold shutdown closed the worker's connections under the job: its message goes back.
    T(
        S.RUNNING,
        E.STOPPED,
        S.QUEUED,
        ("ttsq.worker.tasks:register_tasks",),
        ("guarantees.md", "**Restarts are the supervisor's job.**"),
    ),
    T(S.RUNNING, E.CANCELLED, S.CANCELLED, (*_CANCELLING, "settle.lua", "ttsq.worker.tasks:_revoked"), _CANCEL),
    T(
        S.PARKED,
        E.RETRIED,
        S.QUEUED,
        ("ttsq.client:Client.retry", "ttsq.records.attempts:Ledger.unpark", "accept.lua"),
        _POISON,
    ),
)
del S, E, T

#: The only ways out of a final state, each an operator's act the docs name.
FINAL_EXITS: frozenset[tuple[State, Event]] = frozenset({(State.PARKED, Event.RETRIED)})

#: Scripts of the accepted-job ledger (``ttsq.records.accepted``) that move no job, and why.
NOT_TRANSITIONS: Mapping[str, str] = {
    "touch.lua": "a running document made progress: its staleness starts over, its state does not change",
    "age_in_flight.lua": "a backstop on tenants' in-flight counts: drops what finished by another path",
    "attempt.lua": "an engine call charged to a job or refunded: it counts toward parking, moves nothing",
}


def _table(transitions: tuple[Transition, ...]) -> dict[tuple[State, Event], Transition]:
    table: dict[tuple[State, Event], Transition] = {}
    for move in transitions:
        if (move.source, move.event) in table:
            raise ValueError(f"two moves for {move.event.value} from {move.source.value}")
        table[move.source, move.event] = move
    return table


#: ``TRANSITIONS`` by (state, event).
TABLE: Mapping[tuple[State, Event], Transition] = _table(TRANSITIONS)


def step(state: State, event: Event) -> State:
    """The state a job in ``state`` moves to on ``event``. A move the table does not have is a
    ``ValueError``: whatever asked for it (a simulation, a test) does something ttsq's code never does."""
    move = TABLE.get((state, event))
    if move is None:
        allowed = ", ".join(e.value for (s, e) in TABLE if s is state) or "none"
        raise ValueError(f"a job {state.value} cannot take {event.value} (its moves: {allowed})")
    return move.target


def mermaid() -> str:
    """The lifecycle as a Mermaid ``stateDiagram-v2``: each state with what ``ttsq status`` answers, each
    transition labelled with its event, the final states' ends marked."""
    lines = ["stateDiagram-v2", f"    [*] --> {INITIAL.value}"]
    lines += [f"    {state.value} : {state.value} ({SHOWN[state].celery})" for state in State]
    lines += [f"    {m.source.value} --> {m.target.value} : {m.event.value.replace('_', ' ')}" for m in TRANSITIONS]
    lines += [f"    {state.value} --> [*]" for state in State if state in FINAL]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(mermaid())
