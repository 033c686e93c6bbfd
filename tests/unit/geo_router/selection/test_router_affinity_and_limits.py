"""The router app end to end over real HTTP: prefix affinity, LoRA adapters, rate limits, metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import httpx
import pytest
from router_harness import (
    GLOBAL_KEY,
    MODEL,
    SCRAPE,
    STREAM_USAGE,
    NodeBehaviour,
    ServerGroup,
    make_table,
    metric,
    node,
    node_app,
    router_settings,
    tenants,
)

from geo_router import create_app
from geo_router.state.table import StaticTableSource
from meridian.contracts import HEADER_NODE, RoutingTable
from meridian.security import hash_api_key

LIMITED_RPM_KEY = "mrd_rpm-limited-key"
TPM_KEY = "mrd_tpm-limited-key"
TPM = 20_000


def _table() -> RoutingTable:
    us = [node("us", f"http://placeholder-{i}:1").model_copy(update={"node_id": f"us-{i}"}) for i in range(3)]
    table = make_table(us)
    extra = tenants()[0].model_copy(update={
        "key_hash": hash_api_key(LIMITED_RPM_KEY), "key_prefix": LIMITED_RPM_KEY[:10], "tenant": "small-co",
        "requests_per_minute": 2,
    })
    tpm = tenants()[0].model_copy(update={
        "key_hash": hash_api_key(TPM_KEY), "key_prefix": TPM_KEY[:10], "tenant": "token-co",
        "tokens_per_minute": TPM,
    })
    return table.model_copy(update={"tenants": [*table.tenants, extra, tpm]})


class ThreeNodes:
    def __init__(self, policy: str) -> None:
        self.policy = policy
        self.servers = ServerGroup()
        self.behaviours = {f"us-{i}": NodeBehaviour(f"us-{i}") for i in range(3)}
        self.client: httpx.AsyncClient | None = None
        self.app = None

    async def __aenter__(self) -> ThreeNodes:
        urls = {n: await self.servers.start(node_app(b)) for n, b in self.behaviours.items()}
        table = _table()
        nodes = [n.model_copy(update={"url": urls[n.node_id]}) for n in table.nodes]
        source = StaticTableSource(table.model_copy(update={"nodes": nodes}))
        self.app = create_app(router_settings(routing_policy=self.policy, rate_limit_burst_s=60.0),
                              table_source=source)
        url = await self.servers.start(self.app)
        self.client = httpx.AsyncClient(base_url=url, timeout=10,
                                        headers={"authorization": f"Bearer {GLOBAL_KEY}"})
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.client is not None
        await self.client.aclose()
        await self.servers.stop()

    async def chat(self, messages: list[dict[str, str]], model: str = MODEL, key: str = GLOBAL_KEY) -> httpx.Response:
        assert self.client is not None
        return await self.client.post("/v1/chat/completions", json={"model": model, "messages": messages},
                                      headers={"authorization": f"Bearer {key}"})


@pytest.fixture
async def affinity() -> AsyncIterator[ThreeNodes]:
    async with ThreeNodes("affinity") as f:
        yield f


def conversation(n: int, turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "You are a careful assistant. " * 3}]
    for t in range(turns):
        msgs.append({"role": "user", "content": f"conversation {n} turn {t}: " + "tell me more " * 30})
        msgs.append({"role": "assistant", "content": f"answer {t} " * 20})
    return msgs[:-1]


async def test_a_growing_conversation_stays_on_the_replica_that_holds_its_prefix(affinity: ThreeNodes):
    # Without events from these nodes, the router's own routing history is the index.
    served: dict[int, Counter[str]] = {n: Counter() for n in range(3)}
    for turn in range(1, 5):
        for conv in range(3):
            r = await affinity.chat(conversation(conv, turn))
            assert r.status_code == 200
            served[conv][r.headers[HEADER_NODE]] += 1
    for conv, nodes in served.items():
        assert max(nodes.values()) >= 3, f"conversation {conv} wandered between replicas: {nodes}"
    # ... and the conversations did not pile onto one replica.
    per_node = sum(served.values(), Counter())
    assert len(per_node) >= 2 and max(per_node.values()) <= 8, per_node


async def test_round_robin_scatters_the_same_conversation():
    async with ThreeNodes("round-robin") as rr:
        nodes = {(await rr.chat(conversation(0, t))).headers[HEADER_NODE] for t in range(1, 4)}
        assert len(nodes) == 3


async def test_a_lora_adapter_is_routed_to_its_base_models_replicas_and_sticks(affinity: ThreeNodes):
    first = await affinity.chat([{"role": "user", "content": "q1"}], model=f"{MODEL}:sql-lora")
    assert first.status_code == 200
    # Different prompts, same adapter: the replica that has it loaded is preferred.
    for i in range(2):
        r = await affinity.chat([{"role": "user", "content": f"other question {i}"}], model=f"{MODEL}:sql-lora")
        assert r.headers[HEADER_NODE] == first.headers[HEADER_NODE]
    unknown_base = await affinity.chat([{"role": "user", "content": "q"}], model="nope:sql-lora")
    assert unknown_base.status_code == 404
    assert unknown_base.json()["error"]["code"] == "model_not_found"


async def test_a_tenant_over_its_request_rate_gets_openai_429_with_retry_after(affinity: ThreeNodes):
    msgs = [{"role": "user", "content": "hi"}]
    ok = [await affinity.chat(msgs, key=LIMITED_RPM_KEY) for _ in range(2)]
    assert all(r.status_code == 200 for r in ok)
    assert ok[1].headers["x-ratelimit-limit-requests"] == "2"
    assert ok[1].headers["x-ratelimit-remaining-requests"] == "0"
    refused = await affinity.chat(msgs, key=LIMITED_RPM_KEY)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert affinity.client is not None
    text = (await affinity.client.get("/metrics", headers=SCRAPE)).text
    assert metric(text, "meridian_router_rate_limited_total", tenant="small-co", limit="requests") == 1
    hits_before = sum(b.hits for b in affinity.behaviours.values())
    # Other tenants are not affected, and the refused request never reached a node.
    assert (await affinity.chat(msgs)).status_code == 200
    assert sum(b.hits for b in affinity.behaviours.values()) == hits_before + 1


@pytest.mark.parametrize("include_usage", [False, True])
async def test_a_stream_settles_its_token_charge_when_it_ends(affinity: ThreeNodes, include_usage: bool):
    # Charged up front for its whole max_tokens budget; once the stream is over, only for
    # what it used: the usage chunk when asked for, else the prompt plus one token a chunk.
    assert affinity.client is not None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000,
            "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    auth = {"authorization": f"Bearer {TPM_KEY}"}
    r = await affinity.client.post("/v1/chat/completions", json=body, headers=auth)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < TPM - 5000
    nxt = await affinity.client.post("/v1/chat/completions", headers=auth,
                                     json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 1})
    used_by_stream = STREAM_USAGE["total_tokens"] if include_usage else 1 + 3  # "hi" ~ 1 token, 3 chunks
    # The bucket refills TPM/60 a second, so compare within a few hundred tokens; unsettled,
    # the stream would still hold its 5000.
    remaining = int(nxt.headers["x-ratelimit-remaining-tokens"])
    assert abs(remaining - (TPM - used_by_stream)) < 400


async def test_metrics_show_ttfb_and_predicted_cache_hits_per_node(affinity: ThreeNodes):
    for turn in range(1, 4):
        assert (await affinity.chat(conversation(7, turn))).status_code == 200
    assert affinity.client is not None
    text = (await affinity.client.get("/metrics", headers=SCRAPE)).text
    node_id = (await affinity.chat(conversation(7, 4))).headers[HEADER_NODE]
    text = (await affinity.client.get("/metrics", headers=SCRAPE)).text
    assert metric(text, "meridian_router_time_to_first_byte_seconds_count", region="aws:us-east-1",
                  node=node_id) >= 1
    assert metric(text, "meridian_router_predicted_cache_hit_tokens_total", region="aws:us-east-1",
                  node=node_id) > 0
