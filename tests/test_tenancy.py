"""Tenants at the gateway: a key sees only its own jobs, and sharing audio never shares a job id.

Real ``ttsq serve`` and ``ttsq worker`` processes on loopback, real Redis and S3, httpx as the client.
A job that must still be under way while another key acts on it is queued while no worker runs (the
fleet's model stays announced for a while after its worker stops), then a worker is started: no timing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from support import SECRET, GatewayProcess, WorkerProcess, api_key, s3_keys, wait_until

from ttsq.config import Settings

StartWorker = Callable[..., WorkerProcess]
StartGateway = Callable[..., GatewayProcess]


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def done(gateway: GatewayProcess, token: str, job_id: str, timeout: float = 90.0) -> dict[str, Any]:
    """The job's status once final."""
    found: dict[str, Any] = {}

    def final() -> bool:
        found.update(httpx.get(f"{gateway.url}/v1/jobs/{job_id}", headers=auth(token), timeout=10).json())
        return found.get("state") in ("SUCCESS", "FAILURE", "REVOKED")

    wait_until(final, timeout, f"job {job_id} to finish")
    return found


def same_answer(theirs: httpx.Response, their_id: str, unknown: httpx.Response, unknown_id: str) -> None:
    """Two answers alike byte for byte but for the id each names."""
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.content.replace(their_id.encode(), b"ID") == unknown.content.replace(unknown_id.encode(), b"ID")
    assert theirs.headers.get("content-type") == unknown.headers.get("content-type")


def test_every_job_route_answers_another_keys_job_as_an_id_never_issued(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    start_worker(settings)
    gateway = start_gateway(settings)
    alice, bob = api_key(settings, "alice"), api_key(settings, "bob")
    created = httpx.post(
        f"{gateway.url}/v1/jobs", json={"text": f"{SECRET}, Alice's own words."}, headers=auth(alice), timeout=30
    )
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    assert done(gateway, alice, job_id)["state"] == "SUCCESS"
    audio = httpx.get(f"{gateway.url}/v1/jobs/{job_id}/audio", headers=auth(alice), timeout=30)
    assert audio.status_code == 200 and audio.content[:4] == b"RIFF"

    unknown_id = str(uuid.uuid4())
    for method, path in [("GET", "/v1/jobs/{}"), ("GET", "/v1/jobs/{}/audio"), ("DELETE", "/v1/jobs/{}")]:
        theirs = httpx.request(method, gateway.url + path.format(job_id), headers=auth(bob), timeout=30)
        unknown = httpx.request(method, gateway.url + path.format(unknown_id), headers=auth(bob), timeout=30)
        same_answer(theirs, job_id, unknown, unknown_id)
        assert theirs.json()["error"]["code"] == "not_found"
    # Bob's DELETE cancelled nothing: the owner's calls are as they were.
    assert done(gateway, alice, job_id)["state"] == "SUCCESS"
    again = httpx.get(f"{gateway.url}/v1/jobs/{job_id}/audio", headers=auth(alice), timeout=30)
    assert again.content == audio.content


def test_another_keys_identical_job_is_followed_under_an_id_of_its_own(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    # The fleet announces its model, then its worker stops: jobs wait in the queue, claims held.
    start_worker(settings, "announcer").stop()
    gateway = start_gateway(settings)
    alice, bob = api_key(settings, "alice"), api_key(settings, "bob")
    body = {"text": f"{SECRET}, the same words from two tenants."}

    def post(token: str) -> dict[str, Any]:
        answer = httpx.post(f"{gateway.url}/v1/jobs", json=body, headers=auth(token), timeout=30)
        assert answer.status_code in (200, 202), answer.text
        return dict(answer.json())

    theirs = post(alice)
    mine = post(bob)
    assert mine["joined"] and mine["id"] != theirs["id"]
    # Bob cancels his job: Alice's goes on.
    cancelled = httpx.delete(f"{gateway.url}/v1/jobs/{mine['id']}", headers=auth(bob), timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "REVOKED"
    status = httpx.get(f"{gateway.url}/v1/jobs/{theirs['id']}", headers=auth(alice), timeout=30).json()
    assert status["state"] == "PENDING"
    # A second try of Bob's follows Alice's job too, under a third id.
    second = post(bob)
    assert second["joined"] and second["id"] not in (theirs["id"], mine["id"])

    start_worker(settings)
    alices = done(gateway, alice, theirs["id"])
    bobs = done(gateway, bob, second["id"])
    assert alices["state"] == bobs["state"] == "SUCCESS"
    assert bobs["id"] == second["id"] and bobs["result"]["key"] == alices["result"]["key"]
    assert done(gateway, bob, mine["id"])["state"] == "REVOKED"  # his cancel stands, hers was not touched
    audio = [
        httpx.get(f"{gateway.url}/v1/jobs/{job_id}/audio", headers=auth(token), timeout=30).content
        for job_id, token in ((theirs["id"], alice), (second["id"], bob))
    ]
    assert audio[0] == audio[1] and audio[0][:4] == b"RIFF"
    # Once it is done, Bob's identical request is a cache hit: still not Alice's id.
    hit = post(bob)
    assert hit["state"] == "SUCCESS" and hit["id"] != theirs["id"]
    assert len([key for key in s3_keys(settings) if "/audio/" in key]) == 1  # synthesized once, for both


def test_a_tenant_scoped_cache_synthesizes_each_tenants_request_on_its_own(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway
) -> None:
    scoped = settings.replace(cache_scope="tenant")
    start_worker(scoped)
    gateway = start_gateway(scoped)
    alice, bob = api_key(settings, "alice"), api_key(settings, "bob")
    body = {"text": f"{SECRET}, a private cache."}
    results = []
    for token in (alice, bob):
        answer = httpx.post(f"{gateway.url}/v1/jobs", json=body, headers=auth(token), timeout=30)
        assert answer.status_code == 202, answer.text  # neither cached nor joined
        assert not answer.json()["joined"]
        results.append(done(gateway, token, answer.json()["id"])["result"])
    assert results[0]["key"] != results[1]["key"]
    assert not results[1]["cached"]
    assert len([key for key in s3_keys(settings) if "/audio/" in key]) == 2
    # Each tenant's own repeat is its own cache hit.
    again = httpx.post(f"{gateway.url}/v1/jobs", json=body, headers=auth(bob), timeout=30).json()
    assert again["state"] == "SUCCESS" and again["result"]["key"] == results[1]["key"]


@pytest.mark.parametrize("route", ["status", "cancel"])
def test_without_keys_every_job_is_everyones(
    settings: Settings, start_worker: StartWorker, start_gateway: StartGateway, route: str
) -> None:
    """``TTSQ_GATEWAY_AUTH=none``: as before tenants, any caller reads and cancels any job."""
    start_worker(settings, "announcer").stop()
    open_settings = settings.replace(gateway_auth="none")
    gateway = start_gateway(open_settings)
    created = httpx.post(f"{gateway.url}/v1/jobs", json={"text": f"{SECRET}, open."}, timeout=30).json()
    joined = httpx.post(f"{gateway.url}/v1/jobs", json={"text": f"{SECRET}, open."}, timeout=30).json()
    assert joined["joined"] and joined["id"] == created["id"]  # one tenant: today's single flight
    if route == "status":
        assert httpx.get(f"{gateway.url}/v1/jobs/{created['id']}", timeout=30).json()["state"] == "PENDING"
    else:
        answer = httpx.delete(f"{gateway.url}/v1/jobs/{created['id']}", timeout=30)
        assert answer.status_code == 200 and answer.json()["state"] == "REVOKED"
