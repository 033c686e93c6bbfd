"""One real node behind a router twice over: through a fault proxy, and directly.

The routing table names the node as `near` (in the clients' region, reached through a
chaos FaultProxy) and as `far` (another region, reached directly), for a global tenant. A
stream starts on `near`; resetting the proxy (a killed node: RST) or blackholing it (a
frozen one) breaks it mid-generation, and the router must resume it on `far`, which is
the same engine with the same weights: with greedy decoding, the client's stream must be
exactly what an unbroken run gives. One engine process serves both names, so the test
works for vLLM, whose start costs ~50 s here, as well as for the torch engine.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
from router_harness import REGIONS, ServerGroup, router_settings, serve_router
from tenant_fabric import MODEL, Tenant, node_settings

from chaos.faults.tcp_proxy import FaultProxy, running_proxy
from data_plane.model.make_tiny import make_tiny_checkpoint
from data_plane.server.app import create_app as create_node_app
from geo_router import create_app as create_router_app
from geo_router.state.table import StaticTableSource
from meridian.contracts import NodeStatus, RoutingNode, RoutingTable

PACE_BYTES_PER_S = 12_000
CAROL = Tenant("carol", "sk-carol-0123456789abcdef", zone="global")


@dataclass
class MigrationRig:
    router_url: str
    proxy: FaultProxy
    journal: Any
    grpc_port: int | None = None  # the router's gRPC listener, when the rig asked for one

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.router_url, timeout=180,
                                 headers={"authorization": f"Bearer {CAROL.key}"})


@contextlib.asynccontextmanager
async def migration_rig(node_url: str, journal: Any, engine: str = "torch", tool_call_parser: str | None = None,
                        **router: Any) -> AsyncIterator[MigrationRig]:
    """`tool_call_parser`: what both names of the node advertise (RoutingNode.tool_call_parser);
    the router resumes tool-call streams only between nodes that advertise "pythonic"."""
    parts = urlsplit(node_url)
    async with running_proxy(parts.hostname or "127.0.0.1", parts.port or 80) as proxy:
        near_url = f"http://127.0.0.1:{proxy.port}"
        table = RoutingTable(
            version=1, generated_at=datetime.now(UTC), regions=list(REGIONS.values()), deployments=[],
            tenants=[CAROL.entry()],
            nodes=[RoutingNode(node_id="near", region=REGIONS["us"].name, url=near_url, models=[MODEL],
                               status=NodeStatus.READY, engine=engine, tool_call_parser=tool_call_parser),
                   RoutingNode(node_id="far", region=REGIONS["eu"].name, url=node_url, models=[MODEL],
                               status=NodeStatus.READY, engine=engine, tool_call_parser=tool_call_parser)])
        settings = router_settings(**{"probe_enabled": False, "read_timeout_s": 120.0, "request_timeout_s": 180.0,
                                      "max_request_bytes": 1_000_000, "request_journal_path": journal,
                                      "default_client_location": REGIONS["us"].name,
                                      # A broken stream must not eject `near` for the next test.
                                      "consecutive_failures_to_eject": 1000, **router})
        servers = ServerGroup()
        try:
            app = create_router_app(settings, table_source=StaticTableSource(table))
            url = await serve_router(servers, app, settings)
            listener = app.state.router.grpc
            yield MigrationRig(url, proxy, journal, listener.port if listener is not None else None)
        finally:
            await servers.stop()


@contextlib.asynccontextmanager
async def torch_rig(root: Path, **router: Any) -> AsyncIterator[MigrationRig]:
    """A migration rig around one real torch node serving the tiny checkpoint (made in `root`)."""
    checkpoint = make_tiny_checkpoint(root / MODEL, seed=0)
    servers = ServerGroup()
    try:
        node = create_node_app(node_settings(checkpoint, max_tokens_limit=128))
        node_url = await servers.start(node)
        await node.state.runtime.wait_ready()
        async with migration_rig(node_url, root / "router.jsonl", **router) as rig:
            yield rig
    finally:
        await servers.stop()


@dataclass
class Streamed:
    events: list[dict[str, Any]] = field(default_factory=list)
    error: dict[str, Any] | None = None
    done: bool = False
    request_id: str = ""  # the router's x-request-id

    @property
    def text(self) -> str:
        return "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                       for e in self.events for c in e.get("choices", []))

    @property
    def token_ids(self) -> list[int]:
        return [t for e in self.events for c in e.get("choices", []) for t in c.get("token_ids") or []]

    @property
    def trailer(self) -> dict[str, Any] | None:
        return self.events[-1].get("meridian") if self.events else None


async def stream(rig: MigrationRig, route: str, body: dict[str, Any], *, break_after: int | None = None,
                 fault: str = "reset") -> Streamed:
    """Stream `body`; after `break_after` content events, break the `near` path (`fault`:
    reset or blackhole). The proxy is healed before returning."""
    out = Streamed()
    seen = 0
    if break_after is not None:
        # Pace the node's events (a tiny model writes a whole answer in milliseconds), so the
        # break lands mid-generation, not after the node has sent everything.
        rig.proxy.set_bandwidth(PACE_BYTES_PER_S, "downstream")
    try:
        async with rig.client() as client, client.stream("POST", route, json=body) as r:
            assert r.status_code == 200, await r.aread()
            out.request_id = r.headers.get("x-request-id", "")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.error = event["error"]
                    continue
                out.events.append(event)
                if any(c.get("token_ids") for c in event.get("choices", [])):
                    seen += 1
                if break_after is not None and seen == break_after:
                    getattr(rig.proxy, fault)()
    finally:
        rig.proxy.heal()
    return out


@dataclass
class StreamedResponse:
    """A Responses API stream as the official `openai` client parsed it (typed events)."""

    events: list[Any] = field(default_factory=list)
    request_id: str = ""  # the router's x-request-id

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]

    @property
    def text(self) -> str:
        return "".join(e.delta for e in self.events if e.type == "response.output_text.delta")

    @property
    def completed(self) -> Any:
        done = [e for e in self.events if e.type == "response.completed"]
        assert len(done) == 1, self.types[-3:]
        return done[0]


async def stream_response(rig: MigrationRig, body: dict[str, Any], *, break_after: int | None = None,
                          fault: str = "reset") -> StreamedResponse:
    """`client.responses.create(**body, stream=True)` with the `openai` client; after
    `break_after` text deltas, break the `near` path (`fault`: reset or blackhole)."""
    out = StreamedResponse()
    client = openai.AsyncOpenAI(base_url=rig.router_url + "/v1", api_key=CAROL.key, max_retries=0, timeout=180)
    if break_after is not None:
        rig.proxy.set_bandwidth(PACE_BYTES_PER_S, "downstream")
    try:
        async with client:
            events = await client.responses.create(**body, stream=True)
            out.request_id = events.response.headers.get("x-request-id", "")
            async for event in events:
                out.events.append(event)
                deltas = sum(e.type == "response.output_text.delta" for e in out.events)
                if break_after is not None and event.type == "response.output_text.delta" and deltas == break_after:
                    getattr(rig.proxy, fault)()
    finally:
        rig.proxy.heal()
    return out
