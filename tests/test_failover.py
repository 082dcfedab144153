"""Redis behind Sentinel: every ttsq client follows a failover without a restart, and no accepted job is lost.

Each test starts its own topology on loopback (``ttsq.ops.sentinel``: a primary, two replicas, three
Sentinels, data nodes and Sentinels each with a password of their own) and kills the primary outright
(SIGKILL), freezes it (SIGSTOP) or makes it sleep (``DEBUG SLEEP``) while ttsq uses it. The Sentinels'
timeouts are short (down after 1 s, failover timeout 3 s) so a failover takes seconds. Nothing here
touches a Redis it did not start.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
from redis import asyncio as aioredis
from support import GatewayProcess, WorkerProcess, api_key, run_cli, s3_keys, submit_cli, wait_until
from test_redis_owner import run_every_script, script_runs

from ttsq.app import celery_config, make_app, stored_result
from ttsq.client import Client, Job
from ttsq.config import Settings
from ttsq.constants import ACCEPTED_PREFIX
from ttsq.delivery.transport import gated_transport
from ttsq.errors import BrokerError, ConfigError, JobError, UnknownJob
from ttsq.gateway.state import Gateway
from ttsq.ops.sentinel import MASTER_NAME, SentinelTopology
from ttsq.records.connection import connect
from ttsq.records.owner import RedisOwner

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]
DATA_PASSWORD = "data-node-secret"
SENTINEL_PASSWORD = "sentinel-secret"
#: Where Celery's result backend keeps a task's result.
RESULT_PREFIX = "celery-task-meta-"


def test_every_redis_client_gets_the_socket_limits_and_a_timeout_that_a_blocking_call_outlasts_is_refused() -> None:
    """A silent node is given up after ``TTSQ_REDIS_SOCKET_TIMEOUT_S`` by kombu, Celery's result backend,
    the records and the gateway's async pools alike; a timeout shorter than the replicas' ``WAIT`` would
    cut a healthy wait, and stops the process at start."""
    settings = Settings().replace(redis_socket_timeout_s=4, redis_connect_timeout_s=3, redis_health_check_s=2)
    config = celery_config(settings, worker=True)
    assert config["broker_transport_options"]["socket_timeout"] == 4
    assert config["broker_transport_options"]["socket_connect_timeout"] == 3
    assert config["broker_transport_options"]["health_check_interval"] == 2
    assert (config["redis_socket_timeout"], config["redis_socket_connect_timeout"]) == (4, 3)
    assert config["redis_backend_health_check_interval"] == 2
    owner = RedisOwner(settings, role="test")
    for kwargs in (
        owner.cache.connection_pool.connection_kwargs,
        owner.async_client(settings.cache_url).connection_pool.connection_kwargs,
    ):
        assert (kwargs["socket_timeout"], kwargs["socket_connect_timeout"], kwargs["health_check_interval"]) == (
            4,
            3,
            2,
        )
    owner.close()
    with pytest.raises(ConfigError, match="TTSQ_REDIS_SOCKET_TIMEOUT_S"):
        Settings().replace(redis_wait_timeout_ms=5000, redis_socket_timeout_s=5)
    assert Settings().replace(redis_wait_timeout_ms=5000, redis_socket_timeout_s=6).redis_socket_timeout_s == 6


def test_celery_gets_sentinel_options_and_plain_urls_stay_as_they_were() -> None:
    plain = Settings()
    config = celery_config(plain, worker=True)
    assert config["broker_url"] == plain.broker_url and "broker_transport" not in config
    assert config["result_backend"] == f"ttsq.app:ResultBackend+{plain.result_backend}"
    assert "master_name" not in config["broker_transport_options"]
    assert "master_name" not in config["result_backend_transport_options"]

    ha = plain.replace(
        broker_url="sentinel://:data@h1:26379;sentinel://h2:26380/0",
        result_backend="sentinel://:data@h1:26379;sentinel://h2:26380/1",
        redis_master_name="mymaster",
        sentinel_password="sentinel",
    )
    config = celery_config(ha, worker=True)
    assert config["broker_url"] == "sentinel://:data@h1:26379/0;sentinel://:data@h2:26380/0"
    assert config["result_backend"] == (
        "ttsq.app:SentinelResultBackend+sentinel://:data@h1:26379/1;sentinel://:data@h2:26380/1"
    )
    for options in (config["broker_transport_options"], config["result_backend_transport_options"]):
        assert options["master_name"] == "mymaster"
        # The Sentinels' own password, apart from the data nodes' (in the URL), and short timeouts.
        assert options["sentinel_kwargs"]["password"] == "sentinel"
        assert options["sentinel_kwargs"]["socket_timeout"] <= 1
    app = make_app(ha)
    assert type(app.backend).__name__ == "SentinelResultBackend"
    assert app.backend.connparams["db"] == 1 and app.backend.connparams["password"] == "data"
    app.close()


@pytest.fixture
def topology() -> Iterator[SentinelTopology]:
    topology = SentinelTopology(replicas=2, password=DATA_PASSWORD, sentinel_password=SENTINEL_PASSWORD).start()
    yield topology
    topology.stop()


@pytest.fixture
def ha_settings(settings: Settings, topology: SentinelTopology) -> Settings:
    """The test's settings (its own queue and S3 prefix) on the Sentinel topology; a submit waits for one
    replica to hold its record."""
    return settings.replace(
        broker_url=topology.url(0),
        result_backend=topology.url(1),
        cache_url=topology.url(2),
        redis_master_name=MASTER_NAME,
        sentinel_password=SENTINEL_PASSWORD,
        redis_wait_replicas=1,
        lost_job_grace_s=3,
    )


def replicate(topology: SentinelTopology) -> None:
    """Wait until both replicas hold every write so far: what the test wrote before the kill is then
    on whichever replica the Sentinels promote (replication is asynchronous; this test is about
    following the primary, not about the writes a failover may lose)."""
    with topology.node(topology.primary_port()) as primary:
        assert primary.execute_command("WAIT", 2, 5000) == 2


@pytest.mark.parametrize("worker", [False, True], ids=["producer", "worker"])
def test_a_broker_connection_keeps_ttsqs_transport_when_it_moves_to_the_next_sentinel(worker: bool) -> None:
    """kombu moves a connection to the next URL of the list after a connection error, and took that URL's
    scheme for its transport: after a failover a worker consumed through kombu's stock Sentinel
    transport, outside its envelope gate, and ended on the new primary's first ``NOREPLICAS``
    ("Unrecoverable error: ResponseError") while its replicas were not back yet."""
    urls = ";".join(f"sentinel://{':secret@' if i == 0 else ''}127.0.0.1:{26379 + i}" for i in range(3))
    settings = Settings().replace(broker_url=urls + "/0", redis_master_name=MASTER_NAME)
    app = make_app(settings, worker=worker)
    if worker:
        app.conf.broker_transport = gated_transport(settings.broker_url)  # as ttsq.worker.tasks.worker_app
    connection = app.connection_for_read()
    named = connection.transport_cls
    assert named != "sentinel"
    for port in (26380, 26381, 26379):
        connection.maybe_switch_next()
        assert (connection.transport_cls, connection.port, connection.password) == (named, port, "secret")
    connection.release()


@pytest.mark.slow  # a Sentinel topology and a failover: tens of seconds
def test_every_client_follows_a_failover_with_a_sentinel_down(
    ha_settings: Settings, topology: SentinelTopology
) -> None:
    owner = RedisOwner(ha_settings, role="test", patience_s=30)
    app = make_app(ha_settings)
    # Every pool exists and has talked to the first primary before it dies.
    owner.cache.set("ttsq:test:before", "cache")
    owner.broker.rpush("ttsq:test:list", "broker")
    owner.accepted.accept("before", task="ttsq.synthesize", queue="q", kwargs={"text": "x"}, headers={})
    app.backend.set(app.backend.get_key_for_task("before"), '{"status": "PENDING", "result": null}')
    # The gateway's async pool, on one event loop for the whole test as in a gateway process.
    loop = asyncio.new_event_loop()
    gateway_side = owner.async_client(ha_settings.cache_url)
    assert loop.run_until_complete(gateway_side.get("ttsq:test:before")) == "cache"
    replicate(topology)

    # One Sentinel (the first the URLs name) is gone for good: the others still make a quorum.
    topology.stop_sentinel(0)
    old = topology.fail_primary()
    killed = time.monotonic()

    # Called at once, with the primary dead and no new one yet: the record's own patience rides it out.
    owner.accepted.accept("during", task="ttsq.synthesize", queue="q", kwargs={"text": "y"}, headers={})
    assert time.monotonic() - killed > 0.5, "the call cannot have reached a primary that was just killed"
    new = topology.wait_for_failover(old.port)
    assert new != old.port

    # The sync pools: the records, the broker's database.
    assert owner.cache.get("ttsq:test:before") == "cache"
    assert owner.broker.lrange("ttsq:test:list", 0, -1) == ["broker"]
    assert {task_id for task_id, _ in owner.accepted.unseen("q")} >= {"before", "during"}
    # The async pool, the same one: its connection to the dead primary is dropped, a new one goes to
    # the new primary (one failed call first, the gateway's 503 for that request: hence the retry).
    wait_until(lambda: _async_get(loop, gateway_side, "ttsq:test:before") == "cache", 10, "the async pool to follow")
    loop.run_until_complete(owner.aclose())
    loop.close()
    # Celery's result backend and broker, through the app built before the kill.
    assert stored_result(app, "before").state == "PENDING"
    app.send_task("ttsq.noop", task_id="after", queue="ttsq:test:celery")
    with topology.node(new, db=0) as primary:
        assert primary.llen("ttsq:test:celery") == 1  # published to the new primary
        assert primary.get("ttsq:test:missing") is None

    # The old primary comes back (a partition healed, a host rebooted): the Sentinels make it a replica,
    # and ttsq's writes keep going to the new primary.
    topology.restart(old)
    wait_until(lambda: _role(topology, old.port) == "slave", 30, "the old primary to rejoin as a replica")
    owner.cache.set("ttsq:test:after", "new")
    with topology.node(new, db=2) as primary:
        assert primary.get("ttsq:test:after") == "new"
    owner.close()
    app.close()


def _async_get(loop: asyncio.AbstractEventLoop, client: aioredis.Redis, key: str) -> str | None:
    try:
        return loop.run_until_complete(client.get(key))  # type: ignore[no-any-return]
    except redis.RedisError:
        return None


def _role(topology: SentinelTopology, port: int) -> str:
    try:
        with topology.node(port) as node:
            return str(node.role()[0])
    except redis.RedisError:
        return "down"


@pytest.mark.slow  # a Sentinel topology and a failover: tens of seconds
def test_every_lua_script_runs_on_a_new_primary_with_an_empty_script_cache(
    ha_settings: Settings, topology: SentinelTopology
) -> None:
    """Each record's script was loaded (and its SHA kept) on the first primary; on the promoted replica
    its cache is empty (flushed here to be sure): every script meets NOSCRIPT, loads, and runs."""
    owner = RedisOwner(ha_settings, role="test", patience_s=30)
    gateway = Gateway(ha_settings)
    # Plain clients of the test's own, through Sentinel: whichever node is the primary.
    admin = connect(ha_settings.cache_url, settings=ha_settings)
    results_db = connect(ha_settings.result_backend, settings=ha_settings)
    runs = script_runs(owner, gateway, admin, results_db)

    async def across_a_failover() -> None:
        try:
            await run_every_script(runs, admin, flush=False)  # loaded on the first primary
            replicate(topology)
            old = topology.fail_primary()
            new = topology.wait_for_failover(old.port)
            await asyncio.sleep(0)
            wait_until(lambda: _answers(admin), 30, "the test's own client to reach the new primary")
            assert admin.connection_pool.get_master_address()[1] == new  # type: ignore[attr-defined]
            await run_every_script(runs, admin, flush=True)  # on the new primary, each after a SCRIPT FLUSH
        finally:
            await gateway.close()

    asyncio.run(across_a_failover())
    owner.close()
    admin.close()
    results_db.close()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.mark.slow
def test_a_worker_and_a_gateway_keep_serving_across_a_failover(
    ha_settings: Settings,
    topology: SentinelTopology,
    start_worker: StartWorker,
    start_gateway: StartGateway,
    tmp_path: Path,
) -> None:
    """A burst of distinct jobs from a producer and requests through a gateway; the primary dies in the
    middle. Every submit is accepted or refused (BrokerError); every accepted job completes, each stored
    once; the same worker and gateway processes serve before and after the switch."""
    worker = start_worker(ha_settings)
    gateway = start_gateway(ha_settings)
    token = api_key(ha_settings)
    producer = Client(ha_settings)
    accepted: list[tuple[str, Job]] = []
    refused: list[str] = []
    accepted_after_kill: list[float] = []
    killed: list[float] = []
    stop = threading.Event()

    def speak(i: int) -> int:
        try:
            return httpx.post(
                f"{gateway.url}/v1/audio/speech",
                headers={"Authorization": f"Bearer {token}"},
                json={"model": "tts-1", "voice": "alloy", "input": f"Gateway request {i}.", "response_format": "wav"},
                timeout=120,
            ).status_code
        except httpx.HTTPError:
            return 0

    def burst() -> None:
        i = 0
        while not stop.is_set():
            text = f"Failover sentence number {i}."
            try:
                accepted.append((text, producer.submit(text)))
                if killed:
                    accepted_after_kill.append(time.monotonic())
            except BrokerError:
                refused.append(text)
            i += 1
            time.sleep(0.02)

    assert speak(-1) == 200
    thread = threading.Thread(target=burst)
    thread.start()
    try:
        wait_until(lambda: len(accepted) >= 40, 60, "jobs accepted before the kill")
        old = topology.fail_primary()
        killed.append(time.monotonic())
        new = topology.wait_for_failover(old.port)
        # Submits are accepted again, by the same producer, on the new primary.
        wait_until(lambda: len(accepted_after_kill) >= 40, 90, "jobs accepted after the failover")
    finally:
        stop.set()
        thread.join()
    try:
        for text, job in accepted:
            try:
                assert job.wait(timeout=120)["duration_s"] > 0, text
            except JobError as exc:  # what the job's records and the worker say is why
                status = producer.status(job.id or "")
                raise AssertionError(f"{exc}; status {status}; the worker's log ends: {worker.log()[-20000:]}") from exc
    finally:
        # Closed on failure too: left open, its result subscriptions follow the ports it knew, and a
        # later test's Redis on one of them saw them (test_document's subscription checks failed so).
        producer.close()
    # What the worker held when its connection died it finished, and acknowledged on the new primary: no
    # entry is left in kombu's unacked hash to run again when the visibility timeout passes.
    with topology.node(new, db=0) as broker:
        wait_until(lambda: broker.hlen("unacked") == 0, 30, "no message left unacknowledged on the new primary")
    # The gateway, never restarted, serves through the new primary.
    assert speak(1) == 200
    assert httpx.get(f"{gateway.url}/readyz", timeout=30).status_code == 200
    # The command line, on the same settings: a submit, the fleet's view, and no password in sight.
    assert submit_cli(ha_settings, "A command line sentence.", output=tmp_path / "cli.wav")["duration_s"]
    for command in (("stats", "--json"), ("config", "--json")):
        shown = run_cli(*command, settings=ha_settings)
        assert shown.returncode == 0, shown.stderr.decode()[-2000:]
        assert DATA_PASSWORD.encode() not in shown.stdout and SENTINEL_PASSWORD.encode() not in shown.stdout
    # Each distinct accepted job is stored once (plus the gateway's two and the command's): no second
    # object for a job that ran again.
    assert len([key for key in s3_keys(ha_settings) if key.endswith(".wav")]) == len(accepted) + 3
    assert worker.process is not None and worker.process.poll() is None
    assert gateway.process.poll() is None


@pytest.mark.slow  # a Sentinel topology and a failover: tens of seconds
def test_a_submit_to_a_partitioned_primary_that_comes_back_is_refused_or_kept(
    ha_settings: Settings, topology: SentinelTopology
) -> None:
    """The primary freezes (SIGSTOP: alive, the producer's connections to it open), another is promoted,
    then it goes on. Redis itself may take a write on such a connection in the moment before it notices
    its replicas are gone (and throw it away when it is demoted): a submit, which waits for a replica
    to hold its record, is refused then, or kept. Never accepted and lost."""
    producer = Client(ha_settings)
    producer.submit("Before the partition.")
    replicate(topology)
    old = topology.pause_primary()
    new = topology.wait_for_failover(old.port)
    topology.resume(old)
    accepted: list[str] = []
    # At once: the first go on the connections still open to the old primary; then until the producer
    # has found the new one (on a loaded machine that can take every one of the first few).
    deadline, i = time.monotonic() + 30, 0
    while i < 10 or (not accepted and time.monotonic() < deadline):
        with contextlib.suppress(BrokerError):  # refused: the caller knows
            accepted.append(producer.submit(f"After the partition, number {i}.").id or "")
        i += 1
        if i >= 10:
            time.sleep(0.2)
    wait_until(lambda: _role(topology, old.port) == "slave", 30, "the old primary to be demoted")
    wait_until(lambda: _synced(topology, old.port), 30, "the old primary to sync from the new one")
    assert accepted, "no submit was accepted after the partition healed"
    with topology.node(new, db=2) as primary:
        assert primary.exists(*(ACCEPTED_PREFIX + task_id for task_id in accepted)) == len(accepted)
    producer.close()


def _synced(topology: SentinelTopology, port: int) -> bool:
    with topology.node(port) as node:
        return node.info("replication").get("master_link_status") == "up"


@pytest.mark.slow  # a Sentinel topology, a worker, a gateway and a 30 s sleep: about a minute
def test_a_silent_primary_is_abandoned_in_seconds_and_a_demoted_one_is_never_read(
    ha_settings: Settings, topology: SentinelTopology, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    """``DEBUG SLEEP 30`` on the primary under load: alive, its connections open, silent. Every process
    moves to the replica the Sentinels promote long before the sleep ends (a producer ``Client``, a
    gateway process, a worker storing results: without socket timeouts each waited the whole 30 s on
    the silent socket), and a ``Client`` made before the fault never answers ``UnknownJob`` for a job it
    accepted (its connections to the old primary, awake and then demoted, kept serving stale reads)."""
    worker = start_worker(ha_settings)
    gateway = start_gateway(ha_settings)
    headers = {"Authorization": f"Bearer {api_key(ha_settings)}"}
    before = Client(ha_settings)  # made, and connected, before the fault
    idle = Client(ha_settings)  # made and connected before the fault, then idle until the old primary wakes
    accepted: list[tuple[str, float]] = []  # (job id, when), by the Client
    through_gateway: list[tuple[str, float]] = []  # (job id, when), by the gateway
    stop = threading.Event()

    def submit_forever() -> None:
        i = 0
        while not stop.is_set():
            with contextlib.suppress(BrokerError):  # refused while there is no primary: the caller knows
                accepted.append((before.submit(f"Silent primary sentence {i}.").id or "", time.monotonic()))
            i += 1
            time.sleep(0.2)  # four a second: dozens on each side of the fault, not a worker's CPU

    def post_forever() -> None:
        i = 0
        with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as api:
            while not stop.is_set():
                with contextlib.suppress(httpx.HTTPError):
                    answer = api.post("/v1/jobs", json={"text": f"Silent primary request {i}."})
                    if answer.status_code == 202:
                        through_gateway.append((answer.json()["id"], time.monotonic()))
                i += 1
                time.sleep(0.2)

    unknown: list[str] = []  # accepted jobs the Client made before the fault called unknown, at any time

    def read_forever() -> None:
        i = 0
        while not stop.is_set():
            if accepted:
                job_id = accepted[i % len(accepted)][0]
                try:
                    before.status(job_id)
                except UnknownJob:
                    unknown.append(job_id)
                except BrokerError:
                    pass  # no primary to ask right now: not an answer
                i += 1
            time.sleep(0.02)

    threads = [threading.Thread(target=target) for target in (submit_forever, post_forever, read_forever)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(accepted) >= 10 and len(through_gateway) >= 10, 60, "jobs accepted before the fault")
        idle.status(accepted[0][0])  # its pools' connections open, to the first primary
        replicate(topology)
        old = topology.sleep_primary(30)
        slept = time.monotonic()
        new = topology.wait_for_failover(old.port)
        promoted = time.monotonic()
        # A result the worker stores after the promotion, on the new primary: its consumer and its
        # result backend both moved.
        with topology.node(new, db=1) as results:
            wait_until(
                lambda: any(
                    results.exists(RESULT_PREFIX + job_id) for job_id, at in accepted + through_gateway if at > promoted
                ),
                60,
                "a result stored on the new primary",
                interval=0.1,
            )
        stored = time.monotonic()
        wait_until(lambda: any(at > promoted for _, at in accepted), 60, "a Client's submit after the promotion")
        wait_until(lambda: any(at > promoted for _, at in through_gateway), 60, "a gateway job after the promotion")
        # The old primary wakes still calling itself primary, until the Sentinels demote it (seconds
        # later), and without what was written on the new one. The idle Client's connections lead
        # there, open and answering: it must ask the new primary all the same.
        wait_until(lambda: _role(topology, old.port) != "down", 60, "the old primary to wake")
        while_stale = [job_id for job_id, at in accepted + through_gateway if at > promoted]
        for job_id in while_stale:
            try:
                idle.status(job_id)
            except UnknownJob:
                unknown.append(job_id)
        stale_role = _role(topology, old.port)
        wait_until(lambda: _role(topology, old.port) == "slave", 60, "the old primary to be demoted")
        wait_until(lambda: _synced(topology, old.port), 60, "the old primary to sync from the new one")
    finally:
        stop.set()
        for thread in threads:
            thread.join()

    first_client = min(at for _, at in accepted if at > slept) - promoted
    first_gateway = min(at for _, at in through_gateway if at > slept) - promoted
    print(
        f"\npromoted {promoted - slept:.2f} s after the primary went silent; first accepted after the promotion: "
        f"Client {first_client:.2f} s, gateway {first_gateway:.2f} s, a worker's result {stored - promoted:.2f} s; "
        f"{len(while_stale)} jobs read by an idle Client as the old primary woke (then {stale_role})"
    )
    # Functional bounds, not timings: each moved long before the 30 s sleep was over.
    assert first_client < 15 and first_gateway < 15 and stored - promoted < 15

    # Every job accepted, by the Client made before the fault and by the gateway, is known and completes;
    # read through the old Client and the old gateway, never "unknown".
    for job_id, _ in accepted:
        try:
            before.status(job_id)
        except UnknownJob:
            unknown.append(job_id)
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as api:
        missing = [job_id for job_id, _ in through_gateway if api.get(f"/v1/jobs/{job_id}").status_code == 404]
    assert not unknown and not missing, (
        f"accepted jobs called unknown: {len(unknown)} by the Client, {len(missing)} by the gateway"
    )
    try:
        for job_id, _ in accepted + through_gateway:
            assert before.wait(job_id, timeout=120)["duration_s"] > 0
    finally:
        before.close()
        idle.close()
    assert worker.process is not None and worker.process.poll() is None
    assert gateway.process.poll() is None
