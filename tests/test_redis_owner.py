"""One owner of Redis per process: what ttsq's own code holds on a real Redis, and its Lua scripts.

A worker running real jobs and a gateway serving real requests are read through ``CLIENT LIST``: every
connection ttsq opens names itself ``ttsq:<role>:<pid>:<databases>[:async]:<pool>``, one name per pool,
so one name per database is one pool per database; Celery's and kombu's connections, unnamed, sit
beside them. Every Lua script runs again after ``SCRIPT FLUSH`` (on a private Redis: a flush is not this
test's to do to the suite's server). And nothing outside ``ttsq.records`` opens a connection.
"""

from __future__ import annotations

import ast
import asyncio
import hashlib
import inspect
import json
import os
import signal
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import redis
from starlette.requests import Request
from support import GatewayProcess, WorkerProcess, api_key

from ttsq.client import Client
from ttsq.config import Settings
from ttsq.constants import ACCEPTED_PREFIX, TENANT_IN_FLIGHT_PREFIX, TENANTS_IN_FLIGHT_PREFIX
from ttsq.delivery.broker import queued_within
from ttsq.gateway.apikeys import ApiKeys
from ttsq.gateway.state import Gateway
from ttsq.ops.redis_server import RedisServer
from ttsq.records import scripts
from ttsq.records.accepted import Receipt
from ttsq.records.connection import within
from ttsq.records.holders import held_key
from ttsq.records.owner import RedisOwner

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]
ROOT = Path(__file__).resolve().parent.parent


def sockets_of(pid: int) -> set[int]:
    """The local TCP ports of the sockets process ``pid`` holds (Linux: /proc), which ``CLIENT LIST``
    shows as each client's ``addr``."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def connections_of(server: RedisServer, pid: int) -> list[dict[str, str]]:
    """The connections of process ``pid`` that the Redis at ``server`` lists (this test's own look at
    it, not through ttsq)."""
    admin = redis.Redis.from_url(server.url, decode_responses=True)
    try:
        listed = admin.client_list()
    finally:
        admin.close()
    ports = sockets_of(pid)
    return [c for c in listed if int(c["addr"].rsplit(":", 1)[1]) in ports]


def pools_by_database(connections: list[dict[str, str]], prefix: str) -> dict[tuple[int, str], set[str]]:
    """ttsq's pools among ``connections``: (database, sync or async) -> the pool names seen there."""
    pools: dict[tuple[int, str], set[str]] = defaultdict(set)
    for connection in connections:
        name = connection["name"]
        if name.startswith(prefix):
            pools[(int(connection["db"]), "async" if ":async:" in name else "sync")].add(name)
    return dict(pools)


def test_a_worker_holds_one_pool_per_database_beside_celerys(
    settings: Settings, redis_server: RedisServer, start_worker: StartWorker
) -> None:
    worker = start_worker(settings)
    assert worker.process is not None
    pid = worker.process.pid
    client = Client(settings)
    # Jobs at once (several of the worker's threads use Redis together), a document (its progress and
    # index), a cache hit and a cancel: every record the worker keeps.
    jobs = [client.submit(f"Sentence number {i} for the pool count.") for i in range(8)]
    document = client.submit_document("A first paragraph, long enough to be a chunk.\n\nAnd a second one after it.")
    for job in [*jobs, document]:
        assert job.wait(timeout=120)["duration_s"] > 0
    assert client.submit("Sentence number 1 for the pool count.").cached
    client.close()

    connections = connections_of(redis_server, pid)
    ours = pools_by_database(connections, f"ttsq:worker:{pid}:")
    db = {url: int(url.rsplit("/", 1)[1]) for url in (settings.broker_url, settings.result_backend, settings.cache_url)}
    # One pool for the broker's database, one for the cache's; none on the result backend (Celery's).
    assert {key: len(names) for key, names in ours.items()} == {
        (db[settings.broker_url], "sync"): 1,
        (db[settings.cache_url], "sync"): 1,
    }, ours
    # Every other connection of the process is Celery's or kombu's own: unnamed, on the broker (the
    # consumer, the producers) and the result backend.
    theirs = [c for c in connections if not c["name"].startswith("ttsq:")]
    assert theirs and all(c["name"] == "" for c in theirs), theirs
    assert {int(c["db"]) for c in theirs} >= {db[settings.broker_url], db[settings.result_backend]}
    # And no ttsq-named connection of this worker is anywhere else.
    assert all(c["name"].startswith(f"ttsq:worker:{pid}:") for c in connections if c["name"].startswith("ttsq:"))


