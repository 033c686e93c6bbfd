"""Real HTTP peers for router tests: stand-in nodes and a stand-in control plane under uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from geo_router.listener import listener_config
from geo_router.state.table import StaticTableSource
from meridian.contracts import (
    DeploymentEntry,
    NodeStatus,
    RegionInfo,
    RoutingNode,
    RoutingTable,
    TenantEntry,
    openai_error,
)
from meridian.http_server import SERVER_KEEPALIVE_S
from meridian.security import hash_api_key
from meridian.settings.router import RouterSettings

MODEL = "tiny-llama"
CLUSTER_TOKEN = "cluster-secret"
GLOBAL_KEY = "mrd_global-tenant-key"
EU_KEY = "mrd_eu-tenant-key"
LIMITED_KEY = "mrd_limited-tenant-key"  # global, but only allowed "other-model"
# A router's /metrics answers the cluster token (or its metrics token) only.
SCRAPE = {"authorization": f"Bearer {CLUSTER_TOKEN}"}

REGIONS = {
    "us": RegionInfo(name="aws:us-east-1", provider="aws", location="us-east-1", zones=["us"],
                     latitude=38.9, longitude=-77.4),
    "eu": RegionInfo(name="gcp:europe-west4", provider="gcp", location="europe-west4",
                     zones=["eu"], latitude=53.4, longitude=6.8),
    "apac": RegionInfo(name="onprem:tokyo-1", provider="onprem", location="tokyo-1",
                       zones=["apac"], latitude=35.7, longitude=139.7),
}


def tenants() -> list[TenantEntry]:
    return [
        TenantEntry(key_hash=hash_api_key(GLOBAL_KEY), key_prefix=GLOBAL_KEY[:10], tenant="acme",
                    zone="global"),
        TenantEntry(key_hash=hash_api_key(EU_KEY), key_prefix=EU_KEY[:10], tenant="eurobank",
                    zone="eu"),
        TenantEntry(key_hash=hash_api_key(LIMITED_KEY), key_prefix=LIMITED_KEY[:10],
                    tenant="limited", zone="global", models=["other-model"]),
    ]


def node(name: str, url: str, *, region: str | None = None, status: NodeStatus = NodeStatus.READY,
         models: list[str] | None = None) -> RoutingNode:
    """A node `<name>-1` in REGIONS[region or name]."""
    return RoutingNode(node_id=f"{name}-1", region=REGIONS[region or name].name, url=url,
                       models=models if models is not None else [MODEL], status=status)


def make_table(nodes: list[RoutingNode], version: int = 1,
               deployments: list[DeploymentEntry] | None = None) -> RoutingTable:
    return RoutingTable(version=version, generated_at=datetime.now(UTC),
                        regions=list(REGIONS.values()), nodes=nodes, tenants=tenants(),
                        deployments=deployments or [])


async def eventually(condition: Callable[[], bool], timeout_s: float = 15.0) -> None:
    """Wait until `condition()` holds (AssertionError after `timeout_s`, a bound on a
    failure only, kept generous for CI's two busy cores)."""
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not met in time")


async def started_stream(http: httpx.AsyncClient, stack: contextlib.AsyncExitStack, body: dict[str, Any],
                         headers: dict[str, str]) -> AsyncIterator[str]:
    """A chat stream that has started (its first event read) and holds its slot until the node
    lets it end; its lines, kept open on `stack` (an iterator let go closes the stream)."""
    response = await stack.enter_async_context(
        http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}, headers=headers))
    assert response.status_code == 200
    lines = response.aiter_lines()
    await anext(lines)
    return lines


