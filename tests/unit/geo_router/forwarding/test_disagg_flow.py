"""The P/D split (pure) and one request's hand-offs across decode attempts, with a stand-in
prefiller on a ManualClock: reuse, re-prefill after a lease, and release."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from router_harness import MODEL, REGIONS

from geo_router.forwarding.disagg.bodies import decode_body, prefill_body
from geo_router.forwarding.disagg.flow import PDRequest
from geo_router.forwarding.disagg.handoff import Handoff, Refused
from geo_router.forwarding.disagg.pools import plan
from geo_router.forwarding.upstream import FailureReason
from geo_router.observability.metrics import RouterMetrics
from geo_router.selection.candidates import Candidate
from meridian.clock import ManualClock
from meridian.contracts import KVConnector, KVTransferInfo, NodeRole, NodeStatus, RoutingNode

US, EU = REGIONS["us"], REGIONS["eu"]


def cand(name: str, role: NodeRole, region=US, *, running: int = 0, kv: float = 0.0, hit: float = 0.0,
         connector: KVConnector = KVConnector.MERIDIAN, lease_s: float = 30.0) -> Candidate:
    transfer = None if role is NodeRole.BOTH else KVTransferInfo(connector=connector, endpoint="h:1",
                                                                 lease_s=lease_s)
    n = RoutingNode(node_id=name, region=region.name, url="http://h:1", models=[MODEL], status=NodeStatus.READY,
                    role=role, kv_transfer=transfer)
    return Candidate(n, region, rtt_ms=1.0, in_flight=0, running=running, kv_usage=kv, prefix_hit=hit)


def names(cs: list[Candidate]) -> list[str]:
    return [c.node.node_id for c in cs]


def test_decode_workers_go_by_load_and_kv_headroom_prefill_workers_by_affinity():
    p_cold, p_warm = cand("p-cold", NodeRole.PREFILL), cand("p-warm", NodeRole.PREFILL, hit=0.8)
    d_busy, d_full, d_free = (cand("d-busy", NodeRole.DECODE, running=3), cand("d-full", NodeRole.DECODE, kv=0.95),
                              cand("d-free", NodeRole.DECODE, running=1))
    eu_decode = cand("d-eu", NodeRole.DECODE, EU)
    p = plan([d_busy, p_cold, eu_decode, d_full, p_warm, d_free])
    assert names(p.decode) == ["d-free", "d-busy", "d-full", "d-eu"]  # us first, as the policy said
    assert names(p.prefill_pool(d_free)) == ["p-warm", "p-cold"]
    assert p.prefill_pool(eu_decode) == []  # no prefill worker in eu: it prefills itself
    assert p.disaggregated


def test_a_prefill_pool_serves_only_decode_workers_of_its_connector():
    nixl_decode = cand("d", NodeRole.DECODE, connector=KVConnector.NIXL)
    p = plan([cand("p", NodeRole.PREFILL), nixl_decode])
    assert p.prefill_pool(nixl_decode) == [] and not p.disaggregated


def test_an_empty_pool_means_colocated():
    only_prefill = plan([cand("p1", NodeRole.PREFILL), cand("p2", NodeRole.PREFILL)])
    assert names(only_prefill.decode) == ["p1", "p2"] and not only_prefill.disaggregated
    only_decode = plan([cand("d1", NodeRole.DECODE)])
    assert names(only_decode.decode) == ["d1"] and not only_decode.prefill


def test_prefill_bodies():
    chat = {"model": MODEL, "messages": [], "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "top_logprobs": 2, "logprobs": True, "seed": 3}
    body = msgspec.json.decode(prefill_body("/v1/chat/completions", chat))
    assert body["max_tokens"] == body["max_completion_tokens"] == 1 and body["stream"] is False
    assert body["seed"] == 3 and not {"stream_options", "top_logprobs", "logprobs"} & body.keys()
    responses = msgspec.json.decode(prefill_body("/v1/responses", {"model": MODEL, "input": "x", "store": True}))
    assert responses["max_output_tokens"] == 1 and responses["store"] is False
    assert prefill_body("/v1/chat/completions", {"model": MODEL, "n": 2}) is None
    assert prefill_body("/v1/messages", {"model": MODEL}) is None
    assert prefill_body("/v1/responses", {"model": MODEL, "previous_response_id": "resp_1"}) is None
    decoded = msgspec.json.decode(decode_body(b'{"model": "m"}', {"do_remote_prefill": True}))
    assert decoded == {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}}


@dataclass
class StandInPrefiller:
    """Hands out numbered hand-offs at the clock's time; records releases."""

    clock: ManualClock
    answers: list[Any] = field(default_factory=list)
    made: int = 0
    released: list[str] = field(default_factory=list)

    async def prefill(self, route, body, pool, request_id, deadline, trace_headers=""):
        if self.answers:
            return self.answers.pop(0)
        self.made += 1
        return Handoff({"do_remote_prefill": True, "remote_request_id": f"h{self.made}"}, pool[0],
                       self.clock.monotonic(), pool[0].node.kv_transfer.lease_s)

    def release(self, handoff: Handoff) -> None:
        self.released.append(handoff.params["remote_request_id"])


