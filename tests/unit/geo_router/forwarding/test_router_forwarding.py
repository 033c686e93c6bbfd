"""A real router in front of real stand-in nodes: routing, failover, passthrough, errors."""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import socket
from collections.abc import Callable

import httpx
import pytest
from router_harness import (
    CLUSTER_TOKEN,
    EU_KEY,
    GLOBAL_KEY,
    LIMITED_KEY,
    MODEL,
    SCRAPE,
    Fabric,
    NodeBehaviour,
    ServerGroup,
    eventually,
    make_table,
    metric,
    node,
    node_app,
    reserve_port,
    router_settings,
    running,
    url_of,
)

from chaos.history import Routed, read_records
from geo_router import create_app
from geo_router.selection.policies import register_policy
from geo_router.state.health import FailureKind
from geo_router.state.table import StaticTableSource
from meridian.contracts import HEADER_NODE, HEADER_OVERHEAD_MS, HEADER_REGION, HEADER_REQUEST_ID

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def hits(fabric: Fabric) -> dict[str, int]:
    return {name: b.hits for name, b in fabric.behaviours.items()}


async def test_served_by_the_nearest_region_with_routing_headers(fabric: Fabric):
    client = fabric.client()
    r = await client.post("/v1/chat/completions", json=CHAT | {"temperature": 0.5})
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "hi from us"
    assert r.headers[HEADER_REGION] == "aws:us-east-1"
    assert r.headers[HEADER_NODE] == "us-1"
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers[HEADER_REQUEST_ID])
    assert 0 <= float(r.headers[HEADER_OVERHEAD_MS]) < 1000
    # The node gets the body untouched but for the tenant's cache salt, the same request
    # id, the router's cluster token and never the client's key.
    us = fabric.behaviours["us"]
    assert us.bodies == [CHAT | {"temperature": 0.5, "cache_salt": us.bodies[0]["cache_salt"]}]
    assert re.fullmatch(r"[0-9a-f]{32}", us.bodies[0]["cache_salt"])
    assert us.request_ids == [r.headers[HEADER_REQUEST_ID]]
    assert us.headers[0]["authorization"] == f"Bearer {CLUSTER_TOKEN}"
    assert client.headers["authorization"] not in us.headers[0].values()

    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                          headers={HEADER_REQUEST_ID: "client-id.42"})
    assert r.status_code == 200 and r.headers[HEADER_REQUEST_ID] == "client-id.42"
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"},
                          headers={HEADER_REQUEST_ID: "bad id\twith junk"})
    assert r.headers[HEADER_REQUEST_ID] != "bad id\twith junk"


async def test_trusted_location_header_moves_the_client(fabric: Fabric):
    client = fabric.client()
    r = await client.post("/v1/chat/completions", json=CHAT,
                          headers={"x-meridian-client-location": "35.6,139.7"})
    assert r.headers[HEADER_REGION] == "onprem:tokyo-1"
    r = await client.post("/v1/chat/completions", json=CHAT,
                          headers={"x-meridian-client-location": "gcp:europe-west4"})
    assert r.headers[HEADER_REGION] == "gcp:europe-west4"


async def test_5xx_fails_over_to_the_next_region_and_ejects_the_node(fabric: Fabric):
    fabric.behaviours["us"].mode = "error500"
    client = fabric.client()
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.headers[HEADER_REGION] == "gcp:europe-west4" and r.headers[HEADER_NODE] == "eu-1"
    assert hits(fabric) == {"us": 1, "eu": 1, "apac": 0}
    # Ejected: the next request does not even try the US node.
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.headers[HEADER_REGION] == "gcp:europe-west4"
    assert hits(fabric) == {"us": 1, "eu": 2, "apac": 0}

    text = (await client.get("/metrics", headers=SCRAPE)).text
    assert metric(text, "meridian_router_failovers_total",
                  from_region="aws:us-east-1", to_region="gcp:europe-west4") == 1
    assert metric(text, "meridian_router_upstream_failures_total",
                  region="aws:us-east-1", node="us-1", reason="5xx") == 1
    assert metric(text, "meridian_router_requests_total",
                  region="gcp:europe-west4", node="eu-1", status="200", reason="") == 2


