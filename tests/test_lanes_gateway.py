"""Lanes and fair shares at the HTTP gateway (``ttsq serve``), on a real gateway, real workers, a real Redis
and real storage: the tenant is the API key's id (a body naming another is refused), and a key's default
lane (``ttsq keys add --lane``) chooses the queue unless the body names its own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import redis
from support import GatewayProcess, WorkerProcess, api_key, run_cli, s3_keys, wait_until

from ttsq.app import queue_for
from ttsq.config import Settings

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]


def add_key(settings: Settings, name: str, *args: str) -> dict[str, Any]:
    """A new key as ``ttsq keys list --json`` shows it, with its token: made by ``ttsq keys add NAME ARGS``
    when there are ARGS, else by ``support.api_key`` (see ``test_keys_add_without_a_lane_makes_a_key``)."""
    if args:
        out = run_cli("keys", "add", name, *args, "--json", settings=settings)
        assert out.returncode == 0, out.stderr.decode()
        token = json.loads(out.stdout)["token"]
    else:
        token = api_key(settings, name)  # named NAME-<a number>
    listed = json.loads(run_cli("keys", "list", "--json", settings=settings).stdout)
    (row,) = [row for row in listed if row["name"] == name or row["name"].startswith(f"{name}-")]
    return {**row, "token": token}


def http(gateway: GatewayProcess, token: str) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {token}"}, timeout=60)


def queue_row(settings: Settings, queue: str) -> dict[str, Any]:
    """``ttsq stats --json``'s row for one queue (no worker ping)."""
    out = run_cli("stats", "--json", "--ping-timeout", "0", settings=settings)
    assert out.returncode == 0, out.stderr.decode()
    (row,) = [q for q in json.loads(out.stdout)["queues"] if q["queue"] == queue]
    return dict(row)


def lengths(settings: Settings) -> tuple[int, int]:
    """Messages waiting in this test's voice_design queues: (interactive, bulk)."""
    broker = redis.Redis.from_url(settings.broker_url)
    try:
        return int(broker.llen(settings.queue)), int(broker.llen(queue_for(settings.queue, "voice_design", "bulk")))
    finally:
        broker.close()


def waiting_records(settings: Settings) -> list[bytes]:
    """Accepted records and deferred lists in this test's cache database (flushed for each test)."""
    cache = redis.Redis.from_url(settings.cache_url)
    try:
        return [*cache.scan_iter("ttsq:accepted:*"), *cache.scan_iter("ttsq:deferred:*")]
    finally:
        cache.close()


def test_a_gateway_job_waits_for_release_under_its_api_keys_id_and_completes(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    settings = settings.replace(release_window=1)
    gateway = start_gateway(settings)
    a, b = add_key(settings, "tenant-a"), add_key(settings, "tenant-b")
    assert a["id"] != b["id"] and len(a["id"]) == 12
    ids: list[tuple[str, str]] = []  # (token, job id): a key sees only its own jobs
    for key, count in ((a, 3), (b, 1)):
        with http(gateway, key["token"]) as api:
            for i in range(count):
                submitted = api.post("/v1/jobs", json={"text": f"Sentence {i} of key {key['name']}."})
                assert submitted.status_code == 202, submitted.text
                ids.append((key["token"], submitted.json()["id"]))
    # No worker: one job in the list (the window), the rest waiting under their keys' ids, none under a name
    # the body could have chosen.
    row = queue_row(settings, settings.queue)
    assert row["lane"] == "interactive" and row["depth"] == 1 and row["in_flight"] == 0
    assert row["deferred"] == {a["id"]: 2, b["id"]: 1}
    start_worker(settings)

    def done() -> bool:
        for token, job_id in ids:
            with http(gateway, token) as api:
                if api.get(f"/v1/jobs/{job_id}").json()["state"] != "SUCCESS":
                    return False
        return True

    wait_until(done, 90, "every job of both keys", interval=0.2)
    assert len(s3_keys(settings)) == len(ids) == 4
    row = queue_row(settings, settings.queue)
    assert row["depth"] == 0 and row["deferred"] == {}


def test_a_body_naming_another_tenant_is_refused_and_nothing_is_queued(
    settings: Settings, start_gateway: StartGateway
) -> None:
    gateway = start_gateway(settings.replace(release_window=0))
    key = add_key(settings, "one-tenant")
    with http(gateway, key["token"]) as api:
        refused = api.post("/v1/jobs", json={"text": "Charged to someone else.", "tenant": "someone-else"})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "tenant"
        batch = api.post("/v1/jobs/batch", json={"requests": [{"text": "Batched.", "tenant": "someone-else"}]})
        assert batch.status_code == 200 and batch.json()["jobs"][0]["error"]["param"] == "requests[0].tenant"
        assert lengths(settings) == (0, 0) and waiting_records(settings) == []
        # The key's own id is its tenant anyway: naming it is no fault, and that job is queued.
        own = api.post("/v1/jobs", json={"text": "Charged to the key itself.", "tenant": key["id"]})
        assert own.status_code == 202, own.text
    assert lengths(settings) == (1, 0)


def test_a_keys_lane_chooses_the_queue_unless_the_body_names_one(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    settings = settings.replace(release_window=0)  # nothing deferred: every job goes straight to its list
    gateway = start_gateway(settings)
    bulk, plain = add_key(settings, "batch-jobs", "--lane", "bulk"), add_key(settings, "plain")
    assert (bulk["lane"], plain["lane"]) == ("bulk", None)
    ids, plain_ids = [], []  # each key's own: a key sees only its own jobs
    with http(gateway, bulk["token"]) as api:
        ids.append(api.post("/v1/jobs", json={"text": "The key's lane: bulk."}).json()["id"])
        assert lengths(settings) == (0, 1)
        ids.append(api.post("/v1/jobs", json={"text": "The body's lane wins.", "lane": "interactive"}).json()["id"])
        assert lengths(settings) == (1, 1)
        # A lane that does not exist is the body's fault, not replaced by the key's lane.
        refused = api.post("/v1/jobs", json={"text": "Right now, please.", "lane": "urgent"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lane", refused.text
    with http(gateway, plain["token"]) as api:
        plain_ids.append(api.post("/v1/jobs", json={"text": "A key without a lane."}).json()["id"])
        refused = api.post("/v1/jobs", json={"text": "Right now, please.", "lane": "urgent"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "lane", refused.text
    assert lengths(settings) == (2, 1)
    assert queue_row(settings, queue_for(settings.queue, "voice_design", "bulk"))["lane"] == "bulk"
    start_worker(settings)

    def done() -> bool:
        for token, owned in ((bulk["token"], ids), (plain["token"], plain_ids)):
            with http(gateway, token) as api:
                if not all(api.get(f"/v1/jobs/{job_id}").json()["state"] == "SUCCESS" for job_id in owned):
                    return False
        return True

    wait_until(done, 90, "the jobs of both lanes", interval=0.2)
    assert lengths(settings) == (0, 0) and len(s3_keys(settings)) == 3


def test_keys_add_without_a_lane_makes_a_key(settings: Settings) -> None:
    """``ttsq keys add NAME``, the plain command, with no ``--lane``: a key whose jobs keep their own default lane."""
    out = run_cli("keys", "add", "no-lane", "--json", settings=settings)
    assert out.returncode == 0, out.stderr.decode()
    assert json.loads(out.stdout)["lane"] is None