@pytest.fixture
def flow():
    clock = ManualClock()
    prefiller = StandInPrefiller(clock)
    p = plan([cand("p", NodeRole.PREFILL), cand("d1", NodeRole.DECODE), cand("d2", NodeRole.DECODE)])
    req = PDRequest(p, prefiller, RouterMetrics(lambda: 1.0), clock, "/v1/chat/completions", b"{}", "r1")
    return req, prefiller, clock, p


def handle(body: bytes) -> str | None:
    return (msgspec.json.decode(body).get("kv_transfer_params") or {}).get("remote_request_id")


async def test_a_handoff_passes_to_the_next_worker_only_if_the_last_never_took_it(flow):
    req, prefiller, clock, p = flow
    d1, d2 = p.decode
    assert handle(await req.body_for(d1, b'{"model":"m"}', 0)) == "h1"
    req.attempt_failed(d1, FailureReason.CONNECT)  # never took it: d2 gets h1
    assert handle(await req.body_for(d2, b'{"model":"m"}', 0)) == "h1"
    req.attempt_failed(d2, FailureReason.SERVER_ERROR)  # took it, may have pulled: released, new prefill
    assert prefiller.released == ["h1"]
    assert handle(await req.body_for(d1, b'{"model":"m"}', 0)) == "h2"
    req.ended(served=True)
    assert prefiller.released == ["h1"]  # h2 was pulled by the worker that served


async def test_a_handoff_past_its_lease_is_prefilled_again(flow):
    req, prefiller, clock, p = flow
    d1, d2 = p.decode
    assert handle(await req.body_for(d1, b'{"model":"m"}', 0)) == "h1"
    req.attempt_failed(d1, FailureReason.CONNECT)
    clock.advance(30.0)  # the prefill worker has let h1's blocks go
    assert handle(await req.body_for(d2, b'{"model":"m"}', 0)) == "h2"


async def test_what_no_decode_worker_took_is_released_when_the_request_ends(flow):
    req, prefiller, clock, p = flow
    d1, _ = p.decode
    await req.body_for(d1, b'{"model":"m"}', 0)
    req.ended(served=False)  # e.g. the client left while d1 was deciding
    assert prefiller.released == ["h1"]


async def test_a_prefill_refusal_or_failure_decides_the_attempt(flow):
    req, prefiller, clock, p = flow
    d1, _ = p.decode
    prefiller.answers = [Refused(400, b'{"error":{}}', {"content-type": "application/json"}), None]
    refused = await req.body_for(d1, b'{"model":"m"}', 0)
    assert refused.status_code == 400
    assert await req.body_for(d1, b'{"model":"m"}', 0) == b'{"model":"m"}'  # prefills itself