def test_a_gateway_holds_one_async_pool_per_database(
    settings: Settings, redis_server: RedisServer, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    start_worker(settings)
    gateway = start_gateway(settings)
    token = api_key(settings)

    def speak(i: int) -> bytes:
        response = httpx.post(
            f"{gateway.url}/v1/audio/speech",
            headers={"Authorization": f"Bearer {token}"},
            json={
                "model": "tts-1",
                "voice": "alloy",
                "input": f"Request {i} to the gateway.",
                "response_format": "wav",
            },
            timeout=120,
        )
        assert response.status_code == 200, response.text
        # /generate waits on the result backend (speech reads the job's audio stream, on the cache's database)
        generated = httpx.post(
            f"{gateway.url}/generate",
            headers={"Authorization": f"Bearer {token}"},
            json={"text": f"Generated request {i}."},
            timeout=120,
        )
        assert generated.status_code == 200, generated.text
        return response.content

    # Requests at once: several connections of each pool are in use together.
    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(speak, range(8)))
    assert httpx.get(f"{gateway.url}/readyz", timeout=30).status_code == 200

    pid = gateway.process.pid
    ours = pools_by_database(connections_of(redis_server, pid), f"ttsq:gateway:{pid}:")
    cache, results = int(settings.cache_url.rsplit("/", 1)[1]), int(settings.result_backend.rsplit("/", 1)[1])
    asynchronous = {key: len(names) for key, names in ours.items() if key[1] == "async"}
    # API keys, quotas and audio streams on the cache's database, the waiter's reads and subscription on the
    # results'.
    assert asynchronous == {(cache, "async"): 1, (results, "async"): 1}, ours
    assert all(len(names) == 1 for names in ours.values()), ours  # the producer's sync side too


@pytest.fixture
def private(settings: Settings) -> Iterator[tuple[Settings, RedisServer]]:
    """Settings on a Redis of this test's own, which it may flush."""
    server = RedisServer().start()
    url = server.url
    yield settings.replace(broker_url=f"{url}/0", result_backend=f"{url}/1", cache_url=f"{url}/2"), server
    server.stop()


def test_every_lua_script_runs_again_after_the_script_cache_is_flushed(
    private: tuple[Settings, RedisServer],
) -> None:
    settings, server = private
    owner = RedisOwner(settings, role="test")
    gateway = Gateway(settings)
    admin = redis.Redis.from_url(f"{server.url}/2", decode_responses=True)
    results_db = redis.Redis.from_url(settings.result_backend, decode_responses=True)
    runs = script_runs(owner, gateway, admin, results_db)

    async def flushed_between_runs() -> None:
        try:
            for flush in (False, True):  # the first time loads each; after the flush: NOSCRIPT, loaded again, run
                await run_every_script(runs, admin, flush=flush)
        finally:
            await gateway.close()

    asyncio.run(flushed_between_runs())
    owner.close()
    admin.close()
    results_db.close()


Run = Callable[[], Awaitable[None] | None]


