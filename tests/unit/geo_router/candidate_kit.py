"""Candidates and a routing context for policy tests, without a router."""

from __future__ import annotations

from dataclasses import replace

from router_harness import GLOBAL_KEY, MODEL, REGIONS, make_table, node

from geo_router.ingress.auth import authenticate
from geo_router.selection.candidates import Candidate, RoutingContext
from geo_router.state.table import LoadedTable

TABLE = LoadedTable.build(make_table([]))
CTX = RoutingContext(tenant=authenticate(TABLE, f"Bearer {GLOBAL_KEY}"), model=MODEL, stream=False,
                     client_location=None, request_id="r")


def cand(node_id: str, region: str = "us", rtt_ms: float = 10.0, **signals: object) -> Candidate:
    n = node(region, f"http://{node_id}:1").model_copy(update={"node_id": node_id})
    return replace(Candidate(node=n, region=REGIONS[region], rtt_ms=rtt_ms, in_flight=0), **signals)