def metric(text: str, name: str, **labels: str) -> float:
    """The value of sample `name` with exactly `labels` in Prometheus text; 0 when absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


# --- stand-in node ---------------------------------------------------------------------


@dataclass
class NodeBehaviour:
    """How a stand-in node answers; tests flip `mode` between requests.

    ok: answer; error500: 500 before any byte; error400: 400 (client's fault);
    die_early: stream headers then close before any event; break: two events then close;
    slow: stream one event, then hold the stream open until `release` (for client-disconnect
    tests); hang: take the request and never answer (a frozen or partitioned node).
    """

    name: str
    mode: str = "ok"
    hits: int = 0
    request_ids: list[str] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    stream_closed: asyncio.Event = field(default_factory=asyncio.Event)
    # Set on every request; `hang` and `slow` wait for `release` (set when the test is done).
    received: asyncio.Event = field(default_factory=asyncio.Event)
    release: asyncio.Event = field(default_factory=asyncio.Event)


def _chunk(name: str, i: int) -> str:
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f"{name}{i} "}, "finish_reason": None}]}
    return f"data: {json.dumps(body)}\n\n"


def node_app(b: NodeBehaviour) -> FastAPI:
    app = FastAPI()

    async def answer(request: Request) -> Response:
        b.hits += 1
        b.received.set()
        b.request_ids.append(request.headers.get("x-request-id", ""))
        b.headers.append(dict(request.headers))
        body = await request.json()
        b.bodies.append(body)
        if b.mode == "hang":
            await b.release.wait()
        if b.mode == "error500":
            return JSONResponse(openai_error("engine crashed", "server_error"), status_code=500)
        if b.mode == "error400":
            return JSONResponse(openai_error("temperature must be <= 2", param="temperature"),
                                status_code=400)
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(_events(b, usage), media_type="text/event-stream")
        return JSONResponse({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": f"hi from {b.name}"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6},
        })

    app.post("/v1/chat/completions")(answer)
    app.post("/v1/completions")(answer)
    return app


# The usage chunk a stream ends with when the client asked for it (stream_options.include_usage).
STREAM_USAGE = {"prompt_tokens": 1000, "completion_tokens": 2000, "total_tokens": 3000}


async def _events(b: NodeBehaviour, usage: bool = False) -> AsyncIterator[str]:
    try:
        if b.mode == "die_early":
            raise RuntimeError("node died during prefill")
        for i in range(3):
            yield _chunk(b.name, i)
            if b.mode == "break" and i == 1:
                # Half an event, then the connection drops.
                yield 'data: {"id": "chatcmpl-1", "choi'
                raise RuntimeError("node crashed mid-stream")
            if b.mode == "slow":
                await b.release.wait()  # a generation that goes on until the router hangs up
        if usage:
            last = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
                    "choices": [], "usage": STREAM_USAGE}
            yield f"data: {json.dumps(last)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        b.stream_closed.set()


# --- stand-in control plane --------------------------------------------------------------


@dataclass
class ScaleUpCall:
    model: str
    body: dict[str, Any]
    authorization: str | None


class StandInControlPlane:
    """Serves GET /v1/routing-table with the control plane's ETag / long-poll semantics,
    and records POST /v1/deployments/{model}/scale-up (answered `scale_up_status`) and the
    routers' backlog reports (PUT /v1/routers/{id}/backlog)."""

    def __init__(self, table: RoutingTable) -> None:
        self.table = table
        self.requests: list[tuple[str | None, str | None]] = []  # (if-none-match, wait)
        self.answers: list[int] = []
        self.scale_ups: list[ScaleUpCall] = []
        self.scale_up_status = 200
        # (router id, body) of each flow-control backlog report.
        self.backlogs: list[tuple[str, dict[str, Any]]] = []
        self._changed = asyncio.Event()
        self.app = FastAPI()
        self.app.get("/v1/routing-table")(self._routing_table)
        self.app.post("/v1/deployments/{model:path}/scale-up")(self._scale_up)
        self.app.put("/v1/routers/{router_id}/backlog")(self._backlog)

    @contextlib.asynccontextmanager
    async def serving(self, sock: socket.socket | None = None) -> AsyncIterator[str]:
        """Run under uvicorn; pending long-polls are answered before it stops."""
        async with running(self.app, sock) as url:
            try:
                yield url
            finally:
                self._changed.set()

    def publish(self, table: RoutingTable) -> None:
        self.table = table
        self._changed.set()
        self._changed = asyncio.Event()

    async def _scale_up(self, model: str, request: Request) -> Response:
        self.scale_ups.append(ScaleUpCall(model, await request.json(), request.headers.get("authorization")))
        if self.scale_up_status != 200:
            return JSONResponse({"title": "error", "status": self.scale_up_status},
                                status_code=self.scale_up_status)
        return JSONResponse({"model": model, "desired_replicas": 1})

    async def _backlog(self, router_id: str, request: Request) -> Response:
        self.backlogs.append((router_id, await request.json()))
        return Response(status_code=204)

    async def _routing_table(self, request: Request) -> Response:
        inm = request.headers.get("if-none-match")
        wait = request.query_params.get("wait")
        self.requests.append((inm, wait))
        if request.headers.get("authorization") != f"Bearer {CLUSTER_TOKEN}":
            self.answers.append(401)
            return JSONResponse({"title": "Unauthorized", "status": 401}, status_code=401)
        if inm == f'"{self.table.version}"' and wait:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), float(wait))
        etag = f'"{self.table.version}"'
        if inm == etag:
            self.answers.append(304)
            return Response(status_code=304, headers={"etag": etag})
        self.answers.append(200)
        return Response(self.table.model_dump_json(), media_type="application/json",
                        headers={"etag": etag})


