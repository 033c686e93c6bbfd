"""Every error of the admin API is a problem+json body; oversized bodies get 413."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from cp_harness import ControlPlane


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    return {"max_request_bytes": 2048, "instance_id": "cp-a"}


async def test_health(cp: ControlPlane) -> None:
    r = await cp.http.get("/health")
    assert r.status_code == 200
    # It says it is a control plane (not a router or a node on a mistyped port), and which one.
    assert r.json() == {"status": "ok", "service": "control-plane", "instance_id": "cp-a"}


async def test_oversized_body_by_content_length_is_413(cp: ControlPlane) -> None:
    r = await cp.register("node-a", models=["m" * 100] * 30)
    body = cp.assert_problem(r, 413)
    assert "2048" in body["detail"]


async def test_oversized_streamed_body_is_413(cp: ControlPlane) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b" " * 512

    r = await cp.http.post("/v1/nodes/register", content=chunks(), headers=cp.internal)
    assert "content-length" not in r.request.headers
    cp.assert_problem(r, 413)


@pytest.mark.parametrize("path", ["/v1/nodes/register", "/v1/nodes/node-a/heartbeat"])
@pytest.mark.parametrize(("declared", "why"), [("abc", "not a byte count"), ("-1", "not a byte count"),
                                               ("+5", "not a byte count"), ("5", "Content-Length header says 5")])
async def test_a_content_length_that_is_malformed_or_lies_is_a_400_problem_not_a_guess(
    cp: ControlPlane, path: str, declared: str, why: str
) -> None:
    """The control plane reads bodies with the router's and the node's one reader
    (meridian.http_body): it used to ignore a malformed Content-Length and read on. The
    heartbeat's fast path reads them the same way."""
    assert (await cp.register("node-a")).status_code == 200
    headers = {**cp.internal, "content-type": "application/json", "content-length": declared}
    r = await cp.http.post(path, content=b'{"status": "ready"}', headers=headers)
    body = cp.assert_problem(r, 400)
    assert why in body["detail"]
    assert r.headers["connection"] == "close"


async def test_streamed_body_under_the_limit_is_accepted(cp: ControlPlane) -> None:
    payload = b'{"node_id": "node-a", "region": "aws:us-east-1", "url": "http://a:1"}'

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(payload), 16):
            yield payload[i : i + 16]

    headers = {**cp.internal, "content-type": "application/json"}
    r = await cp.http.post("/v1/nodes/register", content=chunks(), headers=headers)
    assert r.status_code == 200, r.text


async def test_malformed_json_is_a_422_problem(cp: ControlPlane) -> None:
    headers = {**cp.internal, "content-type": "application/json"}
    r = await cp.http.post("/v1/nodes/register", content=b"{not json", headers=headers)
    cp.assert_problem(r, 422)


async def test_unknown_route_and_method_are_problems(cp: ControlPlane) -> None:
    cp.assert_problem(await cp.http.get("/v1/nope"), 404)
    cp.assert_problem(await cp.http.put("/v1/routing-table", headers=cp.internal), 405)


async def test_unexpected_error_is_a_500_problem_without_details(cp: ControlPlane) -> None:
    def explode() -> None:
        raise RuntimeError("secret internal state")

    cp.app.add_api_route("/test-explode", explode)
    r = await cp.http.get("/test-explode")
    cp.assert_problem(r, 500)
    assert "secret internal state" not in r.text
