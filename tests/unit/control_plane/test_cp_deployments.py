"""Deployments: operators declare them, routers see them in the table and ask for scale-ups."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from cp_harness import REAPER, ControlPlane, on_manual_clock, until

from meridian.clock import ManualClock


async def _key(cp: ControlPlane, scope: str) -> dict[str, str]:
    r = await cp.create_key(name=scope, tenant="ops", zone="global", scopes=[scope])
    assert r.status_code == 201
    return {"authorization": f"Bearer {r.json()['key']}"}


async def _put(cp: ControlPlane, name: str, /, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return await cp.http.put(f"/v1/deployments/{name}", json=body, headers=headers or cp.admin)


async def _scale_up(cp: ControlPlane, model: str, **body: Any) -> httpx.Response:
    return await cp.http.post(f"/v1/deployments/{model}/scale-up", json=body, headers=cp.internal)


async def test_put_creates_then_updates_and_routers_see_it(cp: ControlPlane) -> None:
    v0 = await cp.version()
    r = await _put(cp, "tiny-llama", zone="eu", min_replicas=0, max_replicas=3)
    assert r.status_code == 201
    created = r.json()
    assert created["model"] == "tiny-llama" and created["zone"] == "eu"
    assert (created["min_replicas"], created["max_replicas"], created["desired_replicas"]) == (0, 3, 0)
    assert created["last_scale_request_at"] is None

    table = (await cp.table()).json()
    assert table["version"] == v0 + 1
    assert table["deployments"] == [{"model": "tiny-llama", "zone": "eu", "min_replicas": 0, "max_replicas": 3}]

    # The same body again changes nothing routers see: same version.
    r = await _put(cp, "tiny-llama", zone="eu", min_replicas=0, max_replicas=3)
    assert r.status_code == 200
    assert await cp.version() == v0 + 1

    # Raising min_replicas raises the desired count with it.
    r = await _put(cp, "tiny-llama", zone="eu", min_replicas=2, max_replicas=3)
    assert r.status_code == 200 and r.json()["desired_replicas"] == 2
    assert await cp.version() == v0 + 2

    listed = (await cp.http.get("/v1/deployments", headers=cp.admin)).json()
    assert [d["model"] for d in listed] == ["tiny-llama"]
    one = (await cp.http.get("/v1/deployments/tiny-llama", headers=cp.admin)).json()
    assert one == listed[0]


async def test_model_names_with_slashes(cp: ControlPlane) -> None:
    r = await _put(cp, "meta-llama/Llama-3.1-8B", max_replicas=2)
    assert r.status_code == 201 and r.json()["model"] == "meta-llama/Llama-3.1-8B"
    r = await cp.http.get("/v1/deployments/meta-llama/Llama-3.1-8B", headers=cp.admin)
    assert r.status_code == 200 and r.json()["zone"] == "global"
    r = await _scale_up(cp, "meta-llama%2FLlama-3.1-8B", reason="test")
    assert r.status_code == 200 and r.json()["desired_replicas"] == 1


async def test_scale_up_is_idempotent_and_recorded(cp: ControlPlane) -> None:
    await _put(cp, "tiny-llama", zone="eu", min_replicas=0, max_replicas=4)
    v = await cp.version()

    r = await _scale_up(cp, "tiny-llama", reason="scale-from-zero", queued_requests=3,
                        client_region="gcp:europe-west4", zone="eu")
    assert r.status_code == 200
    scaled = r.json()
    assert scaled["desired_replicas"] == 1
    assert scaled["last_scale_request_at"] is not None
    assert scaled["last_scale_reason"] == "scale-from-zero (3 queued)"
    assert scaled["last_scale_region"] == "gcp:europe-west4"

    # Routers re-ask while requests wait, several at once: still one replica.
    answers = await asyncio.gather(*(_scale_up(cp, "tiny-llama", queued_requests=9) for _ in range(5)))
    assert {a.status_code for a in answers} == {200}
    assert {a.json()["desired_replicas"] for a in answers} == {1}
    # desired_replicas is not routing state: the table keeps its version.
    assert await cp.version() == v

    # Never below min_replicas, never above max_replicas.
    await _put(cp, "big", min_replicas=3, max_replicas=5)
    assert (await _scale_up(cp, "big")).json()["desired_replicas"] == 3

    # A region the control plane does not know is not recorded as a hint.
    r = await _scale_up(cp, "tiny-llama", client_region="aws:nowhere-1")
    assert r.status_code == 200 and r.json()["last_scale_region"] is None


async def test_scale_up_of_an_unknown_deployment_is_404(cp: ControlPlane) -> None:
    body = cp.assert_problem(await _scale_up(cp, "no-such-model", reason="x"), 404)
    assert "no-such-model" in body["detail"]
    cp.assert_problem(await cp.http.get("/v1/deployments/no-such-model", headers=cp.admin), 404)


async def test_invalid_deployments_are_refused(cp: ControlPlane) -> None:
    cp.assert_problem(await _put(cp, "m", min_replicas=3, max_replicas=2), 422)
    cp.assert_problem(await _put(cp, "m", max_replicas=0), 422)
    cp.assert_problem(await _put(cp, "m", min_replicas=-1), 422)
    body = cp.assert_problem(await _put(cp, "m", zone="atlantis"), 400)
    assert "atlantis" in body["detail"]
    cp.assert_problem(await _put(cp, "m", replicas=2), 422)
    cp.assert_problem(await _scale_up(cp, "m", queued_requests=-1), 422)


async def test_a_disaggregated_topology_is_declared_shown_and_removed(cp: ControlPlane) -> None:
    topology = {"connector": "NixlConnector", "pools": {"gcp:europe-west4": {"prefill": 1, "decode": 3}},
                "prefill_per_decode": 0.5, "mean_prompt_tokens": 4000, "mean_output_tokens": 200,
                "min_prefill_replicas": 1, "max_prefill_replicas": 4}
    r = await _put(cp, "m", zone="eu", min_replicas=2, max_replicas=6, disaggregation=topology)
    assert r.status_code == 201
    made = r.json()
    assert made["disaggregation"]["pools"] == topology["pools"]
    assert made["disaggregation"]["connector"] == "NixlConnector"
    assert made["disaggregation"]["target_waiting_prompt_tokens"] == 8192  # the default
    # The decode pool starts at min_replicas, the prefill pool at its own minimum.
    assert (made["desired_replicas"], made["desired_prefill_replicas"]) == (2, 1)
    assert (await cp.http.get("/v1/deployments/m", headers=cp.admin)).json() == made

    # Raising the prefill pool's minimum raises its count; a new version.
    r = await _put(cp, "m", zone="eu", min_replicas=2, max_replicas=6,
                   disaggregation={**topology, "min_prefill_replicas": 3})
    assert r.json()["desired_prefill_replicas"] == 3
    assert r.json()["resource_version"] == made["resource_version"] + 1

    # Back to co-located: the topology and the prefill count go.
    r = await _put(cp, "m", zone="eu", min_replicas=2, max_replicas=6)
    assert r.status_code == 200
    assert "disaggregation" not in r.json() and "desired_prefill_replicas" not in r.json()


async def test_a_scale_from_zero_asks_for_a_prefill_worker_too(cp: ControlPlane) -> None:
    await _put(cp, "m", min_replicas=0, max_replicas=4,
               disaggregation={"min_prefill_replicas": 0, "max_prefill_replicas": 2})
    r = await _scale_up(cp, "m", reason="scale-from-zero")
    assert (r.json()["desired_replicas"], r.json()["desired_prefill_replicas"]) == (1, 1)


async def test_invalid_topologies_are_refused(cp: ControlPlane) -> None:
    for bad in (
        {"connector": "LMCacheConnector"},
        {"pools": {"gcp:europe-west4": {"prefill": 0, "decode": 1}}},
        {"pools": {"gcp:europe-west4": {"prefill": 1}}},
        {"prefill_per_decode": 0},
        {"prefill_per_decode": "nan"},
        {"mean_prompt_tokens": 0},
        {"min_prefill_replicas": 5, "max_prefill_replicas": 2},
        {"lease_s": 3},
    ):
        cp.assert_problem(await _put(cp, "m", zone="eu", disaggregation=bad), 422)
    body = cp.assert_problem(await _put(cp, "m", zone="eu", disaggregation={
        "pools": {"aws:nowhere-1": {"prefill": 1, "decode": 1}}}), 400)
    assert "aws:nowhere-1" in body["detail"]
    # Residency: an EU deployment's pools (and the KV between them) stay in the EU.
    body = cp.assert_problem(await _put(cp, "m", zone="eu", disaggregation={
        "pools": {"aws:us-east-1": {"prefill": 1, "decode": 1}}}), 400)
    assert "outside zone 'eu'" in body["detail"] and "aws:us-east-1" in body["detail"]
    assert (await cp.http.get("/v1/deployments", headers=cp.admin)).json() == []


async def test_who_may_do_what(cp: ControlPlane) -> None:
    operator = await _key(cp, "operator")
    reader = await _key(cp, "read-only")
    inference = await _key(cp, "inference")

    assert (await _put(cp, "m", headers=operator)).status_code == 201
    cp.assert_problem(await _put(cp, "m", headers=reader), 403)
    cp.assert_problem(await _put(cp, "m", headers=inference), 403)
    cp.assert_problem(await cp.http.put("/v1/deployments/m", json={}), 401)

    assert (await cp.http.get("/v1/deployments", headers=reader)).status_code == 200
    cp.assert_problem(await cp.http.get("/v1/deployments", headers=inference), 403)

    # Scale-up is for routers: the cluster token, not an API key.
    cp.assert_problem(await cp.http.post("/v1/deployments/m/scale-up", json={}, headers=cp.admin), 401)
    cp.assert_problem(await cp.http.post("/v1/deployments/m/scale-up", json={}), 401)


async def test_delete_removes_it_from_the_table(cp: ControlPlane) -> None:
    await _put(cp, "m")
    v = await cp.version()
    assert (await cp.http.delete("/v1/deployments/m", headers=cp.admin)).status_code == 204
    table = (await cp.table()).json()
    assert table["deployments"] == [] and table["version"] == v + 1
    cp.assert_problem(await cp.http.delete("/v1/deployments/m", headers=cp.admin), 404)


@on_manual_clock
async def test_a_deployment_change_wakes_long_polls(cp: ControlPlane, clock: ManualClock) -> None:
    r = await cp.table()
    etag = r.headers["etag"]
    poll = asyncio.create_task(
        cp.http.get("/v1/routing-table", params={"wait": 4}, headers={**cp.internal, "if-none-match": etag})
    )
    await until(lambda: clock.sleepers >= REAPER + 1)  # the poll waits
    assert not poll.done()
    await _put(cp, "m", min_replicas=0, max_replicas=1)
    answered = await asyncio.wait_for(poll, 2.0)
    assert answered.status_code == 200
    assert [d["model"] for d in answered.json()["deployments"]] == ["m"]


async def test_a_deployment_and_its_model_are_written_together_or_not_at_all(cp: ControlPlane) -> None:
    model = {"params_b": 0.135, "layers": 30, "kv_heads": 3, "head_dim": 64}
    audit_before = await cp.admin_list("/v1/audit")
    r = await _put(cp, "org/smol", zone="mars", model=model)
    cp.assert_problem(r, 400)
    r = await _put(cp, "org/smol", zone="eu", placement={"replicas": {"aws:atlantis-1": 1}}, model=model)
    cp.assert_problem(r, 400)
    r = await _put(cp, "org/smol", zone="eu", model={**model, "layers": 0})
    cp.assert_problem(r, 422)
    # Refused: no model was registered, and nothing was recorded.
    cp.assert_problem(await cp.http.get("/v1/models/org/smol", headers=cp.admin), 404)
    assert await cp.admin_list("/v1/audit") == audit_before

    r = await _put(cp, "org/smol", zone="eu", model=model)
    assert r.status_code == 201 and r.json()["zone"] == "eu"
    registered = (await cp.http.get("/v1/models/org/smol", headers=cp.admin)).json()
    assert (registered["layers"], registered["params_b"], registered["max_context"]) == (30, 0.135, 8192)
    entries = await cp.admin_list("/v1/audit")
    assert [(e["resource_type"], e["action"], e["resource_id"]) for e in entries[:2]] == [
        ("deployment", "create", "org/smol"), ("model", "create", "org/smol")]
    # Without a model, a PUT leaves the registered one as it is.
    assert (await _put(cp, "org/smol", zone="eu", max_replicas=2)).status_code == 200
    assert (await cp.http.get("/v1/models/org/smol", headers=cp.admin)).json() == registered
