"""The drill load over the router's WebSocket and gRPC protocols: a real router (its
production listener, gRPC on) in front of stand-in nodes, the generator's history read back
as the checker reads it.

The schedule gives each protocol its share of arrivals (and every WebSocket turn streams);
answered requests are `ok` on every protocol and reach the router's journal under their
idempotency key; a bad key, and a zone with no replica, are definite failures with the
OpenAI code the router gave, whatever the protocol carried them.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    NodeBehaviour,
    ServerGroup,
    make_table,
    node,
    node_app,
    router_settings,
    serve_router,
)

from chaos.arrivals import make_schedule
from chaos.deployed import DeployedRunOptions, _DeployedRun
from chaos.deployment import Deployment
from chaos.drill import Load, load_drills
from chaos.history import ClientOp, HistoryWriter, Outcome, read_records
from chaos.load import LoadGenerator, LoadTarget
from chaos.schedule import FaultState
from geo_router import create_app
from geo_router.state.table import StaticTableSource


@dataclass
class Rig:
    url: str
    grpc: str
    journal: Path
    behaviours: dict[str, NodeBehaviour]


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    servers = ServerGroup()
    behaviours = {"us": NodeBehaviour("us")}
    try:
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        settings = router_settings(grpc_port=0, request_journal_path=tmp_path / "router.jsonl")
        app = create_app(settings, table_source=StaticTableSource(make_table([node(n, u) for n, u in urls.items()])))
        url = await serve_router(servers, app, settings)
        yield Rig(url, f"127.0.0.1:{app.state.router.grpc.port}", tmp_path / "router.jsonl", behaviours)
    finally:
        await servers.stop()


def _load(tenants: dict[str, str], **overrides: Any) -> Load:
    values: dict[str, Any] = {
        "arrivals_per_s": 60, "duration_s": 0.5, "streaming_fraction": 0.5, "request_timeout_s": 5,
        "tenants": [{"name": t, "zone": zone, "weight": 1} for t, zone in tenants.items()],
        "protocols": {"http": 1, "websocket": 1, "grpc": 1},
    }
    return Load.model_validate(values | overrides)


async def _drive(rig: Rig, load: Load, keys: dict[str, str], writer: HistoryWriter) -> tuple[LoadGenerator, dict[str, ClientOp]]:
    gen = LoadGenerator(load, LoadTarget((rig.url,), keys, MODEL, (rig.grpc,)), writer, key_prefix="proto")
    await asyncio.wait_for(gen.run(time.monotonic()), 30)
    finals = {op.key: op for op in read_records(writer.path) if isinstance(op, ClientOp) and op.outcome is not None}
    return gen, finals


def test_the_schedule_shares_arrivals_between_protocols() -> None:
    load = _load({"t": "global"}, arrivals_per_s=200, duration_s=5)
    schedule = make_schedule(load, seed=3)
    counts = Counter(a.protocol for a in schedule)
    assert set(counts) == {"http", "websocket", "grpc"}
    assert all(n > len(schedule) / 5 for n in counts.values())
    assert all(a.stream for a in schedule if a.protocol == "websocket")
    # A load that names no protocols sends what it always sent: HTTP only, same arrivals.
    plain = _load({"t": "global"}, arrivals_per_s=200, duration_s=5, protocols={"http": 1})
    assert {a.protocol for a in make_schedule(plain, seed=3)} == {"http"}
    assert [a.at_s for a in make_schedule(plain, seed=3)] == [a.at_s for a in schedule]


async def test_answers_over_every_protocol_are_ok_and_journaled(rig: Rig, tmp_path: Path) -> None:
    with HistoryWriter(tmp_path / "client.jsonl") as writer:
        gen, ops = await _drive(rig, _load({"acme": "global"}), {"acme": GLOBAL_KEY}, writer)
    by_protocol = Counter(a.protocol for a in gen.schedule())
    assert min(by_protocol.values()) > 0
    # The history says how each request went, for the report's breakdown.
    assert Counter(op.protocol for op in ops.values()) == by_protocol
    assert {op.outcome for op in ops.values()} == {Outcome.OK}, Counter((o.outcome, o.error_code) for o in ops.values())
    assert all(op.first_byte_s is not None for op in ops.values())
    routed = {json.loads(line)["key"] for line in rig.journal.read_text().splitlines()}
    assert set(ops) <= routed


@pytest.mark.parametrize("key,code,retry_after", [("sk-wrong", "invalid_api_key", False),
                                                  (EU_KEY, "no_replica_in_zone", True)])
async def test_refusals_are_definite_failures_with_their_code_on_every_protocol(
    rig: Rig, tmp_path: Path, key: str, code: str, retry_after: bool
) -> None:
    with HistoryWriter(tmp_path / "client.jsonl") as writer:
        gen, ops = await _drive(rig, _load({"t": "eu"}), {"t": key}, writer)
    protocols = {gen.key(n): a.protocol for n, a in enumerate(gen.schedule())}
    assert set(protocols.values()) == {"http", "websocket", "grpc"}
    for op in ops.values():
        assert (op.outcome, op.error_code) == (Outcome.FAIL, code), protocols[op.key]
        assert op.retry_after is retry_after, protocols[op.key]
        assert not op.stream_error_event
    assert rig.behaviours["us"].hits == 0


def test_a_deployment_without_grpc_listeners_sends_that_share_over_the_others_and_says_so(tmp_path: Path) -> None:
    drill = next(d for d in load_drills() if d.name == "node-crash")
    assert "grpc" in drill.load.protocols
    base = {"name": "prod", "control_plane": "https://cp.example", "routers": ["https://r1.example"],
            "model": "m", "journals": [{"name": "nodes", "path": "/var/log/*.jsonl"}]}
    state = FaultState()
    load = _DeployedRun(drill, Deployment.model_validate(base), DeployedRunOptions(tmp_path))._load(state)
    assert set(load.protocols) == {"http", "websocket"}
    assert any("gRPC" in note for note in state.not_checked)
    with_grpc = Deployment.model_validate({**base, "grpc_routers": ["r1.example:9000"]})
    fresh = FaultState()
    assert _DeployedRun(drill, with_grpc, DeployedRunOptions(tmp_path))._load(fresh).protocols == drill.load.protocols
    assert not fresh.not_checked
