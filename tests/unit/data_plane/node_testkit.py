"""Helpers for the data-plane tests: settings on a checkpoint, in-process and real
uvicorn servers, polling, and SSE parsing."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response

from data_plane.engine.base import Engine, GenerationOutput, GenerationRequest, SamplingParams
from data_plane.engine.torch_engine import TorchEngine
from meridian.clock import ManualClock
from meridian.contracts import HeartbeatAck, NodeHeartbeat, NodeRegistered, NodeRegistration
from meridian.http_server import SERVER_KEEPALIVE_S
from meridian.settings.node import NodeSettings

MODEL_NAME = "tiny-llama"
# Token ids every engine test sends unless it says otherwise.
ENGINE_PROMPT = [0, 264, 519, 388, 12, 99]
CHAT_REQUEST: dict[str, Any] = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Tell me a story."}],
}


async def run_request(engine: Engine, rid: str, params: SamplingParams,
                      prompt: list[int] = ENGINE_PROMPT) -> list[GenerationOutput]:
    """Every output of one request, generated to its end."""
    return [o async for o in engine.generate(GenerationRequest(rid, prompt, params))]


def tokens_of(outputs: list[GenerationOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def make_settings(checkpoint: Path, **overrides: Any) -> NodeSettings:
    values: dict[str, Any] = {
        "model_dir": checkpoint,
        "control_plane_url": None,
        "max_tokens_limit": 512,
        "drain_timeout_s": 10.0,
    }
    values.update(overrides)
    return NodeSettings(**values)


@contextlib.asynccontextmanager
async def asgi_client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """Run the app's lifespan, wait for the model, and talk to the app in-process."""
    async with app.router.lifespan_context(app):
        await app.state.runtime.wait_ready()
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            yield client


class GatedEngine(TorchEngine):
    """The torch engine, but loading only starts once the test opens `gate`: a stand-in
    for a big checkpoint that takes minutes to load."""

    def __init__(self, settings: NodeSettings) -> None:
        super().__init__(settings)
        self.gate = asyncio.Event()

    async def start(self) -> None:
        await self.gate.wait()
        await super().start()


class _TestServer(uvicorn.Server):
    """uvicorn that leaves the test runner's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def running_server(app: Any, port: int = 0) -> AsyncIterator[str]:
    """Serve an ASGI app with uvicorn in this event loop; yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on",
                            timeout_keep_alive=SERVER_KEEPALIVE_S)
    server = _TestServer(config)
    task = asyncio.create_task(server.serve())
    with contextlib.suppress(AssertionError):
        await eventually(lambda: server.started or task.done(), within=5.0, interval=0.01)
    if not server.started:
        task.cancel()
        raise RuntimeError("server did not start")
    bound = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{bound}"
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)


async def eventually(
    predicate: Callable[[], object], within: float = 30.0, interval: float = 0.02,
    *, clock: ManualClock | None = None, step: float = 0.0,
) -> None:
    """Wait until predicate() is true, failing the test after `within` seconds.

    The deadline only bounds a failure: a passing test returns as soon as the predicate
    holds. It is generous because the waits cover real work (a torch model load, a
    subprocess) that took over 5 s on CI's two busy cores beside the vLLM tests.

    With `clock`, each poll also moves that ManualClock on by `step`: the node's timers
    (heartbeats, backoffs) run on it while the real I/O they start runs on real time.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {within}s")
        if clock is not None:
            clock.advance(step)
        await asyncio.sleep(interval)


async def advance_until_done(
    clock: ManualClock, task: asyncio.Future[Any], step: float, within: float = 30.0
) -> int:
    """Let `task` run to its end, moving `clock` on by `step` each time something waits on
    it (a backoff, a timeout) and only then; how many times the clock was moved."""
    moves = 0
    while True:
        await eventually(lambda: task.done() or clock.sleepers > 0, within=within)
        if task.done():
            return moves
        clock.advance(step)
        moves += 1


async def clock_turns(clock: ManualClock, step: float, turns: int) -> None:
    """Let a loop that waits on `clock` (the node agent) take `turns` more turns: each time
    something waits on the clock, move it on by `step`; return once it waits again."""
    for _ in range(turns):
        await eventually(lambda: clock.sleepers > 0)
        clock.advance(step)
    await eventually(lambda: clock.sleepers > 0)


def parse_sse(body: str) -> Iterator[Any]:
    """Yield each `data:` event of an SSE body, JSON-decoded except for [DONE]."""
    for block in body.split("\n\n"):
        block = block.strip()
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        yield data if data == "[DONE]" else json.loads(data)


TOKEN = "cluster-secret"
NODE_ID = "node-a"


@dataclass
class StandInControlPlane:
    """Just enough of the control plane's node API to watch what a node says."""

    heartbeat_interval_s: float = 0.05
    # The interval each heartbeat's ack tells the node (None: the ack says none, as before).
    ack_interval_s: float | None = None
    nodes: dict[str, NodeRegistration] = field(default_factory=dict)
    events: list[tuple[str, Any]] = field(default_factory=list)
    # Registrations to turn away (429) before taking one, and the Retry-After they carry.
    refuse_registrations: int = 0
    retry_after_s: int = 4

    def app(self) -> FastAPI:
        app = FastAPI()

        def authorized(request: Request) -> bool:
            return request.headers.get("authorization") == f"Bearer {TOKEN}"

        @app.post("/v1/nodes/register")
        async def register(request: Request) -> Response:
            if not authorized(request):
                return Response(status_code=401)
            reg = NodeRegistration.model_validate_json(await request.body())
            if self.refuse_registrations > 0:
                self.refuse_registrations -= 1
                self.events.append(("refused", reg))
                return Response(status_code=429, headers={"retry-after": str(self.retry_after_s)})
            self.nodes[reg.node_id] = reg
            self.events.append(("register", reg))
            ack = NodeRegistered(node_id=reg.node_id, ttl_s=1.0,
                                 heartbeat_interval_s=self.heartbeat_interval_s)
            return Response(ack.model_dump_json(), media_type="application/json")

        @app.post("/v1/nodes/{node_id}/heartbeat")
        async def heartbeat(node_id: str, request: Request) -> Response:
            if not authorized(request):
                return Response(status_code=401)
            if node_id not in self.nodes:
                return Response(status_code=404)
            self.events.append(("heartbeat", NodeHeartbeat.model_validate_json(await request.body())))
            ack = HeartbeatAck(routing_version=1, heartbeat_interval_s=self.ack_interval_s)
            return Response(ack.model_dump_json(),
                            media_type="application/json")

        @app.delete("/v1/nodes/{node_id}")
        async def deregister(node_id: str, request: Request) -> Response:
            if not authorized(request):
                return Response(status_code=401)
            self.nodes.pop(node_id, None)
            self.events.append(("delete", node_id))
            return Response(status_code=204)

        return app

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]

    def heartbeats(self) -> list[NodeHeartbeat]:
        return [body for kind, body in self.events if kind == "heartbeat"]

    def registrations(self) -> list[NodeRegistration]:
        return [body for kind, body in self.events if kind == "register"]
