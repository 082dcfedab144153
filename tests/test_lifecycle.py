"""The lifecycle table (``ttsq.delivery.lifecycle``) against the code and the docs: the diagram in
docs/guarantees.md is the one the table draws, every script and function a move names exists, every
script of the accepted-job ledger is a move or says why not, every state is reachable and can end, and
the final states keep their jobs but for the exits the docs name. Pure data and a few subprocesses:
no services."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest

from ttsq.delivery.lifecycle import (
    FINAL,
    FINAL_EXITS,
    INITIAL,
    NOT_TRANSITIONS,
    SHOWN,
    TABLE,
    TRANSITIONS,
    Event,
    State,
    Transition,
    mermaid,
    step,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
LUA = ROOT / "ttsq" / "records" / "lua"
GENERATOR = DOCS / "lifecycle_diagram.py"


def run_generator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=60)


# --- the page ------------------------------------------------------------------------------------


def test_the_diagram_in_the_guarantees_is_fresh() -> None:
    out = run_generator("--check")
    assert out.returncode == 0, out.stderr
    assert f"```mermaid\n{mermaid()}```" in (DOCS / "guarantees.md").read_text(encoding="utf-8")


def test_the_check_names_a_stale_page(tmp_path: Path) -> None:
    page = (DOCS / "guarantees.md").read_text(encoding="utf-8")
    stale = tmp_path / "guarantees.md"
    stale.write_text(page.replace("    held --> running : received\n", ""), encoding="utf-8")
    out = run_generator("--check", "--output", str(stale))
    assert out.returncode == 1
    assert f"{stale} is stale" in out.stderr
    # A page without the markers has nowhere for the diagram: refused, not written around.
    bare = tmp_path / "bare.md"
    bare.write_text("# Guarantees\n", encoding="utf-8")
    assert run_generator("--output", str(bare)).returncode == 1
    assert bare.read_text(encoding="utf-8") == "# Guarantees\n"
    # Rewriting a stale page makes it fresh.
    assert run_generator("--output", str(stale)).returncode == 0
    assert stale.read_text(encoding="utf-8") == page


def test_python_m_prints_the_diagram_without_loading_celery() -> None:
    code = (
        "import runpy, sys, io, contextlib\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    runpy.run_module('ttsq.delivery.lifecycle', run_name='__main__')\n"
        "assert 'celery' not in sys.modules and 'torch' not in sys.modules, 'heavy imports'\n"
        "sys.stdout.write(out.getvalue())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == mermaid()
    assert out.stdout.startswith("stateDiagram-v2\n    [*] --> accepted\n")


# --- the table against the code ------------------------------------------------------------------


def _refs() -> set[str]:
    return {ref for move in TRANSITIONS for ref in move.by}


def test_every_move_but_a_fault_names_the_code_that_makes_it() -> None:
    for move in TRANSITIONS:
        assert bool(move.by) != move.fault, f"{move}: a fault names no code, any other move does"
        for ref in move.by:
            assert ref.endswith(".lua") or re.fullmatch(r"[a-z_.]+:[A-Za-z_.]+", ref), ref


def test_every_lua_script_named_exists_and_is_registered() -> None:
    """Named by a move, a script is a file of ttsq/records/lua that some module of ttsq registers (a file
    nothing loads makes no move)."""
    registered = set()
    for path in (ROOT / "ttsq").rglob("*.py"):
        registered |= set(re.findall(r"register\([^,()]+, \"(\w+)\"\)", path.read_text(encoding="utf-8")))
    for ref in sorted(r for r in _refs() | set(NOT_TRANSITIONS) if r.endswith(".lua")):
        assert (LUA / ref).is_file(), f"{ref}: no such script in ttsq/records/lua"
        assert ref.removesuffix(".lua") in registered, f"{ref}: no module of ttsq registers it"


def test_every_function_named_resolves_without_torch() -> None:
    """Each ``module:qualname`` imports and resolves, in a fresh interpreter that never loads torch: ttsq's
    modules outside the qwen engines, or kombu's own for what kombu does."""
    functions = sorted(r for r in _refs() if not r.endswith(".lua"))
    for ref in functions:
        module = ref.split(":")[0]
        assert module.startswith(("ttsq.", "kombu.")) and not module.startswith("ttsq.engines.qwen"), ref
    code = (
        "import importlib, json, sys\n"
        "missing = []\n"
        "for ref in json.loads(sys.argv[1]):\n"
        "    module, qualname = ref.split(':')\n"
        "    target = importlib.import_module(module)\n"
        "    for part in qualname.split('.'):\n"
        "        target = getattr(target, part, None)\n"
        "    if not callable(target): missing.append(ref)\n"
        "assert not missing, f'not found: {missing}'\n"
        "assert 'torch' not in sys.modules, 'resolving the table loaded torch'\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(functions)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_ledger_scripts_are_moves_or_say_why_not() -> None:
    """Every script that writes a job's one record (the accepted-job ledger's, and the attempts charged in
    it) changes a job's state (a move names it) or is listed with the reason it does not: a new script
    there must find its place in the table."""
    records = ROOT / "ttsq" / "records"
    source = "".join((records / name).read_text(encoding="utf-8") for name in ("accepted.py", "attempts.py"))
    scripts = {f"{name}.lua" for name in re.findall(r"register\(client, \"(\w+)\"\)", source)}
    assert len(scripts) >= 9, scripts  # the pattern still finds them
    named = {ref for ref in _refs() if ref.endswith(".lua")}
    assert scripts - named - set(NOT_TRANSITIONS) == set()
    assert set(NOT_TRANSITIONS) & named == set(), "a script is a move, or says why it is none: not both"


def test_every_move_names_a_guarantee_its_page_states() -> None:
    for move in TRANSITIONS:
        page, phrase = move.serves
        assert phrase in (DOCS / page).read_text(encoding="utf-8"), f"{move.event.value}: {page} has no {phrase!r}"


# --- the machine's shape -------------------------------------------------------------------------


def _reachable(start: State) -> set[State]:
    seen, todo = {start}, deque([start])
    while todo:
        state = todo.popleft()
        for move in TRANSITIONS:
            if move.source is state and move.target not in seen:
                seen.add(move.target)
                todo.append(move.target)
    return seen


def test_every_state_is_reachable_from_the_first() -> None:
    assert _reachable(INITIAL) == set(State)


def test_every_state_can_end() -> None:
    stuck = [state.value for state in State if state not in FINAL and not (_reachable(state) & FINAL)]
    assert not stuck, f"no way to a final state from {stuck}"


def test_a_final_state_is_left_only_by_the_exits_the_docs_name() -> None:
    exits = {(move.source, move.event) for move in TRANSITIONS if move.source in FINAL}
    assert exits == set(FINAL_EXITS)
    # The one exit: an operator's `ttsq retry` of a parked job, as the guarantees say.
    assert set(FINAL_EXITS) == {(State.PARKED, Event.RETRIED)}
    assert "`ttsq retry ID` re-queues it" in (DOCS / "guarantees.md").read_text(encoding="utf-8")


def test_every_state_shows_something_and_every_event_moves_a_job() -> None:
    assert set(SHOWN) == set(State)
    assert {move.event for move in TRANSITIONS} == set(Event)


def test_what_each_state_shows_is_a_state_the_result_backend_answers() -> None:
    """Celery's own state names, or what ``ttsq status`` says of an id with no record (``UnknownJob``)."""
    from celery import states

    from ttsq.client import unknown_job
    from ttsq.errors import UnknownJob

    said = str(unknown_job("x"))
    assert isinstance(unknown_job("x"), UnknownJob) and "unknown job" in said, said
    for state, shown in SHOWN.items():
        assert shown.celery in states.ALL_STATES or shown.celery == "unknown job", (state, shown.celery)


# --- step ----------------------------------------------------------------------------------------


def test_step_follows_the_table() -> None:
    for (state, event), move in TABLE.items():
        assert step(state, event) is move.target
    # A job's usual road, and a lost one's.
    state = INITIAL
    for event in (Event.SENT, Event.POPPED, Event.RECEIVED, Event.SUCCEEDED):
        state = step(state, event)
    assert state is State.DONE
    assert step(step(State.QUEUED, Event.MESSAGE_LOST), Event.SENT_AGAIN) is State.QUEUED


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (State.QUEUED, Event.SENT_AGAIN),  # a job on its way is never sent again
        (State.QUEUED, Event.RECEIVED),  # received only once a worker popped it
        (State.DONE, Event.CANCELLED),  # a settled job's cancel answers its state and changes nothing
        (State.DEAD_LETTERED, Event.RETRIED),  # a dead letter never comes back
        (State.CANCELLED, Event.SUCCEEDED),  # a cancel that won is what happens
    ],
)
def test_step_refuses_a_move_the_table_lacks(state: State, event: Event) -> None:
    with pytest.raises(ValueError, match=f"a job {state.value} cannot take {event.value}"):
        step(state, event)


def test_two_moves_for_one_state_and_event_are_refused() -> None:
    from ttsq.delivery import lifecycle

    twice = (*TRANSITIONS, Transition(State.QUEUED, Event.POPPED, State.LOST, ("x.lua",), ("guarantees.md", "x")))
    with pytest.raises(ValueError, match="two moves for popped from queued"):
        lifecycle._table(twice)