def script_runs(owner: RedisOwner, gateway: Gateway, admin: redis.Redis, results_db: redis.Redis) -> dict[str, Run]:
    """One use of each of ttsq's Lua scripts through the records and the gateway that run it, each
    checking its effect: the script's name -> the call. ``admin`` is a plain client of the cache
    database, ``results_db`` of the result backend's (this test's own, not ttsq's)."""
    accepted, lease = owner.accepted, owner.lease("ttsq:test:lease", "holder", ttl_s=30)
    token, key = ApiKeys(owner.cache).add(f"flushed-{time.monotonic_ns()}")
    bearer = Request({"type": "http", "headers": [(b"authorization", f"Bearer {token}".encode())]})
    task_id = f"job-{time.monotonic_ns()}"

    def accept() -> None:
        seq = accepted.accept(task_id, task="ttsq.synthesize", queue="q", kwargs={"text": "x"}, headers={})
        assert seq >= 1 and accepted.get(task_id) is not None

    def received() -> None:
        assert accepted.received(task_id, task="ttsq.synthesize", queue="q", seq=1, plain=False) == Receipt.RUN
        assert accepted.get(task_id).seen_at is not None  # type: ignore[union-attr]

    def touch() -> None:
        accepted.touch(task_id)
        assert accepted.received_before(accepted.now() + 1) == [task_id]

    def finish() -> None:
        accepted.finish(task_id)
        assert not admin.exists(ACCEPTED_PREFIX + task_id)
        accept()  # for the next round

    def release() -> None:
        assert owner.cache_index.claim("k", "owner", 60) is None
        owner.cache_index.release("k", "owner")
        assert owner.cache_index.claim("k", "next", 60) is None
        owner.cache_index.release("k", "next")

    def renew() -> None:
        lease.take()
        assert lease.renew()
        lease.give_up()
        assert lease.take()

    # The gateway's scripts, through the gateway's own methods (async: all on one event loop).
    async def authorize() -> None:
        assert await gateway.authorize(bearer) == key.id

    async def charge() -> None:
        before = ApiKeys(owner.cache).used_today(key)
        await gateway.charge(key.id, 1.0)
        assert ApiKeys(owner.cache).used_today(key) == before + 1.0

    async def charge_once() -> None:
        before = ApiKeys(owner.cache).used_today(key)
        job = f"job-{time.monotonic_ns()}"
        await gateway.charge_once(key.id, job, 1.0)
        await gateway.charge_once(key.id, job, 1.0)
        assert ApiKeys(owner.cache).used_today(key) == before + 1.0

    def progress_unless_done() -> None:
        # On the result backend's client, the way the document side runs it there.
        progress = scripts.register(owner.cache, "progress_unless_done")
        meta = json.dumps({"status": "PROGRESS", "result": {"done": 1}})
        assert progress(keys=["celery-task-meta-doc"], args=[meta, 60], client=results_db) == 1
        assert json.loads(results_db.get("celery-task-meta-doc") or "{}")["status"] == "PROGRESS"

    def claim_held() -> None:
        dead, looker = f"dead-{time.monotonic_ns()}", f"looker-{time.monotonic_ns()}"
        owner.broker.sadd(held_key(dead), "tag")
        assert owner.holders.claim(dead, "tag", into=looker)
        assert not owner.holders.claim(dead, "tag", into=looker)  # moved already: another look's
        assert owner.holders.held(looker) == ["tag"]
        owner.broker.delete(held_key(looker))

    def retire_holder() -> None:
        name = f"retired-{time.monotonic_ns()}"
        owner.holders.beat(name, ttl_s=30)
        assert not owner.holders.retire(name)  # it beats
        owner.holders.mark_dead(name)
        assert owner.holders.retire(name) and name not in owner.holders.states()

    def claim_identity() -> None:
        espeak = {"engine": "espeak", "model": "m", "revision": "1", "sample_rate": 22050, "modes": ["voice_design"]}
        assert owner.identities.claim("q", "espeak@test", espeak) is None
        rival = owner.identities.claim("q", "qwen@test", {**espeak, "engine": "qwen"})
        assert rival is not None and rival.node == "espeak@test"

    def defer() -> None:
        waiting, ahead = f"deferred-{time.monotonic_ns()}", f"ahead-{time.monotonic_ns()}"
        for job_id in (ahead, waiting):
            accepted.accept(job_id, task="ttsq.synthesize", queue="dq", kwargs={"text": "x"}, headers={})
        # Window 1, and two jobs no worker has received: the list counts as full, the job waits its tenant's turn.
        assert accepted.defer(waiting, queue="dq", tenant="t", window=1)
        assert accepted.deferred("dq") == {"t": 1}

    def release_deferred() -> None:
        room_for_one = len(accepted.unseen("dq")) + 1  # beside the jobs ahead (of this round and the last)
        (job,) = accepted.release(["dq"], window=room_for_one, most=10)
        assert job.queue == "dq" and job.kwargs == {"text": "x"} and accepted.deferred("dq") == {}
        accepted.finish(job.task_id)

    def age_in_flight() -> None:
        # A count left for a job whose record is gone: aged out.
        admin.zadd(f"{TENANT_IN_FLIGHT_PREFIX}q:t", {"gone-job": 1})
        admin.sadd(f"{TENANTS_IN_FLIGHT_PREFIX}q", "t")
        assert accepted.age_in_flight("q") == 1
        assert not admin.exists(f"{TENANT_IN_FLIGHT_PREFIX}q:t")

    def cancel() -> None:
        victim = f"cancelled-{time.monotonic_ns()}"
        assert accepted.cancel(victim, ttl_s=60) is None and accepted.cancelled(victim)

    def settle() -> None:
        done = f"settled-{time.monotonic_ns()}"
        assert accepted.settle(done, "SUCCESS", ttl_s=60)
        assert accepted.cancel(done, ttl_s=60) == "SUCCESS"

    def attempt() -> None:
        charged = f"charged-{time.monotonic_ns()}"
        attempts = owner.attempts
        assert attempts.charge(charged) == 1
        attempts.refund(charged)
        assert attempts.attempts(charged) == 0

    runs: dict[str, Run] = {
        "age_in_flight": age_in_flight,
        "attempt": attempt,
        "cancel": cancel,
        "settle": settle,
        "claim_identity": claim_identity,
        "defer": defer,
        "release": release_deferred,
        "accept": accept,
        "received": received,
        "touch": touch,
        "finish": finish,
        "release_if_holder": release,
        "renew_if_holder": renew,
        "authorize": authorize,
        "charge": charge,
        "charge_once": charge_once,
        "progress_unless_done": progress_unless_done,
        "claim_held": claim_held,
        "retire_holder": retire_holder,
    }
    assert set(runs) == set(scripts.names()), "a script without a case here"
    return runs


