"""Would a Redis Streams transport pay its way? kombu's list transport beside a consumer-group path, measured.

Issue 42 asks whether a Redis Streams transport (one stream per lane, consumer groups, ``XAUTOCLAIM`` for a
dead consumer's messages) would retire most of the code ttsq keeps on top of kombu's Redis transport. This
script measures both at the message level against one redis-server of its own, in the same run:

- **kombu**: today's broker path. A producer app built by ``ttsq.app.make_app`` with ttsq's settings sends
  ``ttsq.synthesize`` envelopes (``send_task``: LPUSH, plus the task-sent event Celery publishes for
  Flower); ``--consumers`` processes consume both lanes of the queue through the transport a ttsq worker
  uses (``GatedTransport``: kombu's Redis channel with the envelope check, the lane cycle and ``HeldQoS``'s
  held set) with the worker's prefetch (``2 * max_batch`` = 16, acks late: BRPOP, the ``unacked`` hash and
  index and the held set, ack). Celery's consumer and ttsq's gate above it (the accepted-job ledger's
  mark) are not run: they stay whatever the transport.
- **streams**: a minimal consumer-group path with redis-py: XADD of the same envelope bytes to the
  interactive lane's stream; the same number of consumer processes, each ``XREADGROUP COUNT 16 BLOCK``
  over both lanes' streams, and per message ``XACK`` + ``XDEL`` in one round trip (a queue must delete
  what it acknowledged, or the stream grows with every job ever sent).

Per path, in rounds interleaved between the two (``--rounds``, medians reported): the producer alone
sends ``--messages`` into an empty queue (sent/s, and the Redis memory per queued message: ``used_memory``
before and after), then the consumers alone drain it (consumed/s, from the first consumer's start);
msg/s is the round's messages over both. Over the whole round: Redis commands per message (INFO
commandstats before and after, broken down by command; ``info`` itself left out), Redis's own time
executing them (commandstats' ``usec``), and round trips per message (requests the processes' redis-py
connections wrote: a pipeline is one). The streams path is bare redis-py, with none of kombu's or Celery's
Python per message: its msg/s is what Redis allows, not what a kombu transport on streams would reach;
commands, round trips, Redis time and memory are what would carry over.

Then the recovery of a dead consumer's messages over Streams, with ttsq's own timing as the yardstick
(``HOLDER_BEAT_S``, ``HOLDER_TTL_S`` as ``XAUTOCLAIM``'s min-idle, a look every ``LOOK_INTERVAL_S``):
three consumers each read 16 messages; one is SIGKILLed, one stays busy and renews its messages' idle time
every beat (``XCLAIM ... JUSTID``: the heartbeat a Streams transport still needs), one stays busy without
renewing. A claimer runs ``XAUTOCLAIM`` every look and reports when the dead one's messages came back and
how many it took from each live one. Today's recovery (``ttsq.worker.recovery``) is computed from the same
constants and measured: a process consuming through ttsq's ``GatedTransport`` (``HeldQoS`` keeps its held
set) and beating as a holder takes 16 messages and is SIGKILLed; ttsq's own ``Recovery`` looks every
``LOOK_INTERVAL_S`` until all 16 are back in their queue (``--no-today`` skips it: about 15 s).

Last, the lines of ttsq that stand on kombu's list transport, by what a Streams transport would do to them
(retire, rewrite; ``--code`` prints each), beside the size of kombu's own Redis transport it would replace.

    python benchmarks/streams_transport.py                       # 3 rounds of 2000 messages, under a minute
    python benchmarks/streams_transport.py --rounds 5 --messages 10000 --consumers 4
    python benchmarks/streams_transport.py --rounds 1 --messages 50 --min-idle 2 --beat 0.2 --look 0.1 --no-today
                                                                 # a smoke run (the test's)
"""

from __future__ import annotations

import argparse
import ast
import json
import multiprocessing
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import redis
from redis.connection import AbstractConnection

