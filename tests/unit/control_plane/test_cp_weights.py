"""The peer directory of model weights: who a cold node fetches from, residency, and
what heartbeats, withdrawals and deregistration do to it. SQLite and Postgres."""

from __future__ import annotations

import asyncio

from cp_harness import ControlPlane

DIGEST = "ab" * 32


async def _sources(cp: ControlPlane, node_id: str, **body: object) -> list[dict[str, object]]:
    r = await cp.http.post(f"/v1/weights/{DIGEST}/sources", json={"node_id": node_id, **body}, headers=cp.internal)
    assert r.status_code == 200, r.text
    assert "us" in r.json()["node_zones"]
    return r.json()["peers"]  # type: ignore[no-any-return]


async def test_first_asker_goes_to_the_origin_the_next_ones_to_it(cp: ControlPlane) -> None:
    for n in ("n1", "n2", "n3", "far"):
        assert (await cp.register(n, region="gcp:us-central1" if n == "far" else "aws:us-east-1")).status_code == 200
    assert await _sources(cp, "n1") == []
    assert [(p["node_id"], p["state"]) for p in await _sources(cp, "n2")] == [("n1", "fetching")]
    # n1 finished: cached peers come first; a repeated ask keeps n2's original claim.
    assert (await cp.heartbeat("n1", weights=[DIGEST])).status_code == 200
    assert [(p["node_id"], p["state"]) for p in await _sources(cp, "n3")] == [("n1", "cached"), ("n2", "fetching")]
    assert await _sources(cp, "far") == []  # another region never gets them as peers

    listed = (await cp.http.get("/v1/nodes", headers=cp.admin)).json()
    assert {n["node_id"]: n["weights"] for n in listed}["n1"] == [DIGEST]

    # Withdrawn (failed or evicted) and deregistered nodes stop being offered.
    r = await cp.http.delete(f"/v1/weights/{DIGEST}/nodes/n2", headers=cp.internal)
    assert r.status_code == 204
    assert (await cp.http.delete("/v1/nodes/n1", headers=cp.internal)).status_code == 204
    assert [p["node_id"] for p in await _sources(cp, "n3")] == []


async def test_concurrent_askers_get_one_seeder(cp: ControlPlane) -> None:
    nodes = [f"c{i}" for i in range(6)]
    for n in nodes:
        assert (await cp.register(n)).status_code == 200
    answers = await asyncio.gather(*(_sources(cp, n) for n in nodes))
    assert sum(1 for a in answers if not a) == 1  # exactly one goes to the origin


async def test_zoned_model_is_refused_outside_its_zone(cp: ControlPlane) -> None:
    assert (await cp.register("us-node")).status_code == 200
    r = await cp.http.post(f"/v1/weights/{DIGEST}/sources", json={"node_id": "us-node", "zone": "eu"},
                           headers=cp.internal)
    body = cp.assert_problem(r, 403)
    assert "zone 'eu'" in body["detail"]
    r = await cp.http.post(f"/v1/weights/{DIGEST}/sources",
                           json={"node_id": "us-node", "zone": "us", "origin_region": "gcp:europe-west4"},
                           headers=cp.internal)
    assert "origin" in cp.assert_problem(r, 403)["detail"]
    unauth = await cp.http.post(f"/v1/weights/{DIGEST}/sources", json={"node_id": "us-node"})
    cp.assert_problem(unauth, 401)