async def run_every_script(runs: dict[str, Run], admin: redis.Redis, *, flush: bool) -> None:
    """Run each script once; with ``flush``, empty the script cache of ``admin``'s Redis before each
    (and check it is empty), so the call meets ``NOSCRIPT``. Each must be in the cache afterwards."""
    for name, run in runs.items():
        if flush:
            admin.script_flush()
            assert admin.script_exists(sha(name)) == [False], name
        done = run()
        if inspect.isawaitable(done):
            await done
        assert admin.script_exists(sha(name)) == [True], name


def sha(name: str) -> str:
    return hashlib.sha1(scripts.source(name).encode()).hexdigest()


def test_a_read_with_a_deadline_gives_up_on_a_redis_that_stopped_answering(
    private: tuple[Settings, RedisServer],
) -> None:
    """The batcher's backlog read and the health probe wait on the shared pool no longer than their
    deadline, and the late answer never reaches the next command on that connection."""
    settings, server = private
    owner = RedisOwner(settings, role="test")
    owner.broker.rpush(settings.queue, "a", "b")
    assert queued_within(owner.broker, [settings.queue], 0.2) == 2
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)  # alive, connected, silent
    try:
        started = time.monotonic()
        with pytest.raises(redis.exceptions.TimeoutError):
            queued_within(owner.broker, [settings.queue], 0.2)
        assert time.monotonic() - started < 2
    finally:
        server.process.send_signal(signal.SIGCONT)
    owner.broker.rpush(settings.queue, "c")
    assert within(owner.broker, 5, ("PING",), ("LLEN", settings.queue)) == ["PONG", 3]
    assert owner.broker.llen(settings.queue) == 3
    owner.close()


