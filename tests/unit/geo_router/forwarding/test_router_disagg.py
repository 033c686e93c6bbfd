"""A real router in front of stand-in prefill and decode workers: the P/D hand-off, its
failure cases, co-located fallback, residency, and the blocks released when nobody pulls them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from pd_nodes import PDBehaviour, pd_app, pd_node
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    REGIONS,
    SCRAPE,
    ServerGroup,
    eventually,
    make_table,
    metric,
    reserve_port,
    router_settings,
    url_of,
)

from geo_router import create_app
from geo_router.state.table import StaticTableSource
from meridian.clock import ManualClock
from meridian.contracts import HEADER_NODE, NodeRole, RoutingNode

US = REGIONS["us"].name
EU = REGIONS["eu"].name
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
LEASE_S = 30.0


@dataclass
class PDFabric:
    router_url: str
    workers: dict[str, PDBehaviour]
    urls: dict[str, str]
    source: StaticTableSource
    clock: ManualClock
    clients: list[httpx.AsyncClient] = field(default_factory=list)

    def client(self, key: str = GLOBAL_KEY) -> httpx.AsyncClient:
        c = httpx.AsyncClient(base_url=self.router_url, headers={"authorization": f"Bearer {key}"}, timeout=10)
        self.clients.append(c)
        return c

    def serve(self, *nodes: RoutingNode) -> None:
        self.source.set(make_table(list(nodes), version=self.source.current().version + 1))

    def node(self, name: str, role: NodeRole, region: str = US) -> RoutingNode:
        return pd_node(f"{name}-1", self.urls[name], region, role, lease_s=LEASE_S)

    def pd(self) -> list[RoutingNode]:
        """Two prefill and two decode workers in us."""
        return [self.node("p1", NodeRole.PREFILL), self.node("p2", NodeRole.PREFILL),
                self.node("d1", NodeRole.DECODE), self.node("d2", NodeRole.DECODE)]


@pytest.fixture
async def fabric() -> AsyncIterator[PDFabric]:
    servers = ServerGroup()
    workers = {name: PDBehaviour(name) for name in ("p1", "p2", "d1", "d2", "c1")}
    clock = ManualClock()
    try:
        urls: dict[str, str] = {}
        for name, b in workers.items():
            sock = reserve_port()
            urls[name] = await servers.start(pd_app(b, port=sock.getsockname()[1]), sock)
        f = PDFabric("", workers, urls, StaticTableSource(make_table([])), clock)
        f.serve(*f.pd())
        app = create_app(router_settings(probe_enabled=False, pd_min_prompt_tokens=0), table_source=f.source,
                         clock=clock)
        f.router_url = await servers.start(app)
        yield f
        for c in f.clients:
            await c.aclose()
    finally:
        for b in workers.values():
            b.release.set()
        await servers.stop()


def prefills(f: PDFabric) -> list[dict]:
    return f.workers["p1"].bodies + f.workers["p2"].bodies


async def test_a_request_is_prefilled_on_one_pool_and_decoded_on_the_other(fabric: PDFabric):
    client = fabric.client()
    r = await client.post("/v1/chat/completions", json=CHAT | {"stream_options": {"include_usage": True},
                                                                "logprobs": True})
    assert r.status_code == 200, r.text
    assert r.headers[HEADER_NODE] in ("d1-1", "d2-1")
    [prefill] = prefills(fabric)
    # The prefill worker gets the prompt for one token, whole, asking for a remote decode.
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert "stream_options" not in prefill and "logprobs" not in prefill
    assert prefill["messages"] == CHAT["messages"] and prefill["cache_salt"]
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    # The decode worker gets the client's request as it was, with the hand-off.
    decoder = fabric.workers[r.headers[HEADER_NODE].removesuffix("-1")]
    [decode] = decoder.bodies
    assert decode["max_tokens"] == 8 and decode["logprobs"] is True
    assert decode["cache_salt"] == prefill["cache_salt"]
    handle = decode["kv_transfer_params"]["remote_request_id"]
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True
    assert r.json()["choices"][0]["message"]["content"].startswith(f"decoded {handle}")

    # Streamed, and completions, the same way.
    async with client.stream("POST", "/v1/chat/completions", json=CHAT | {"stream": True}) as s:
        text = "".join([line async for line in s.aiter_lines()])
    assert "decoded" in text and len(prefills(fabric)) == 2
    r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": 5})
    assert r.status_code == 200 and "decoded" in r.json()["choices"][0]["message"]["content"]
    assert prefills(fabric)[-1]["prompt"] == "hello" and prefills(fabric)[-1]["max_tokens"] == 1

    page = (await client.get("/metrics", headers=SCRAPE)).text
    assert metric(page, "meridian_router_pd_requests_total", region=US, how="disaggregated") == 3


async def test_a_failed_prefill_worker_is_retried_then_the_decode_worker_prefills(fabric: PDFabric):
    client = fabric.client()
    fabric.workers["p1"].mode = "error500"
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and "decoded p2-" in r.text
    # Both prefill workers down (p1 is ejected now; p2 answers 500): the decode worker
    # prefills the prompt itself, and the request is served all the same.
    fabric.workers["p2"].mode = "error500"
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and "prefilled here" in r.text
    decoded = fabric.workers["d1"].bodies + fabric.workers["d2"].bodies
    assert "kv_transfer_params" not in decoded[-1]
    page = (await client.get("/metrics", headers=SCRAPE)).text
    assert metric(page, "meridian_router_pd_requests_total", region=US, how="prefill_failed") == 1
    assert metric(page, "meridian_router_pd_prefills_total", region=US, node="p1-1", outcome="failed") == 1


async def test_a_prefill_answer_without_a_handoff_counts_as_a_failed_prefill(fabric: PDFabric):
    fabric.workers["p1"].mode = fabric.workers["p2"].mode = "no_params"
    r = await fabric.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and "prefilled here" in r.text
    assert len(prefills(fabric)) == 2


async def test_a_request_the_prefill_worker_refuses_is_the_clients_error(fabric: PDFabric):
    fabric.workers["p1"].mode = fabric.workers["p2"].mode = "error400"
    r = await fabric.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # The request's own fault: one prefill worker asked, no decode worker bothered.
    assert len(prefills(fabric)) == 1
    assert fabric.workers["d1"].hits + fabric.workers["d2"].hits == 0


@pytest.mark.parametrize("mode", ["error500", "die_early"])
async def test_a_decode_worker_failing_before_its_first_token_gets_a_fresh_prefill(fabric: PDFabric, mode: str):
    fabric.workers["d1"].mode = mode
    client = fabric.client()
    # The policy may try d2 first; d1, once tried, fails and is ejected.
    for _ in range(10):
        r = await client.post("/v1/chat/completions", json=CHAT | {"stream": mode == "die_early"})
        assert r.status_code == 200 and r.headers[HEADER_NODE] == "d2-1"
        if fabric.workers["d1"].hits:
            break
    [failed] = fabric.workers["d1"].bodies
    old = failed["kv_transfer_params"]["remote_request_id"]
    new = fabric.workers["d2"].bodies[-1]["kv_transfer_params"]["remote_request_id"]
    # d1 took the request and may have pulled the blocks: d2 gets blocks of a new prefill,
    # and the ones d1 was handed are released.
    assert old != new and new in r.text
    await eventually(lambda: old in fabric.workers["p1"].released + fabric.workers["p2"].released)


async def test_a_decode_worker_that_never_took_the_request_passes_its_handoff_on(fabric: PDFabric):
    # d1 is in the table but nothing listens: its hand-off is still good for d2.
    dead = reserve_port()
    dead_node = pd_node("d0-1", url_of(dead), US, NodeRole.DECODE, lease_s=LEASE_S)
    fabric.serve(*fabric.pd()[:2], dead_node, fabric.node("d2", NodeRole.DECODE))
    r = await fabric.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and r.headers[HEADER_NODE] == "d2-1"
    assert len(prefills(fabric)) == 1
    dead.close()


async def test_pools_fall_back_to_colocated_serving_when_one_is_empty(fabric: PDFabric):
    client = fabric.client()
    fabric.serve(fabric.node("p1", NodeRole.PREFILL))  # no decode pool: the prefill worker serves
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and "prefilled here on p1" in r.text
    assert "kv_transfer_params" not in fabric.workers["p1"].bodies[0]
    fabric.serve(fabric.node("d1", NodeRole.DECODE))  # no prefill pool: the decode worker does both
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and "prefilled here on d1" in r.text
    page = (await client.get("/metrics", headers=SCRAPE)).text
    assert metric(page, "meridian_router_pd_requests_total", region=US, how="disaggregated") == 0


async def test_colocated_replicas_beside_a_pd_pool_serve_as_before(fabric: PDFabric):
    fabric.serve(fabric.node("c1", NodeRole.BOTH))
    r = await fabric.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and "prefilled here on c1" in r.text
    assert prefills(fabric) == []


async def test_clients_may_not_send_kv_transfer_params(fabric: PDFabric):
    r = await fabric.client().post("/v1/chat/completions", json=CHAT | {"kv_transfer_params": {
        "do_remote_prefill": True, "remote_host": "10.0.0.9", "remote_port": 22, "remote_request_id": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    assert sum(b.hits for b in fabric.workers.values()) == 0


async def test_kv_never_leaves_the_region(fabric: PDFabric):
    # The eu tenant's decode worker is in eu; the only prefill pool is in us. Its prompt is
    # never prefilled in us: the eu decode worker prefills it itself.
    fabric.serve(fabric.node("p1", NodeRole.PREFILL), fabric.node("d1", NodeRole.DECODE, region=EU))
    r = await fabric.client(EU_KEY).post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and "prefilled here on d1" in r.text
    assert prefills(fabric) == []
    # A global tenant nearest us may still be decoded in eu only with an eu prefill worker.
    r = await fabric.client().post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and prefills(fabric) == []


async def test_a_request_abandoned_during_decode_releases_its_blocks(fabric: PDFabric):
    fabric.serve(*fabric.pd()[:2], fabric.node("d1", NodeRole.DECODE))
    fabric.workers["d1"].mode = "hang"
    client = fabric.client()
    task = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT))
    await asyncio.wait_for(fabric.workers["d1"].received.wait(), 5)
    handle = fabric.workers["d1"].bodies[0]["kv_transfer_params"]["remote_request_id"]
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    released = lambda: handle in fabric.workers["p1"].released + fabric.workers["p2"].released  # noqa: E731
    await eventually(released)


async def test_a_short_prompt_is_served_whole_by_the_decode_worker(fabric: PDFabric):
    # With the default threshold, a prompt this short costs a decode worker less to prefill
    # than the hop and the pull would: no prefill hop.
    servers = ServerGroup()
    try:
        app = create_app(router_settings(probe_enabled=False), table_source=fabric.source, clock=fabric.clock)
        url = await servers.start(app)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {GLOBAL_KEY}"}) as c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 200 and "prefilled here" in r.text
            long = CHAT | {"messages": [{"role": "user", "content": "many words " * 200}]}
            r = await c.post("/v1/chat/completions", json=long)
            assert r.status_code == 200 and "decoded" in r.text
            page = (await c.get("/metrics", headers=SCRAPE)).text
    finally:
        await servers.stop()
    assert len(prefills(fabric)) == 1
    assert metric(page, "meridian_router_pd_requests_total", region=US, how="short_prompt") == 1
