"""The heartbeat fast path: an unchanged heartbeat is answered before FastAPI with the app's own
answer, and everything else (bad token, bad body, unknown node, a change) still reaches the app
and its one error mapping."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cp_harness import ControlPlane, on_manual_clock

from control_plane.auth import require_cluster_token
from meridian.contracts import HeartbeatAck

WEIGHTS = ["a" * 64]
REPORT = {"status": "ready", "models": ["tiny-llama"], "weights": WEIGHTS,
          "load": {"running": 1, "waiting": 0, "kv_cache_usage": 0.25}}

pytestmark = on_manual_clock


@contextmanager
def app_calls(cp: ControlPlane) -> Iterator[list[int]]:
    """Requests that reached the app's node routes (their cluster-token dependency ran)."""
    calls: list[int] = []

    async def counted(ctx: object = None) -> None:
        calls.append(1)

    original = dict(cp.app.dependency_overrides)
    cp.app.dependency_overrides[require_cluster_token] = counted
    try:
        yield calls
    finally:
        cp.app.dependency_overrides = original


async def test_an_unchanged_heartbeat_is_answered_before_the_app_with_its_answer(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready")
    first = await cp.heartbeat("node-a", **REPORT)  # the first report syncs the weights: the app
    assert first.status_code == 200
    version = await cp.version()
    with app_calls(cp) as calls:
        r = await cp.heartbeat("node-a", **{**REPORT, "load": {"running": 5}})
    assert calls == []
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    ack = HeartbeatAck.model_validate_json(r.content)
    assert ack.routing_version == version
    assert ack.heartbeat_interval_s == cp.app.state.ctx.pacer.interval_s()
    node = (await cp.http.get("/v1/nodes/node-a", headers=cp.admin)).json()
    assert node["load"]["running"] == 5


async def test_what_the_fast_path_cannot_take_is_answered_by_the_app(cp: ControlPlane) -> None:
    await cp.register("node-a", status="ready")
    await cp.heartbeat("node-a", **REPORT)
    url = "/v1/nodes/node-a/heartbeat"
    wrong = await cp.http.post(url, json=REPORT, headers={"authorization": "Bearer not-the-token"})
    assert wrong.status_code == 401 and wrong.headers["content-type"].startswith("application/problem+json")
    bad = await cp.http.post(url, content=b'{"status": "sleeping"}',
                             headers={**cp.internal, "content-type": "application/json"})
    assert bad.status_code == 422 and bad.headers["content-type"].startswith("application/problem+json")
    unknown = await cp.heartbeat("node-z", **REPORT)
    assert unknown.status_code == 404 and "register again" in unknown.json()["detail"]
    before = await cp.version()
    with app_calls(cp) as calls:  # a change routers must see: the full path, which bumps
        changed = await cp.heartbeat("node-a", **{**REPORT, "status": "draining"})
    assert calls == [1]
    assert changed.status_code == 200 and changed.json()["routing_version"] > before