def test_a_cancel_is_the_state_of_the_record_the_receipt_reads(settings: Settings) -> None:
    """The cancel lives in the job's one record: the worker's receipt reads it there."""
    owner = RedisOwner(settings, role="test")
    owner.accepted.accept("gone", task="ttsq.synthesize", queue="q", kwargs={}, headers={})
    owner.accepted.cancel("gone", ttl_s=60)
    assert owner.cache.hget(ACCEPTED_PREFIX + "gone", "state") == "cancelled"
    assert owner.accepted.received("gone", task="ttsq.synthesize", queue="q", seq=1, plain=True) == Receipt.CANCELLED
    owner.close()


#: The only modules that may open a Redis connection or hold a Lua script's text; and the failover
#: harness, which administers the Redis processes it started (ROLE, INFO, SENTINEL), never ttsq's data.
OWNERS = {"ttsq/records/connection.py", "ttsq/records/owner.py", "ttsq/records/scripts.py", "ttsq/ops/sentinel.py"}
#: Calls that open a connection (or a pool), or run a script outside ``ttsq.records.scripts``.
OPENERS = {"Redis", "StrictRedis", "ConnectionPool", "BlockingConnectionPool", "Sentinel"}
SCRIPTERS = {"register_script", "eval", "evalsha", "script_load"}


def test_nothing_outside_the_owner_opens_redis_or_holds_a_script() -> None:
    found = []
    for path in sorted(p for top in ("ttsq", "cli", "workers") for p in (ROOT / top).rglob("*.py")):
        relative = str(path.relative_to(ROOT))
        if relative in OWNERS:
            continue
        tree = ast.parse(path.read_text(), relative)
        imported_connect = any(
            isinstance(node, ast.ImportFrom)
            and (node.module or "").startswith(("redis", "ttsq.records.connection"))
            and any(alias.name == "connect" for alias in node.names)
            for node in ast.walk(tree)
        )
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            base = func.value if isinstance(func, ast.Attribute) else None
            on_redis = isinstance(base, ast.Name) and base.id in {"redis", "aioredis"}
            opens = name == "from_url" or (name in OPENERS and (on_redis or isinstance(func, ast.Name)))
            if name == "connect":
                opens = isinstance(func, ast.Name) and imported_connect
            # ``eval`` with arguments: a module's ``.eval()`` (a torch model's) is no script.
            scripted = name in SCRIPTERS and isinstance(func, ast.Attribute) and (name != "eval" or bool(node.args))
            if opens or scripted:
                found.append(f"{relative}:{node.lineno}: {name}(")
    assert not found, "Redis opened or a script run outside the owner (ttsq.records.owner): " + ", ".join(found)
    assert all(not path.name.endswith(".lua") for path in (ROOT / "ttsq").rglob("*") if "records" not in path.parts)


def test_a_client_serves_more_threads_at_once_than_redis_pys_default_pool(settings: Settings) -> None:
    """A ``Client`` is shared by threads, each holding a connection while its call is under way: 150 at
    once (redis-py's default pool stops at 100, and the 101st failed with "Too many connections")."""
    key = f"nothing-{time.monotonic_ns()}"  # no list of this name: each BLPOP waits out its second
    with Client(settings) as client, ThreadPoolExecutor(150) as pool:
        cache = client.redis.cache
        answers = list(pool.map(lambda _: cache.blpop([key], timeout=1), range(150)))
    assert answers == [None] * 150
