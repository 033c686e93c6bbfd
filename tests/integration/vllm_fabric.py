"""A node running real vLLM (its CPU build, from `make vllm`) behind a real router.

vLLM starts in about 50 s on two cores, so one node serves a whole test module: the
module's tests share its event loop (`loop_scope="module"`). The checkpoint is the tiny
model shaped for vLLM's CPU attention (head_dim 64), with one LoRA adapter; the node runs
vLLM with the pythonic tool parser (named and "required" tool_choice) and the responses
store (previous_response_id), as a deployment would set them in its spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
from fastapi import FastAPI
from router_harness import REGIONS, ServerGroup, router_settings
from tenant_fabric import MODEL, Tenant, TenantFabric, node_settings, tenant_fabric

from data_plane.engine.vllm.command import default_vllm_python
from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.make_tiny import VLLM_CPU_ARCH, make_tiny_checkpoint
from data_plane.server.app import create_app as create_node_app
from geo_router import create_app as create_router_app
from geo_router.app import RouterState
from geo_router.state.table import StaticTableSource
from meridian.contracts import NodeRole, NodeStatus, RoutingNode, RoutingTable
from meridian.ports import free_port

ADAPTER = "sql"
# A function tool, for the tool_choice tests.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
ALICE = Tenant("alice", "sk-alice-0123456789abcdef")
BOB = Tenant("bob", "sk-bob-0123456789abcdef00")


def vllm_installed() -> bool:
    """Whether `make vllm` has made .venv-vllm (CI's `make test` always does)."""
    return Path(default_vllm_python()).parent.parent.name == ".venv-vllm"


def require_vllm() -> None:
    """Skip without vLLM's CPU build, except where services are required (CI): fail there."""
    if vllm_installed():
        return
    message = "vLLM's CPU build is not installed (make vllm)"
    if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def make_vllm_checkpoint(root: Path) -> tuple[Path, Path]:
    """The tiny model vLLM's CPU build accepts, and a LoRA adapter for it."""
    checkpoint = make_tiny_checkpoint(root / MODEL, seed=0, arch=VLLM_CPU_ARCH)
    adapter = make_tiny_lora(checkpoint, root / "loras" / ADAPTER, seed=1)
    return checkpoint, adapter


def write_spec(path: Path, more_args: Sequence[str] = (), more_env: Mapping[str, str] | None = None,
               **overrides: object) -> Path:
    spec: dict[str, object] = {
        "name": MODEL, "model": MODEL, "max_model_len": 1024, "max_num_seqs": 8,
        "max_num_batched_tokens": 2048, "cpu_kvcache_space_gib": 1,
        "loras": [{"name": ADAPTER}], "max_lora_rank": 8,
        # A random-weight model would pad JSON with whitespace up to max_tokens.
        "extra_args": ["--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                       "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}',
                       *more_args],
        "env": {"VLLM_ENABLE_RESPONSES_API_STORE": "1", **(more_env or {})},
    }
    spec.update(overrides)
    path.write_text(json.dumps(spec))
    return path


@contextlib.asynccontextmanager
async def vllm_fabric(root: Path, router: dict[str, object] | None = None, vllm_args: Sequence[str] = (),
                      vllm_env: Mapping[str, str] | None = None, **node: object) -> AsyncIterator[TenantFabric]:
    """`vllm_args` and `vllm_env`: more of vLLM's flags and environment (a test's plug-ins)."""
    checkpoint, adapter = make_vllm_checkpoint(root)
    settings: dict[str, object] = {
        "engine": "vllm", "vllm_gpu_count": 0, "vllm_executable": "auto",
        "deployment_spec_file": write_spec(root / "spec.json", vllm_args, vllm_env),
        "lora_modules": {ADAPTER: adapter}, "vllm_startup_timeout_s": 300.0,
        "vllm_probe_interval_s": 0.5, "drain_timeout_s": 30.0, "vllm_max_restarts": 1,
        "request_journal_path": root / "node-journal.jsonl",
    }
    settings.update(node)
    async with tenant_fabric(checkpoint, [ALICE, BOB], node=settings,
                             router={"read_timeout_s": 120.0, "request_timeout_s": 180.0,
                                     "max_request_bytes": 1_000_000,
                                     "tokenizer_dirs": {MODEL: checkpoint}, **(router or {})}) as fabric:
        yield fabric


@dataclass
class KVFabric:
    """A real-vLLM node and a torch-engine node behind one router, both publishing KV events."""

    router_url: str
    router: FastAPI
    nodes: dict[str, FastAPI]

    @property
    def state(self) -> RouterState:
        return self.router.state.router  # type: ignore[no-any-return]