async def test_refused_connection_fails_over(fabric: Fabric):
    dead = reserve_port()  # bound, never listening: connections are refused
    try:
        fabric.set_nodes([node("us", url_of(dead)), node("eu", fabric.node_urls["eu"]),
                          node("apac", fabric.node_urls["apac"])])
        r = await fabric.client().post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 200 and r.headers[HEADER_REGION] == "gcp:europe-west4"
    finally:
        dead.close()


async def test_4xx_from_a_node_is_passed_through_and_not_retried(fabric: Fabric):
    fabric.behaviours["us"].mode = "error400"
    client = fabric.client()
    r = await client.post("/v1/chat/completions", json=CHAT | {"temperature": 9})
    assert r.status_code == 400
    assert r.json() == {"error": {"message": "temperature must be <= 2",
                                  "type": "invalid_request_error", "param": "temperature",
                                  "code": None}}
    assert r.headers[HEADER_REGION] == "aws:us-east-1"
    assert hits(fabric) == {"us": 1, "eu": 0, "apac": 0}
    # A 4xx is the client's fault: the node is not ejected.
    fabric.behaviours["us"].mode = "ok"
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.headers[HEADER_REGION] == "aws:us-east-1"


async def test_eu_tenant_is_never_failed_over_outside_eu(fabric: Fabric):
    client = fabric.client(EU_KEY)
    r = await client.post("/v1/chat/completions", json=CHAT,
                          headers={"x-meridian-client-location": "aws:us-east-1",
                                   "x-meridian-zone": "us", "x-meridian-residency": "global"})
    assert r.headers[HEADER_REGION] == "gcp:europe-west4"

    fabric.behaviours["eu"].mode = "error500"
    for _ in range(2):  # first: the eu node fails; second: it is ejected
        r = await client.post("/v1/chat/completions", json=CHAT,
                              headers={"x-meridian-client-location": "aws:us-east-1"})
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "no_replica_in_zone" and "`eu`" in err["message"]
        assert HEADER_REQUEST_ID in r.headers
        # Told when to come back: once the ejection (30 s in these tests) is over, at most 30 s.
        assert 1 <= int(r.headers["retry-after"]) <= 30
    # One served request, then one failure; the ejected node was not even tried again.
    assert hits(fabric) == {"us": 0, "eu": 2, "apac": 0}
    # The global tenant is unaffected.
    r = await fabric.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers[HEADER_REGION] == "aws:us-east-1"


async def test_attempts_are_bounded(fabric: Fabric):
    for b in fabric.behaviours.values():
        b.mode = "error500"
    r = await fabric.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
    assert r.headers["retry-after"] == "1"
    assert sum(hits(fabric).values()) == 3  # max_attempts


async def test_request_errors_are_openai_json(fabric: Fabric):
    client = fabric.client()
    cases = [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (b'{"messages": []}', 400, None),
        (b'{"model": "tiny-llama", "stream": "yes"}', 400, None),
        # Invalid UTF-8 inside a string (was a 500), and nesting the nodes would refuse.
        (b'{"model": "tiny-llama", "user": "\xff\xfe"}', 400, None),
        (b'{"model": "tiny-llama", "x": ' + b"[" * 65 + b"]" * 65 + b"}", 400, None),
        (b'{"model": "tiny-llama", "x": ' + b"[" * 953 + b"]" * 953 + b"}", 400, None),
        (b'{"model": "no-such-model"}', 404, "model_not_found"),
        (b'{"model": "' + b"m" * 201 + b'"}', 400, None),
        (b'{"model": "' + b"x" * 20_000 + b'"}', 413, "request_too_large"),
    ]
    for body, status, code in cases:
        r = await client.post("/v1/chat/completions", content=body,
                              headers={"content-type": "application/json"})
        assert r.status_code == status, body[:40]
        err = r.json()["error"]
        assert err["code"] == code and err["message"] and "Traceback" not in r.text
    # Allowed models only: the limited key may not use tiny-llama.
    r = await fabric.client(LIMITED_KEY).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = await client.get("/v1/no-such-route")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert sum(hits(fabric).values()) == 0


async def test_missing_or_wrong_key_is_401(fabric: Fabric):
    for client in (fabric.client(None), fabric.client("mrd_wrong")):
        for method, path in (("POST", "/v1/chat/completions"), ("GET", "/v1/models")):
            r = await client.request(method, path, json=CHAT)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["code"] == "invalid_api_key"
    assert sum(hits(fabric).values()) == 0