# Run as a script, this folder is on the path, not the repository.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ttsq.app import make_app, queue_for
from ttsq.config import Settings
from ttsq.constants import ACKS_REMEMBERED_S, HOLDER_BEAT_S, HOLDER_TTL_S, SEQ_HEADER, TASK_NAME
from ttsq.delivery.acks import Acks
from ttsq.delivery.transport import BULK_CAP_OPTION, BULK_SHARE_OPTION, GATE_OPTION, GatedTransport
from ttsq.observer import Observer
from ttsq.ops.redis_server import RedisServer
from ttsq.records.holders import Holders, held_key, incarnation
from ttsq.worker.recovery import CONFIRM_S, LOOK_INTERVAL_S, Recovery

ROOT = Path(__file__).resolve().parent.parent

#: The worker's prefetch: Celery's concurrency (twice ``max_batch``, 8 by default) times a multiplier of 1.
PREFETCH = 2 * Settings().max_batch
GROUP = "ttsq"
#: A request of the size ttsq's producers send: a paragraph of text and the usual fields.
TEXT = (
    "The river bends past the old mill where children count the boats until the evening bell, and the "
    "ferryman, who has crossed it more times than anyone can remember, lifts his lantern to the bank. "
) * 2

#: Round trips this process's redis-py connections wrote (requests sent; a pipeline is one).
_sent = 0


def _count_round_trips() -> None:
    """Count every request redis-py writes in this process (kombu's BRPOP included: it goes through here),
    from zero: a forked consumer inherits its parent's counter and its counting, and counts once."""
    global _sent
    _sent = 0
    original = AbstractConnection.send_packed_command
    if getattr(original, "counting", False):
        return

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> None:
        global _sent
        _sent += 1
        original(self, command, check_health)  # type: ignore[no-untyped-call]

    counted.counting = True  # type: ignore[attr-defined]
    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]


def connect(url: str, **options: Any) -> Any:
    """A redis-py client; its stream replies are unions of every reply type, so it is read as Any here."""
    return redis.Redis.from_url(url, **options)


def commandstats(client: Any) -> dict[str, int]:
    """Calls per command since the server started (INFO itself left out), and under ``"usec"`` the
    microseconds Redis spent executing them all."""
    stats: dict[str, Any] = client.info("commandstats")
    mine = {name.removeprefix("cmdstat_"): v for name, v in stats.items() if name != "cmdstat_info"}
    return {**{name: int(v["calls"]) for name, v in mine.items()}, "usec": sum(int(v["usec"]) for v in mine.values())}


def difference(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in sorted(after) if after[k] - before.get(k, 0)}