def _kv_settings(port: int, replay_port: int) -> dict[str, object]:
    # A wildcard host binds (like vLLM's publisher); a concrete one would connect.
    return {"kv_events_endpoint": f"tcp://*:{port}", "kv_events_replay_endpoint": f"tcp://*:{replay_port}"}


@contextlib.asynccontextmanager
async def kv_fabric(root: Path) -> AsyncIterator[KVFabric]:
    """`vllm-node` (vLLM's CPU build, blocks of 128) and `torch-node` (blocks of 16) in one
    region; the router subscribes to both nodes' KV events."""
    checkpoint, adapter = make_vllm_checkpoint(root)
    servers = ServerGroup()
    ports = {name: (free_port(), free_port()) for name in ("vllm-node", "torch-node")}
    nodes: dict[str, FastAPI] = {}
    try:
        entries = []
        for node_id, extra in (
            ("vllm-node", {"engine": "vllm", "vllm_gpu_count": 0, "vllm_executable": "auto",
                           "deployment_spec_file": write_spec(root / "spec.json", loras=[]),
                           "vllm_startup_timeout_s": 300.0, "vllm_max_restarts": 1,
                           "vllm_probe_interval_s": 0.5}),
            ("torch-node", {"max_model_len": 2048}),
        ):
            events, replay = ports[node_id]
            app = create_node_app(node_settings(checkpoint, node_id=node_id, **_kv_settings(events, replay),
                                                max_tokens_limit=64, **extra))
            url = await servers.start(app)
            nodes[node_id] = app
            entries.append(RoutingNode(node_id=node_id, region=REGIONS["eu"].name, url=url, models=[MODEL],
                                       status=NodeStatus.READY, kv_events=f"tcp://127.0.0.1:{events}",
                                       kv_events_replay=f"tcp://127.0.0.1:{replay}"))
        await asyncio.gather(*(app.state.runtime.wait_ready() for app in nodes.values()))
        table = RoutingTable(version=1, generated_at=datetime.now(UTC), regions=list(REGIONS.values()),
                             nodes=entries, tenants=[ALICE.entry()], deployments=[])
        # connect_timeout_s: a loopback connect waits on this process's loop, which CI's vLLMs
        # starve past the harness's 1 s; routing is tested here, not connect timeouts.
        settings = router_settings(read_timeout_s=120.0, request_timeout_s=180.0, max_request_bytes=1_000_000,
                                   tokenizer_dirs={MODEL: checkpoint}, connect_timeout_s=10.0)
        router = create_router_app(settings, table_source=StaticTableSource(table))
        router_url = await servers.start(router)
        yield KVFabric(router_url, router, nodes)
    finally:
        await servers.stop()


@dataclass
class PDNodes:
    """A prefill node and a decode node running vLLM with its NixlConnector (KV in host
    memory, moved by UCX), with no router: tests (or a router they start) address them."""

    checkpoint: Path
    urls: dict[NodeRole, str]
    node_ids: dict[NodeRole, str]
    apps: dict[NodeRole, FastAPI]


@contextlib.asynccontextmanager
async def pd_nodes(root: Path) -> AsyncIterator[PDNodes]:
    """Nodes `eu-prefill-1` and `eu-decode-1`, started together (each vLLM takes ~1 min on two
    cores, and they share the cores: nobind)."""
    checkpoint, _ = make_vllm_checkpoint(root)
    servers = ServerGroup()
    apps: dict[NodeRole, FastAPI] = {}
    urls: dict[NodeRole, str] = {}
    ids = {NodeRole.PREFILL: "eu-prefill-1", NodeRole.DECODE: "eu-decode-1"}
    # One core each where there are two or more: two vLLMs whose OpenMP threads all spin on
    # every core slow each other down many times over (as on separate machines, each has its own).
    cores = os.sched_getaffinity(0)
    binds = dict(zip(ids, (str(c) for c in sorted(cores)), strict=False)) if len(cores) >= 2 else {}
    try:
        for role, node_id in ids.items():
            spec = write_spec(root / f"spec-{role.value}.json", loras=[], cpu_threads_bind=binds.get(role, "nobind"))
            app = create_node_app(node_settings(
                checkpoint, node_id=node_id, engine="vllm", vllm_gpu_count=0, vllm_executable="auto",
                deployment_spec_file=spec, role=role, vllm_startup_timeout_s=300.0, vllm_max_restarts=1,
                vllm_probe_interval_s=0.5, max_tokens_limit=64,
                request_journal_path=root / f"journal-{role.value}.jsonl"))
            urls[role] = await servers.start(app)
            apps[role] = app
        await asyncio.gather(*(app.state.runtime.wait_ready() for app in apps.values()))
        yield PDNodes(checkpoint, urls, ids, apps)
    finally:
        await servers.stop()