async def test_models_health_and_metrics(fabric: Fabric):
    r = await fabric.client(EU_KEY).get("/v1/models")
    assert r.status_code == 200
    assert r.json() == {"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "meridian"}]}
    assert (await fabric.client(LIMITED_KEY).get("/v1/models")).json()["data"] == []
    r = await fabric.client(None).get("/health")
    assert r.status_code == 200 and r.json()["routing_version"] == 1
    await fabric.client("mrd_wrong").post("/v1/chat/completions", json=CHAT)
    await fabric.client().post("/v1/chat/completions", json=CHAT)
    # /metrics names nodes and tenants: not for tenants, nor for anyone without a token.
    for client in (fabric.client(None), fabric.client()):
        r = await client.get("/metrics")
        assert r.status_code == 401 and "meridian_router" not in r.text
    r = await fabric.client(None).get("/metrics", headers=SCRAPE)
    assert metric(r.text, "meridian_router_routing_table_version") == 1
    # Answered by the router itself: no region, no node.
    assert metric(r.text, "meridian_router_requests_total", region="", node="", status="401",
                  reason="invalid_api_key") == 1
    assert metric(r.text, "meridian_router_requests_total",
                  region="aws:us-east-1", node="us-1", status="200", reason="") == 1
    assert metric(r.text, "meridian_router_request_duration_seconds_count",
                  region="aws:us-east-1") == 1
    assert metric(r.text, "meridian_router_overhead_seconds_count") == 1


async def test_unexpected_errors_are_a_clean_500(fabric: Fabric):
    class Exploding:
        name = "exploding-test"

        def order(self, candidates, ctx):
            raise RuntimeError("secret internals")

    register_policy("exploding-test", lambda _s: Exploding())
    app = create_app(router_settings(routing_policy="exploding-test"),
                     table_source=StaticTableSource(make_table(fabric.nodes())))
    async with running(app) as url:
        c = fabric.client()
        r = await c.post(url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "secret" not in r.text and "Traceback" not in r.text


# --- the upstream connection itself: keep-alive, stale connections, framing ---------------

ANSWER = (b'{"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny-llama", '
          b'"choices": [{"index": 0, "message": {"role": "assistant", "content": "raw"}, '
          b'"finish_reason": "stop"}]}')
OK = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
      + str(len(ANSWER)).encode() + b"\r\n\r\n" + ANSWER)


class RawNode:
    """A node speaking HTTP/1.1 by hand, so that a test decides what happens to the connection.

    `answer(nth)` gets the POST's number on its connection (from 0) and returns the bytes
    to send back, None to close the connection without answering, or b"" to never answer.
    The router's health probes (GET) are answered 404 and not counted.
    """

    def __init__(self, answer: Callable[[int], bytes | None], *, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.connections = 0  # that carried a POST
        self.paths: list[str] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        posts = itertools.count()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: (\d+)", head, re.IGNORECASE)
                await reader.readexactly(int(length.group(1)) if length else 0)
                method, path = head.decode("latin-1").split(" ")[:2]
                if method != "POST":
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                nth = next(posts)
                if nth == 0:
                    self.connections += 1
                self.paths.append(path)
                reply = self.answer(nth)
                if reply is None:
                    break
                if reply:
                    writer.write(reply)
                    await writer.drain()
                    if self.close_after:
                        break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def test_keep_alive_reuses_one_connection_and_a_node_path_prefix_is_kept(fabric: Fabric):
    node_side = RawNode(lambda _n: OK)
    async with node_side as url:
        fabric.set_nodes([node("us", url + "/serving/")])
        client = fabric.client()
        for _ in range(5):
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "raw"
    assert node_side.connections == 1
    assert node_side.paths == ["/serving/v1/chat/completions"] * 5


async def test_a_pooled_connection_the_node_dropped_is_retried_on_a_new_one(fabric: Fabric):
    # The node's keep-alive timeout strikes as the second request arrives: it closes the
    # connection without reading it. That is not a node failure, and nothing ran twice.
    node_side = RawNode(lambda nth: OK if nth == 0 else None)
    async with node_side as url:
        fabric.set_nodes([node("us", url), node("eu", fabric.node_urls["eu"])])
        client = fabric.client()
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.headers[HEADER_REGION] == "aws:us-east-1"
    assert node_side.connections == 2
    assert hits(fabric)["eu"] == 0
    text = (await client.get("/metrics", headers=SCRAPE)).text
    for reason in ("protocol", "closed"):
        assert metric(text, "meridian_router_upstream_failures_total",
                      region="aws:us-east-1", node="us-1", reason=reason) == 0


async def test_a_body_ended_by_closing_the_connection_is_passed_whole(fabric: Fabric):
    until_close = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + ANSWER
    node_side = RawNode(lambda _n: until_close, close_after=True)
    async with node_side as url:
        fabric.set_nodes([node("us", url)])
        client = fabric.client()
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and r.content == ANSWER
    assert node_side.connections == 2  # such a connection cannot be reused


async def test_garbage_instead_of_http_fails_over(fabric: Fabric):
    async with RawNode(lambda _n: b"SSH-2.0-OpenSSH_9.2\r\n\r\n") as url:
        fabric.set_nodes([node("us", url), node("eu", fabric.node_urls["eu"])])
        client = fabric.client()
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers[HEADER_REGION] == "gcp:europe-west4"
        text = (await client.get("/metrics", headers=SCRAPE)).text
    assert metric(text, "meridian_router_upstream_failures_total",
                  region="aws:us-east-1", node="us-1", reason="protocol") == 1


async def test_failover_stops_when_the_retry_budget_is_spent(fabric: Fabric):
    fabric.behaviours["us"].mode = "error500"
    app = create_app(router_settings(retry_budget_percent=0, min_retry_concurrency=0),
                     table_source=StaticTableSource(make_table(fabric.nodes())))
    async with running(app) as url:
        r = await fabric.client().post(url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_replica"
    assert hits(fabric) == {"us": 1, "eu": 0, "apac": 0}


async def test_failing_over_from_a_node_that_is_gone_does_not_need_the_retry_budget(fabric: Fabric):
    # A killed region: one node refuses connections, another drops the request unanswered.
    # The budget guards overloaded replicas; these are gone, so the request still fails over.
    dead = reserve_port()
    async with RawNode(lambda _n: None) as dropping:
        nodes = [node("us", url_of(dead)), node("us2", dropping, region="us"),
                 node("eu", fabric.node_urls["eu"])]
        app = create_app(router_settings(retry_budget_percent=0, min_retry_concurrency=0),
                         table_source=StaticTableSource(make_table(nodes)))
        async with running(app) as url:
            client = fabric.client()
            r = await client.post(url + "/v1/chat/completions", json=CHAT)
            text = (await client.get(url + "/metrics", headers=SCRAPE)).text
    dead.close()
    assert r.status_code == 200 and r.headers[HEADER_REGION] == "gcp:europe-west4"
    assert metric(text, "meridian_router_upstream_failures_total",
                  region="aws:us-east-1", node="us-1", reason="connect") == 1
    assert metric(text, "meridian_router_upstream_failures_total",
                  region="aws:us-east-1", node="us2-1", reason="closed") == 1


async def test_a_stream_that_does_not_start_within_the_read_timeout_fails_over(fabric: Fabric):
    async with RawNode(lambda _n: b"") as silent:  # takes the request, never answers
        nodes = [node("us", silent), node("eu", fabric.node_urls["eu"])]
        app = create_app(router_settings(read_timeout_s=0.3),
                         table_source=StaticTableSource(make_table(nodes)))
        async with running(app) as url:
            client = fabric.client()
            r = await client.post(url + "/v1/chat/completions", json=CHAT | {"stream": True})
            text = (await client.get(url + "/metrics", headers=SCRAPE)).text
    assert r.status_code == 200 and r.headers[HEADER_REGION] == "gcp:europe-west4"
    assert "eu0" in r.text
    assert metric(text, "meridian_router_upstream_failures_total",
                  region="aws:us-east-1", node="us-1", reason="timeout") == 1


async def test_journal_records_every_attempt_under_the_idempotency_key(tmp_path):
    """A drill's checker joins these with the nodes' journals: each attempt, in order."""
    servers = ServerGroup()
    journal = tmp_path / "router.jsonl"
    try:
        behaviours = {name: NodeBehaviour(name) for name in ("us", "eu", "apac")}
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        source = StaticTableSource(make_table([node(n, u) for n, u in urls.items()]))
        app = create_app(router_settings(request_journal_path=journal), table_source=source)
        f = Fabric(await servers.start(app), behaviours, urls, source, app)
        client = f.client()
        behaviours["us"].mode = "error500"
        r = await client.post("/v1/chat/completions", json=CHAT, headers={"idempotency-key": "order-7"})
        assert r.status_code == 200 and r.headers[HEADER_REQUEST_ID] == "order-7"
        # The key reaches the node as its request id, so the node's journal uses it too.
        assert behaviours["eu"].request_ids == ["order-7"]
        await client.post("/v1/chat/completions", json=CHAT, headers={HEADER_REQUEST_ID: "plain-id"})
        await client.aclose()
    finally:
        await servers.stop()
    assert read_records(journal) == [
        Routed(key="order-7", node="us-1", region="aws:us-east-1", attempt=1),
        Routed(key="order-7", node="eu-1", region="gcp:europe-west4", attempt=2),
        Routed(key="plain-id", node="eu-1", region="gcp:europe-west4", attempt=1),
    ]


async def test_a_node_failing_health_checks_ends_requests_waiting_on_it_without_retrying(fabric: Fabric):
    """A frozen or partitioned node holds requests open; its health-check ejection ends them
    with a 504 at once instead of at the request deadline, and never runs them elsewhere."""
    us = fabric.behaviours["us"]
    us.mode = "hang"
    client = fabric.client()
    try:
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
        await asyncio.wait_for(us.received.wait(), 5)
        # The prober's verdict after its failed probes (probe.py decides when).
        fabric.app.state.router.fleet.record_failure("us-1", FailureKind.PROBE)
        r = await asyncio.wait_for(pending, 2)
        assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
        assert "not retried" in r.json()["error"]["message"]
        assert hits(fabric) == {"us": 1, "eu": 0, "apac": 0}
        # New requests go to the next region meanwhile.
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200 and r.headers[HEADER_REGION] == "gcp:europe-west4"
    finally:
        us.release.set()


async def test_a_request_still_connecting_when_its_node_is_ejected_goes_to_the_next_replica(fabric: Fabric):
    """Ejected by its health checks while the router still connects to it (here: a listener
    whose accept queue is full, so the SYN goes unanswered), the node has had nothing of the
    request: it runs on the next replica instead of ending in a 504."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        queued = [socket.create_connection(full.getsockname(), timeout=1)]  # listen(0): the queue is full
        stuck = f"http://127.0.0.1:{full.getsockname()[1]}"
        fabric.source.set(make_table([node("us", stuck), node("eu", fabric.node_urls["eu"])], version=2))
        client = fabric.client()
        try:
            pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
            router = fabric.app.state.router
            await eventually(lambda: "us-1" in router.forwarder._waiting)
            router.fleet.record_failure("us-1", FailureKind.PROBE)
            r = await asyncio.wait_for(pending, 5)
            assert r.status_code == 200 and r.headers[HEADER_REGION] == "gcp:europe-west4"
        finally:
            for conn in queued:
                conn.close()


async def test_a_failed_request_or_a_5xx_does_not_abandon_other_requests_on_the_node(fabric: Fabric):
    us = fabric.behaviours["us"]
    us.mode = "hang"
    client = fabric.client()
    try:
        pending = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, timeout=0.5))
        await asyncio.wait_for(us.received.wait(), 5)
        # Passive errors (5xx, timeouts) say less about a node than its health checks do.
        fabric.app.state.router.fleet.record_failure("us-1", FailureKind.ERROR)
        with pytest.raises(httpx.ReadTimeout):
            await pending
    finally:
        us.release.set()


async def test_a_client_gone_mid_body_is_a_quiet_499(fabric: Fabric, caplog: pytest.LogCaptureFixture):
    """Issue 18, finding 8: each such client cost a 500 and ~100 lines of traceback."""
    host, port = fabric.router_url.removeprefix("http://").split(":")
    for _ in range(5):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 1000\r\n"
                     b"authorization: Bearer " + GLOBAL_KEY.encode() + b"\r\n\r\n{\"model\": \"ti")
        await writer.drain()
        writer.close()
    metrics = fabric.app.state.router.metrics

    def answered_499() -> float:
        return metric(metrics.render().decode(), "meridian_router_requests_total", region="", node="", status="499",
                      reason="client_closed_request")

    await eventually(lambda: answered_499() == 5)
    text = (await fabric.client(None).get("/metrics", headers=SCRAPE)).text
    assert metric(text, "meridian_router_requests_total", region="", node="", status="499",
                  reason="client_closed_request") == 5
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert sum(hits(fabric).values()) == 0