# --- running apps ------------------------------------------------------------------------


def reserve_port() -> socket.socket:
    """A bound, not-yet-listening socket: connecting to it is refused until it is served."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def url_of(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}"


class _Server(uvicorn.Server):
    """A uvicorn server that says when it accepts requests (`ready`) instead of being polled."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self.ready.set()


class ServerGroup:
    """uvicorn servers in this event loop, stopped together (shutdown is ~0.2 s each)."""

    def __init__(self) -> None:
        self._running: list[tuple[uvicorn.Server, asyncio.Task[None], socket.socket]] = []

    async def start(self, app: FastAPI, sock: socket.socket | None = None,
                    config: uvicorn.Config | None = None) -> str:
        """Serve `app` (on `sock` when given; with `config` when given, else a plain one);
        returns its base URL once it accepts requests."""
        sock = sock or reserve_port()
        # Idle connections kept as our listeners keep them (meridian.http_server), longer
        # than the router's pool and probes keep them.
        config = config or uvicorn.Config(app, lifespan="on", log_level="warning",
                                          timeout_graceful_shutdown=2, timeout_keep_alive=SERVER_KEEPALIVE_S)
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        self._running.append((server, task, sock))
        ready = asyncio.ensure_future(server.ready.wait())
        try:
            # A server that fails to start ends its task instead.
            await asyncio.wait((ready, task), timeout=10, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if not server.started:
            if task.done():
                task.result()
            raise TimeoutError("uvicorn did not start")
        return url_of(sock)

    def connections(self) -> list[Any]:
        """The protocol objects of every open connection of these servers."""
        return [conn for server, _, _ in self._running for conn in server.server_state.connections]

    async def stop(self) -> None:
        for server, _, _ in self._running:
            server.should_exit = True
        await asyncio.wait_for(asyncio.gather(*(t for _, t, _ in self._running)), 10)
        for _, _, sock in self._running:
            sock.close()
        self._running.clear()


async def serve_router(servers: ServerGroup, app: FastAPI, settings: RouterSettings) -> str:
    """Serve a router app as `meridian router serve` does (geo_router.listener: limits,
    WebSocket upgrade, HTTP/2, TLS); returns its base URL."""
    return await servers.start(app, config=listener_config(app, settings, log_level="warning",
                                                           timeout_graceful_shutdown=2))


@contextlib.asynccontextmanager
async def running(app: FastAPI, sock: socket.socket | None = None) -> AsyncIterator[str]:
    """Serve `app` under uvicorn in this event loop; yields its base URL."""
    group = ServerGroup()
    try:
        yield await group.start(app, sock)
    finally:
        await group.stop()


# --- a router in front of stand-in nodes ---------------------------------------------


def router_settings(**overrides: Any) -> RouterSettings:
    values: dict[str, Any] = {
        "cluster_token": SecretStr(CLUSTER_TOKEN),
        "default_client_location": "aws:us-east-1",
        # Long enough that an ejected node stays ejected for the whole test.
        "ejection_base_s": 30.0,
        "ejection_max_s": 120.0,
        "connect_timeout_s": 1.0,
        "read_timeout_s": 5.0,
        "request_timeout_s": 10.0,
        "max_request_bytes": 10_000,
        # Stand-in nodes fail on purpose: one 5xx ejects (the default needs 5 in a row, which
        # tests of health.py cover), and any share of three nodes may be ejected.
        "consecutive_failures_to_eject": 1,
        "max_ejected_percent": 100,
    }
    values.update(overrides)
    return RouterSettings(**values)


@dataclass
class Fabric:
    """A router under test and the stand-in nodes behind it."""

    router_url: str
    behaviours: dict[str, NodeBehaviour]
    node_urls: dict[str, str]
    source: StaticTableSource
    app: FastAPI
    clients: list[httpx.AsyncClient] = field(default_factory=list)

    def client(self, key: str | None = GLOBAL_KEY, **kwargs: Any) -> httpx.AsyncClient:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        c = httpx.AsyncClient(base_url=self.router_url, headers=headers, timeout=10, **kwargs)
        self.clients.append(c)
        return c

    def set_nodes(self, nodes: list[RoutingNode]) -> None:
        self.source.set(make_table(nodes, version=self.source.current().version + 1))

    def nodes(self) -> list[RoutingNode]:
        return [node(name, url) for name, url in self.node_urls.items()]


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.now(UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - timedelta(minutes=1))
            .not_valid_after(now + timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / "cert.pem", directory / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file