def settings_for(url: str, queue: str) -> Settings:
    return Settings(broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2", queue=queue)


def lanes(queue: str) -> list[str]:
    return [queue_for(queue, "voice_design", "interactive"), queue_for(queue, "voice_design", "bulk")]


def kwargs_for(index: int) -> dict[str, Any]:
    return {"text": f"{index}: {TEXT}", "language": "English", "speaker": "Vivian", "format": "wav", "lane": None}


def as_ttsq_worker(app: Any, settings: Settings, name: str) -> Any:
    """Give ``app`` the transport a ttsq worker consumes through (``ttsq.worker.tasks``): kombu's Redis
    channel with the envelope check, the lane cycle and ``HeldQoS``, whose held set is written in the same
    pipelines as kombu's ``unacked`` bookkeeping. Returns what ``HeldQoS`` reads of the worker's gate."""
    holding = SimpleNamespace(held_key=held_key(name), acks=Acks(remember_s=ACKS_REMEMBERED_S))
    app.conf.broker_transport = GatedTransport
    app.conf.broker_transport_options = {
        **app.conf.broker_transport_options,
        GATE_OPTION: holding,
        BULK_SHARE_OPTION: settings.bulk_share_percent,
        BULK_CAP_OPTION: settings.concurrency - max(1, settings.max_batch // 2),
    }
    return holding


# -- the consumers (one process each) ---------------------------------------------------------------------


def _kombu_consumer(url: str, queue: str, done: Synchronized[int], target: int, ready: Any, out: Any) -> None:
    from kombu.entity import Queue
    from kombu.messaging import Consumer

    _count_round_trips()
    settings = settings_for(url, queue)
    app = make_app(settings, worker=True)
    as_ttsq_worker(app, settings, incarnation("bench", os.getpid()))
    with app.connection_for_read() as connection:
        channel = connection.channel()

        def on_message(body: Any, message: Any) -> None:
            message.ack()
            with done.get_lock():
                done.value += 1

        queues = [Queue(name) for name in lanes(queue)]  # type: ignore[no-untyped-call]
        consumer = Consumer(channel, queues, callbacks=[on_message], accept=["json"])  # type: ignore[no-untyped-call]
        consumer.qos(prefetch_count=PREFETCH)  # type: ignore[no-untyped-call]
        consumer.consume()  # type: ignore[no-untyped-call]
        ready.put(os.getpid())
        while done.value < target:
            with suppress(TimeoutError):
                connection.drain_events(timeout=0.2)
        out.put(_sent)


def _streams_consumer(url: str, queue: str, done: Synchronized[int], target: int, ready: Any, out: Any) -> None:
    _count_round_trips()
    client = connect(f"{url}/0")
    name = f"consumer-{os.getpid()}"
    streams: dict[Any, Any] = dict.fromkeys(lanes(queue), ">")
    ready.put(os.getpid())
    while done.value < target:
        for stream, entries in client.xreadgroup(GROUP, name, streams, count=PREFETCH, block=200) or []:
            for entry_id, _fields in entries:
                with client.pipeline(transaction=False) as pipe:  # acks late, one job at a time, as Celery's
                    pipe.xack(stream, GROUP, entry_id).xdel(stream, entry_id).execute()
                with done.get_lock():
                    done.value += 1
    client.close()
    out.put(_sent)


# -- the producers ----------------------------------------------------------------------------------------


class KombuPath:
    name = "kombu"
    consumer = staticmethod(_kombu_consumer)

    def __init__(self, url: str, queue: str) -> None:
        self.app = make_app(settings_for(url, queue), worker=True)
        self.queue = queue

    def prepare(self) -> None:
        pass

    def publish(self, count: int) -> None:
        with self.app.producer_or_acquire() as producer:
            for index in range(count):
                self.app.send_task(
                    TASK_NAME,
                    kwargs=kwargs_for(index),
                    queue=self.queue,
                    producer=producer,
                    headers={SEQ_HEADER: index},  # ttsq's own header (sending.py), and no text in the repr
                    kwargsrepr=f"job {index} (English, 420 chars)",
                )

    def close(self) -> None:
        self.app.close()


class StreamsPath:
    name = "streams"
    consumer = staticmethod(_streams_consumer)

    def __init__(self, url: str, queue: str, envelope: bytes) -> None:
        self.client = connect(f"{url}/0")
        self.queue = queue
        self.envelope = envelope

    def prepare(self) -> None:
        for stream in lanes(self.queue):
            self.client.delete(stream)
            self.client.xgroup_create(stream, GROUP, id="0", mkstream=True)

    def publish(self, count: int) -> None:
        stream = lanes(self.queue)[0]
        for _ in range(count):
            self.client.xadd(stream, {"m": self.envelope})

    def close(self) -> None:
        self.client.close()


@dataclass
class Round:
    path: str
    messages: int
    publish_s: float  # the producer alone, into an empty queue
    consume_s: float  # the consumers alone, draining it
    bytes_per_queued: float  # used_memory while the messages waited, per message
    commands: dict[str, int]
    round_trips: int
    redis_usec: int  # Redis's own time executing the round's commands

    @property
    def per_s(self) -> float:
        """Sent, then consumed."""
        return self.messages / (self.publish_s + self.consume_s)


def one_round(path: KombuPath | StreamsPath, client: Any, url: str, messages: int, consumers: int) -> Round:
    """Publish ``messages`` with no consumer (timed, and the memory they take measured), then drain them with
    ``consumers`` processes (timed from the first one's start)."""
    context = multiprocessing.get_context("fork")
    done = context.Value("i", 0)
    ready, out = context.Queue(), context.Queue()
    path.prepare()
    client.execute_command("MEMORY", "PURGE")
    before, sent_before = commandstats(client), _sent
    memory = int(client.info("memory")["used_memory"])
    start = time.perf_counter()
    path.publish(messages)
    publish_s = time.perf_counter() - start
    queued = (int(client.info("memory")["used_memory"]) - memory) / messages
    processes = [
        context.Process(target=path.consumer, args=(url, path.queue, done, messages, ready, out), daemon=True)
        for _ in range(consumers)
    ]
    for process in processes:
        process.start()
    ready.get(timeout=60)
    start = time.perf_counter()
    for _ in processes[1:]:
        ready.get(timeout=60)
    while done.value < messages:
        time.sleep(0.002)
    consume_s = time.perf_counter() - start
    after = commandstats(client)
    sent = _sent - sent_before - 4  # the INFO calls
    trips = sent + sum(out.get(timeout=30) for _ in processes)
    for process in processes:
        process.join(10)
    commands = difference(after, before)
    usec = commands.pop("usec", 0)
    return Round(path.name, messages, publish_s, consume_s, queued, commands, trips, usec)


# -- recovery ---------------------------------------------------------------------------------------------


def _reader(url: str, stream: str, name: str, count: int, ready: Any) -> None:
    """A consumer that reads ``count`` messages and then works on them until it is killed."""
    client = connect(f"{url}/0")
    got = client.xreadgroup(GROUP, name, {stream: ">"}, count=count)
    ready.put([entry_id.decode() for _, entries in got for entry_id, _ in entries])
    while True:
        time.sleep(1)


@dataclass
class StreamsRecovery:
    min_idle_s: float
    beat_s: float
    look_s: float
    held: int
    dead_back_after_s: float | None
    taken_from_live_with_heartbeat: int
    taken_from_live_without_heartbeat: int
    todays_bound_s: list[float] = field(default_factory=list)
    #: ttsq's own recovery, measured: a SIGKILL of a process holding as many, to all of them queued again.
    today_measured_s: float | None = None


def recovery(url: str, *, min_idle_s: float, beat_s: float, look_s: float, held: int = PREFETCH) -> StreamsRecovery:
    client = connect(f"{url}/0", decode_responses=True)
    stream = "ttsq.recovery"
    client.delete(stream)
    client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for index in range(3 * held):
        client.xadd(stream, {"m": str(index)})
    context = multiprocessing.get_context("fork")
    ready = context.Queue()
    owned: dict[str, list[str]] = {}
    processes: dict[str, Any] = {}
    for name in ("dead", "live-beating", "live-silent"):
        processes[name] = context.Process(target=_reader, args=(url, stream, name, held, ready), daemon=True)
        processes[name].start()
        owned[name] = ready.get(timeout=30)
    owner = {entry: name for name, entries in owned.items() for entry in entries}
    os.kill(processes["dead"].pid, signal.SIGKILL)
    killed = time.monotonic()
    taken: dict[str, int] = dict.fromkeys(owned, 0)
    dead_back: float | None = None
    last_beat = killed
    # Long enough that a live consumer's messages would have passed min-idle twice without a heartbeat.
    while time.monotonic() - killed < 2 * min_idle_s + look_s:
        now = time.monotonic()
        if now - last_beat >= beat_s:  # the busy, beating consumer renews what it still holds
            mine = [entry for entry in owned["live-beating"] if owner.get(entry) == "live-beating"]
            if mine:
                client.xclaim(stream, GROUP, "live-beating", 0, mine, justid=True)
            last_beat = now
        _, claimed, _ = client.xautoclaim(stream, GROUP, "claimer", int(min_idle_s * 1000), "0-0", count=100)
        for entry_id, _ in claimed:
            taken[owner[entry_id]] += 1
            owner[entry_id] = "claimer"
        if claimed:  # the claimer runs them again and acknowledges them
            client.xack(stream, GROUP, *(entry_id for entry_id, _ in claimed))
        if dead_back is None and taken["dead"] == held:
            dead_back = time.monotonic() - killed
        time.sleep(min(look_s, beat_s / 2))
    for process in processes.values():
        process.kill()
        process.join(5)
    client.delete(stream)
    client.close()
    # Today: a holder silent for HOLDER_TTL_S (its last beat up to HOLDER_BEAT_S before the kill), seen so in
    # two looks CONFIRM_S apart, each look up to LOOK_INTERVAL_S late.
    bound = [HOLDER_TTL_S - HOLDER_BEAT_S + CONFIRM_S, HOLDER_TTL_S + CONFIRM_S + 2 * LOOK_INTERVAL_S]
    return StreamsRecovery(
        min_idle_s,
        beat_s,
        look_s,
        held,
        None if dead_back is None else round(dead_back, 2),
        taken["live-beating"],
        taken["live-silent"],
        bound,
    )


def _holding_consumer(url: str, queue: str, name: str, count: int, ready: Any) -> None:
    """A worker process as ttsq's has it: kombu's channel with ``HeldQoS`` (its held set) and a holder
    heartbeat; it takes ``count`` messages and holds them until it is killed."""
    from kombu.entity import Queue
    from kombu.messaging import Consumer

    settings = settings_for(url, queue)
    app = make_app(settings, worker=True)
    holding = as_ttsq_worker(app, settings, name)
    holders = Holders(connect(f"{url}/0", decode_responses=True))

    def beat() -> None:
        while True:
            holders.beat(name, ttl_s=HOLDER_TTL_S, info={"node": "bench"})
            time.sleep(HOLDER_BEAT_S)

    threading.Thread(target=beat, daemon=True).start()
    with app.connection_for_read() as connection:
        queues = [Queue(lane) for lane in lanes(queue)]  # type: ignore[no-untyped-call]
        hold: list[Any] = [lambda body, message: None]  # held, never acknowledged: it dies with them
        consumer = Consumer(connection.channel(), queues, callbacks=hold, accept=["json"])  # type: ignore[no-untyped-call]
        consumer.qos(prefetch_count=count)  # type: ignore[no-untyped-call]
        consumer.consume()  # type: ignore[no-untyped-call]
        while len(holding.acks.live()) < count:
            with suppress(TimeoutError):
                connection.drain_events(timeout=0.2)
        ready.put(len(holding.acks.live()))
        while True:
            time.sleep(1)


def todays_recovery(url: str, held: int = PREFETCH) -> float | None:
    """Seconds from a SIGKILL of a process holding ``held`` messages to all of them back in their queue,
    given back by ttsq's own ``Recovery`` looking every ``LOOK_INTERVAL_S`` (as each worker does)."""
    queue = "bench.today"
    kombu = KombuPath(url, queue)
    kombu.publish(held)
    context = multiprocessing.get_context("fork")
    ready = context.Queue()
    name = incarnation("bench", 1)
    process = context.Process(target=_holding_consumer, args=(url, queue, name, held, ready), daemon=True)
    process.start()
    ready.get(timeout=30)
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)
    killed = time.monotonic()
    process.join(5)
    client = connect(f"{url}/0", decode_responses=True)
    recovery = Recovery(kombu.app, Holders(client), Observer(), name=incarnation("bench", 0), node="bench")
    back: float | None = None
    while back is None and time.monotonic() - killed < 3 * (HOLDER_TTL_S + CONFIRM_S):
        recovery.recover()
        if client.llen(lanes(queue)[0]) == held:
            back = round(time.monotonic() - killed, 2)
        else:
            time.sleep(LOOK_INTERVAL_S)
    client.delete(*lanes(queue))
    client.close()
    kombu.close()
    return back


# -- code size --------------------------------------------------------------------------------------------

#: ttsq's code that stands on kombu's list transport, by what a Streams transport would do to it: "retired"
#: (the consumer group's pending list does it: who holds what, delivery recorded with the read) or
#: "rewritten" (the same job over streams: queue depths, the gate's read, giving a dead consumer's messages
#: back). A file's name alone means all of it. What stays either way (the heartbeat, the accepted-job
#: ledger and its sweeper for writes a Redis restart or failover loses, the gate's checks, lanes,
#: Sentinel) is not listed; docs/guarantees.md, "Why not Redis Streams", says why.
KOMBU_CODE: dict[str, list[str]] = {
    "retired": [
        "ttsq/delivery/transport.py:HeldQoS",
        "ttsq/delivery/transport.py:GatedChannel._brpop_read",
        "ttsq/delivery/transport.py:GatedChannel._brpop_start",
        "ttsq/delivery/transport.py:GatedChannel._bulk_held",
        "ttsq/records/holders.py:held_key",
        "ttsq/records/holders.py:Holders.held",
        "ttsq/records/holders.py:Holders.keep_alive",
    ],
    "rewritten": [
        "ttsq/delivery/broker.py",
        "ttsq/delivery/transport.py:GatedChannel.__init__",
        "ttsq/delivery/transport.py:GatedChannel._create_client",
        "ttsq/delivery/transport.py:GatedTransport",
        "ttsq/delivery/transport.py:GatedSentinelChannel",
        "ttsq/delivery/transport.py:GatedSentinelTransport",
        "ttsq/worker/recovery.py:Recovery._give_back",
    ],
}


def _code_lines(lines: list[str]) -> int:
    """Lines that are neither blank nor a comment."""
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def code_lines(where: str) -> int:
    """Code lines of a file, or of one of its definitions (``path:Class.method``), docstrings included."""
    path, _, name = where.partition(":")
    source = (ROOT / path).read_text()
    if not name:
        return _code_lines(source.splitlines())
    scope: list[ast.stmt] = ast.parse(source).body
    node: ast.stmt | None = None
    for part in name.split("."):
        node = next(
            n for n in scope if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == part
        )
        scope = node.body
    assert node is not None and node.end_lineno is not None
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    return _code_lines(source.splitlines()[first - 1 : node.end_lineno])


def kombu_overrides() -> tuple[int, int]:
    """The overrides tests/test_fence.py records, and how many of them are kombu's Redis transport's."""
    recorded: dict[str, str] = json.loads((ROOT / "tests/data/overrides.json").read_text())
    return len(recorded), sum(1 for name in recorded if name.startswith("kombu.transport."))


def kombu_redis_transport_lines() -> int:
    """Code lines of the installed kombu's Redis transport: the size of what a Streams one replaces."""
    import kombu.transport.redis

    return _code_lines(Path(kombu.transport.redis.__file__).read_text().splitlines())


# -- the run ----------------------------------------------------------------------------------------------


@contextmanager
def server() -> Iterator[RedisServer]:
    redis_server = RedisServer().start()
    try:
        yield redis_server
    finally:
        redis_server.stop()


def captured_envelope(client: Any, kombu: KombuPath) -> bytes:
    """The raw list item kombu stores for one ttsq envelope: the bytes the Streams path sends too."""
    kombu.publish(1)
    raw = client.rpop(lanes(kombu.queue)[0])
    assert isinstance(raw, bytes)
    return raw


def median_of(rounds: list[Round], key: Callable[[Round], float]) -> float:
    return statistics.median(key(r) for r in rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per path, interleaved (median reported)")
    parser.add_argument("--messages", type=int, default=2000, help="messages per round")
    parser.add_argument("--consumers", type=int, default=2, help="consumer processes per path")
    parser.add_argument("--min-idle", type=float, default=HOLDER_TTL_S, help="XAUTOCLAIM's min-idle (s)")
    parser.add_argument("--beat", type=float, default=HOLDER_BEAT_S, help="the busy consumer's XCLAIM beat (s)")
    parser.add_argument("--look", type=float, default=LOOK_INTERVAL_S, help="how often the claimer looks (s)")
    parser.add_argument("--no-recovery", action="store_true", help="skip the recovery trial")
    parser.add_argument(
        "--no-today", action="store_true", help="skip measuring ttsq's own recovery (12-16 s: its constants are fixed)"
    )
    parser.add_argument("--code", action="store_true", help="print the lines of code per file")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    _count_round_trips()
    with server() as redis_server:
        url = redis_server.url
        client = connect(f"{url}/0")
        kombu = KombuPath(url, "bench.kombu")
        envelope = captured_envelope(client, kombu)
        streams = StreamsPath(url, "bench.streams", envelope)
        rounds: list[Round] = []
        for _ in range(args.rounds):
            for path in (kombu, streams):
                rounds.append(one_round(path, client, url, args.messages, args.consumers))
        recovered = None
        if not args.no_recovery:
            recovered = recovery(url, min_idle_s=args.min_idle, beat_s=args.beat, look_s=args.look)
            if not args.no_today:
                recovered.today_measured_s = todays_recovery(url, recovered.held)
        kombu.close()
        streams.close()
        client.close()

    report: dict[str, Any] = {
        "envelope_bytes": len(envelope),
        "consumers": args.consumers,
        "prefetch": PREFETCH,
        "messages": args.messages,
        "rounds": args.rounds,
        "paths": {},
    }
    print(f"{args.rounds} rounds of {args.messages} messages ({len(envelope)}-byte envelope), ", end="")
    print(f"{args.consumers} consumers, prefetch {PREFETCH}, {os.cpu_count()} CPUs")
    print(
        f"{'path':<8} {'msg/s':>7} {'sent/s':>7} {'consumed/s':>10} {'cmds/msg':>8} {'trips/msg':>9} "
        f"{'redis us/msg':>12} {'B/queued':>8}"
    )
    for name in ("kombu", "streams"):
        mine = [r for r in rounds if r.path == name]
        commands: dict[str, float] = {}
        for r in mine:
            for command, calls in r.commands.items():
                commands[command] = commands.get(command, 0) + calls / (r.messages * len(mine))
        figures = {
            "messages_per_s": median_of(mine, lambda r: r.per_s),
            "sent_per_s": median_of(mine, lambda r: r.messages / r.publish_s),
            "consumed_per_s": median_of(mine, lambda r: r.messages / r.consume_s),
            "commands_per_message": sum(commands.values()),
            "round_trips_per_message": median_of(mine, lambda r: r.round_trips / r.messages),
            "redis_us_per_message": median_of(mine, lambda r: r.redis_usec / r.messages),
            "bytes_per_queued_message": median_of(mine, lambda r: r.bytes_per_queued),
        }
        print(
            f"{name:<8} {figures['messages_per_s']:>7.0f} {figures['sent_per_s']:>7.0f} "
            f"{figures['consumed_per_s']:>10.0f} {figures['commands_per_message']:>8.2f} "
            f"{figures['round_trips_per_message']:>9.2f} {figures['redis_us_per_message']:>12.1f} "
            f"{figures['bytes_per_queued_message']:>8.0f}"
        )
        print("         msg/s of each round: " + ", ".join(f"{r.per_s:.0f}" for r in mine))
        breakdown = {k: round(v, 3) for k, v in sorted(commands.items(), key=lambda kv: -kv[1]) if v >= 0.001}
        print("         commands per message: " + ", ".join(f"{k} {v:g}" for k, v in breakdown.items()))
        report["paths"][name] = {
            **{k: round(v, 3) for k, v in figures.items()},
            "rounds_per_s": [round(r.per_s, 1) for r in mine],
            "commands": breakdown,
        }
    if recovered is not None:
        back = recovered
        print(
            f"recovery over Streams (min-idle {back.min_idle_s:g} s, beat {back.beat_s:g} s, look {back.look_s:g} s, "
            f"{back.held} held each): the dead consumer's back after {back.dead_back_after_s} s; "
            f"taken from a busy live consumer: {back.taken_from_live_with_heartbeat} with its XCLAIM heartbeat, "
            f"{back.taken_from_live_without_heartbeat} without"
        )
        low, high = back.todays_bound_s
        print(
            f"today (ttsq.worker.recovery: HOLDER_TTL_S {HOLDER_TTL_S:g}, CONFIRM_S {CONFIRM_S:g}, look "
            f"{LOOK_INTERVAL_S:g} s): {low:g} to {high:g} s after a SIGKILL; within {LOOK_INTERVAL_S:g} s once the "
            "launcher marks the process dead"
        )
        if back.today_measured_s is not None:
            print(
                f"today, measured (ttsq's Recovery and HeldQoS, a SIGKILLed process holding {back.held}): all back in "
                f"the queue after {back.today_measured_s} s"
            )
        report["recovery"] = asdict(back)
    sizes = {kind: {where: code_lines(where) for where in places} for kind, places in KOMBU_CODE.items()}
    overrides, kombu_ones = kombu_overrides()
    transport = kombu_redis_transport_lines()
    print(
        f"code on kombu's list transport: {sum(sizes['retired'].values())} lines a Streams transport would retire, "
        f"{sum(sizes['rewritten'].values())} it would rewrite; {kombu_ones} of the {overrides} fenced overrides are "
        f"kombu's transport's; kombu's own Redis transport, which it replaces: {transport} lines"
    )
    if args.code:
        for kind, places in sizes.items():
            for where, n in places.items():
                print(f"  {n:>4}  {kind:<9}  {where}")
    report["code_lines"] = {**sizes, "fenced_overrides": overrides, "kombu_transport_overrides": kombu_ones}
    report["code_lines"]["kombu_redis_transport"] = transport
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
