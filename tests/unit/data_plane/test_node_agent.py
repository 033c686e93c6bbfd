"""The node agent against a small, real stand-in control plane over HTTP."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_testkit import (
    CHAT_REQUEST,
    NODE_ID,
    TOKEN,
    GatedEngine,
    StandInControlPlane,
    asgi_client,
    clock_turns,
    eventually,
    make_settings,
    running_server,
)

from data_plane.agent import NodeAgent, advertise_kv_events
from data_plane.engine.base import Engine
from data_plane.engine.vllm.engine import VllmEngine
from data_plane.engine.vllm.spec import DeploymentSpec
from data_plane.runtime import NodeRuntime
from data_plane.server.app import create_app
from meridian.clock import ManualClock
from meridian.contracts import KVConnector, KVTransferInfo, NodeCapability, NodeLoad, NodeRole, NodeStatus
from meridian.ports import free_port


async def registered(agent: NodeAgent | None) -> None:
    """Start `agent` until it has registered once, then close it."""
    assert agent is not None
    await agent.start()
    try:
        assert await agent.wait_registered(5.0)
    finally:
        await agent.close()


@pytest.fixture
async def control_plane() -> AsyncIterator[tuple[StandInControlPlane, str]]:
    cp = StandInControlPlane()
    async with running_server(cp.app()) as url:
        yield cp, url


def agent_settings(checkpoint: Path, url: str, **extra: Any) -> Any:
    return make_settings(checkpoint, control_plane_url=url, region="aws:us-east-1",
                         node_id=NODE_ID, cluster_token=TOKEN, port=8123, **extra)


async def test_registers_starting_then_heartbeats_ready_with_load(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path
) -> None:
    cp, url = control_plane
    settings = agent_settings(tiny_checkpoint, url)
    engine = GatedEngine(settings)
    app = create_app(settings, engine=engine)
    async with app.router.lifespan_context(app):
        # While the model loads the node is registered but not routable.
        await eventually(lambda: len(cp.heartbeats()) >= 2)
        assert {h.status for h in cp.heartbeats()} == {NodeStatus.STARTING}
        engine.gate.set()
        await eventually(lambda: any(h.status == NodeStatus.READY for h in cp.heartbeats()))
        first = cp.registrations()[0]
        assert first.status == NodeStatus.STARTING
        assert (first.node_id, first.region, first.url) == (NODE_ID, "aws:us-east-1",
                                                            "http://127.0.0.1:8123")
        assert first.models == ["tiny-llama"]
        assert first.engine == "torch"

        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://n",
                                   headers={"authorization": f"Bearer {TOKEN}"})
        busy = asyncio.ensure_future(client.post("/v1/chat/completions", json={
            **CHAT_REQUEST, "max_tokens": 400, "ignore_eos": True, "temperature": 0}))
        await eventually(lambda: any(h.load.running == 1 for h in cp.heartbeats()))
        assert (await busy).status_code == 200
        # Idle again, with the finished request counted (and its latency summed) in the load.
        idle = NodeLoad(waiting_prompt_tokens=0)  # the torch engine measures what waits for a prefill
        await eventually(lambda: cp.heartbeats()[-1].load.model_copy(
            update={"requests_completed": None, "latency_s_sum": None}) == idle)
        last = cp.heartbeats()[-1].load
        assert last.requests_completed == 1 and last.latency_s_sum is not None and last.latency_s_sum > 0
        await client.aclose()


async def test_reregisters_when_the_control_plane_forgets_it(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path
) -> None:
    cp, url = control_plane
    app = create_app(agent_settings(tiny_checkpoint, url))
    async with asgi_client(app):
        await eventually(lambda: cp.heartbeats())
        cp.nodes.clear()  # as after a control-plane restart that lost this node
        await eventually(lambda: len(cp.registrations()) == 2)
        assert cp.registrations()[1].status == NodeStatus.READY
        await eventually(lambda: cp.kinds()[-1] == "heartbeat")


async def test_drain_reports_draining_then_deregisters(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path
) -> None:
    cp, url = control_plane
    clock = ManualClock()
    app = create_app(agent_settings(tiny_checkpoint, url), clock=clock)
    async with asgi_client(app):
        await eventually(lambda: any(h.status == NodeStatus.READY for h in cp.heartbeats()),
                         clock=clock, step=cp.heartbeat_interval_s)
        await app.state.runtime.drain()
        kinds = cp.kinds()
        assert kinds[-1] == "delete"
        assert cp.events[-2] == ("heartbeat", cp.heartbeats()[-1])
        assert cp.heartbeats()[-1].status == NodeStatus.DRAINING
        # Many heartbeat intervals on: no loop is left waiting to report again.
        await clock.advance_async(100 * cp.heartbeat_interval_s)
        assert clock.sleepers == 0
        assert cp.kinds() == kinds  # nothing after leaving: no zombie re-registration
        assert NODE_ID not in cp.nodes


async def test_keeps_serving_while_the_control_plane_is_down(
    tiny_checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app = create_app(agent_settings(tiny_checkpoint, url, control_plane_timeout_s=0.5))
    with caplog.at_level(logging.WARNING, logger="data_plane.agent"):
        async with asgi_client(app) as client:
            assert (await client.get("/health")).status_code == 200
            resp = await client.post("/v1/chat/completions", json={**CHAT_REQUEST, "max_tokens": 3},
                                     headers={"authorization": f"Bearer {TOKEN}"})
            assert resp.status_code == 200
            await app.state.runtime.drain()  # deregistration fails too, and that is fine
    assert "control plane unreachable" in caplog.text


async def test_agent_retries_until_the_control_plane_comes_back(tiny_checkpoint: Path) -> None:
    port = free_port()
    settings = agent_settings(tiny_checkpoint, f"http://127.0.0.1:{port}",
                              control_plane_timeout_s=0.5)
    status = NodeStatus.READY
    clock = ManualClock()
    agent = NodeAgent(settings, models=["tiny-llama"], status=lambda: status,
                      load=lambda: NodeLoad(running=2), retry_base_s=0.02, retry_max_s=0.1, clock=clock)
    await agent.start()
    try:
        await clock_turns(clock, 0.1, 3)  # three attempts, each backed off on the clock
        assert not agent.registered

        cp = StandInControlPlane()
        async with running_server(cp.app(), port=port):
            await eventually(lambda: agent.registered and cp.heartbeats(), clock=clock, step=0.1)
            assert cp.heartbeats()[-1].load.running == 2
        # Down again, then back with no memory of the node: it must re-register.
        await clock_turns(clock, 0.1, 3)
        fresh = StandInControlPlane()
        async with running_server(fresh.app(), port=port):
            await eventually(lambda: fresh.registrations() and fresh.heartbeats(), clock=clock, step=0.1)
    finally:
        await agent.close()


async def test_the_agent_waits_the_interval_the_last_ack_told_it(tiny_checkpoint: Path) -> None:
    """A large fleet is paced by a longer interval in the heartbeat ack: the node must wait it,
    as the control plane's reaper holds it to that interval's TTL and no shorter."""
    clock = ManualClock()
    cp = StandInControlPlane(ack_interval_s=3.0)
    async with running_server(cp.app()) as url:
        agent = NodeAgent(agent_settings(tiny_checkpoint, url), models=["tiny-llama"],
                          status=lambda: NodeStatus.READY, load=lambda: NodeLoad(), clock=clock)
        await agent.start()
        try:
            # Registered with the registration's interval; its first heartbeat learns 3 s.
            await eventually(lambda: len(cp.heartbeats()) == 1, clock=clock, step=cp.heartbeat_interval_s)
            await eventually(lambda: clock.sleepers > 0)
            assert agent.heartbeat_interval_s == 3.0
            await clock.advance_async(2.9)
            await eventually(lambda: clock.sleepers > 0)  # asleep again (after a heartbeat, were one due)
            assert len(cp.heartbeats()) == 1
            cp.ack_interval_s = 0.5  # the fleet shrank: the next ack says so, and it is followed
            await clock.advance_async(0.1)
            await eventually(lambda: len(cp.heartbeats()) == 2 and clock.sleepers > 0)
            await clock.advance_async(0.5)
            await eventually(lambda: len(cp.heartbeats()) == 3)
        finally:
            await agent.close()


async def test_a_registration_is_followed_by_a_heartbeat_at_once_then_by_the_acks_interval(
    tiny_checkpoint: Path,
) -> None:
    """The first heartbeat learns the fleet's paced interval: it is sent right after the
    registration, not after the registration's (shorter) interval, and only once."""
    clock = ManualClock()
    cp = StandInControlPlane(ack_interval_s=30.0)
    cp.heartbeat_interval_s = 2.0
    async with running_server(cp.app()) as url:
        agent = NodeAgent(agent_settings(tiny_checkpoint, url), models=["tiny-llama"],
                          status=lambda: NodeStatus.READY, load=lambda: NodeLoad(), clock=clock)
        await agent.start()
        try:
            await eventually(lambda: cp.kinds() == ["register", "heartbeat"] and clock.sleepers > 0)
            assert agent.heartbeat_interval_s == 30.0
            await clock.advance_async(29.0)  # not at the registration's 2 s
            await eventually(lambda: clock.sleepers > 0)
            assert cp.kinds() == ["register", "heartbeat"]
            await clock.advance_async(1.5)
            await eventually(lambda: cp.kinds() == ["register", "heartbeat", "heartbeat"])
        finally:
            await agent.close()


async def test_a_refused_registration_comes_back_around_the_retry_after(tiny_checkpoint: Path) -> None:
    """Registration admission (429 with Retry-After, as a control plane answers a fleet
    registering at once): the node waits that long (a little more, never less), not its short
    backoff, then registers."""
    clock = ManualClock()
    cp = StandInControlPlane(refuse_registrations=1, retry_after_s=4)
    async with running_server(cp.app()) as url:
        agent = NodeAgent(agent_settings(tiny_checkpoint, url), models=["tiny-llama"],
                          status=lambda: NodeStatus.READY, load=lambda: NodeLoad(), retry_base_s=0.02,
                          clock=clock)
        await agent.start()
        try:
            await eventually(lambda: cp.kinds() == ["refused"] and clock.sleepers > 0)
            await clock.advance_async(3.9)  # its own backoff would have retried many times by now
            await eventually(lambda: clock.sleepers > 0)
            assert cp.kinds() == ["refused"] and not agent.registered
            await clock.advance_async(1.0)  # past 1.2 x Retry-After, the most the jitter gives
            await eventually(lambda: agent.registered)
            assert cp.kinds()[:2] == ["refused", "register"]
        finally:
            await agent.close()


async def test_wrong_token_is_retried_not_fatal(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path
) -> None:
    cp, url = control_plane
    settings = agent_settings(tiny_checkpoint, url).model_copy(update={"cluster_token": None})
    clock = ManualClock()
    agent = NodeAgent(settings, models=[], status=lambda: NodeStatus.READY, load=NodeLoad,
                      retry_base_s=0.02, retry_max_s=0.05, clock=clock)
    await agent.start()
    try:
        await clock_turns(clock, 0.05, 3)  # three refused attempts, backed off on the clock
        assert not agent.registered and not cp.nodes
    finally:
        await agent.close()


def test_misconfiguration_fails_fast(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="region"):
        create_app(make_settings(tiny_checkpoint, control_plane_url="http://127.0.0.1:1"))


@pytest.mark.parametrize(
    ("endpoint", "replay", "extra", "expected"),
    [
        # Wildcard binds are advertised under the host routers reach the node at.
        ("tcp://*:5557", "tcp://*:5558", {}, ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")),
        ("tcp://*:5557", "tcp://0.0.0.0:5558", {}, ("tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")),
        # The replay socket always binds, so a concrete host is reachable as it is.
        ("tcp://*:5557", "tcp://10.0.0.9:5558", {}, ("tcp://10.0.0.5:5557", "tcp://10.0.0.9:5558")),
        ("ipc:///run/kv.sock", None, {}, ("ipc:///run/kv.sock", None)),
        ("tcp://*:5557", None, {"advertise_url": "http://[fd00::5]:8000"}, ("tcp://[fd00::5]:5557", None)),
        # A concrete host makes the publisher connect out to a collector: nothing to subscribe to.
        ("tcp://10.0.0.9:5557", "tcp://*:5558", {}, (None, None)),
        # A port picked at bind time is unknown here.
        ("tcp://*:*", None, {}, (None, None)),
        # Explicit advertisements win.
        ("tcp://*:*", "tcp://*:*", {"kv_events_advertise": "tcp://lb.example:7000",
                                    "kv_events_replay_advertise": "tcp://lb.example:7001"},
         ("tcp://lb.example:7000", "tcp://lb.example:7001")),
        (None, "tcp://*:5558", {"kv_events_advertise": "tcp://lb.example:7000"}, (None, None)),
    ],
)
def test_kv_event_endpoints_advertised_to_routers(
    tiny_checkpoint: Path, endpoint: str | None, replay: str | None, extra: dict[str, Any],
    expected: tuple[str | None, str | None],
) -> None:
    settings = make_settings(tiny_checkpoint, kv_events_endpoint=endpoint, kv_events_replay_endpoint=replay,
                             **{"advertise_url": "http://10.0.0.5:8000", **extra})
    assert advertise_kv_events(settings) == expected


async def test_registration_carries_the_kv_event_endpoints(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path
) -> None:
    cp, url = control_plane
    port = free_port()
    settings = agent_settings(tiny_checkpoint, url, kv_events_endpoint=f"tcp://*:{port}",
                              advertise_url="http://127.0.0.1:8123")
    agent = NodeAgent(settings, models=["tiny-llama"], status=lambda: NodeStatus.STARTING, load=NodeLoad)
    await registered(agent)
    assert cp.registrations()[0].kv_events == f"tcp://127.0.0.1:{port}"
    assert cp.registrations()[0].kv_events_replay is None


@pytest.mark.parametrize(("engine", "expected"), [
    ("vllm-pythonic", "pythonic"),
    ("vllm-hermes", "hermes"),
    ("vllm", None),  # no auto tool choice: vLLM reads no tool calls
    ("torch", None),  # the torch engine serves no tools
])
async def test_registration_carries_the_tool_call_parser(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path, engine: str, expected: str | None,
) -> None:
    cp, url = control_plane
    settings = agent_settings(tiny_checkpoint, url, engine=engine.partition("-")[0])
    node_engine: Engine = GatedEngine(settings)
    if engine.startswith("vllm"):
        parser = engine.partition("-")[2]
        args = ["--enable-auto-tool-choice", "--tool-call-parser", parser] if parser else []
        node_engine = VllmEngine(settings, spec=DeploymentSpec(name="chat", model="tiny", extra_args=args))
    agent = NodeRuntime(settings, node_engine).agent
    await registered(agent)
    assert cp.registrations()[0].tool_call_parser == expected


async def test_registration_says_what_the_engine_can_do_and_an_engine_that_says_nothing_can_do_nothing(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path,
) -> None:
    """Routers shape their requests by what a node can do, not by its engine's name."""
    cp, url = control_plane
    vllm_settings = agent_settings(tiny_checkpoint, url, engine="vllm")
    vllm = VllmEngine(vllm_settings, spec=DeploymentSpec(name="chat", model="tiny"))
    await registered(NodeRuntime(vllm_settings, vllm).agent)
    assert cp.registrations()[-1].capabilities == [NodeCapability.STOP_STRING_IN_OUTPUT,
                                                   NodeCapability.CHAT_SPECIAL_TOKENS]
    settings = agent_settings(tiny_checkpoint, url, engine="torch")
    await registered(NodeRuntime(settings, GatedEngine(settings)).agent)
    assert cp.registrations()[-1].capabilities == []


async def test_registration_says_how_many_sequences_the_engine_runs_at_once(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path,
) -> None:
    """Routers' flow control fills a node to its batch before holding requests at the router."""
    cp, url = control_plane
    vllm_settings = agent_settings(tiny_checkpoint, url, engine="vllm")
    vllm = VllmEngine(vllm_settings, spec=DeploymentSpec(name="chat", model="tiny", max_num_seqs=48))
    await registered(NodeRuntime(vllm_settings, vllm).agent)
    assert cp.registrations()[-1].max_num_seqs == 48
    settings = agent_settings(tiny_checkpoint, url, engine="torch", max_num_seqs=6)
    await registered(NodeRuntime(settings, GatedEngine(settings)).agent)
    assert cp.registrations()[-1].max_num_seqs == 6


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_a_prefill_or_decode_vllm_node_registers_its_role_and_nixl_side_channel(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path, role: str,
) -> None:
    cp, url = control_plane
    port = free_port()
    settings = agent_settings(tiny_checkpoint, url, engine="vllm", role=role, kv_side_channel_port=port,
                              kv_lease_s=45.0, advertise_url="http://10.1.2.3:8123")
    agent = NodeRuntime(settings, VllmEngine(settings, spec=DeploymentSpec(name="chat", model="tiny"))).agent
    await registered(agent)
    registration = cp.registrations()[0]
    assert registration.role == NodeRole(role)
    # Peers pull KV through the side channel on the host the node advertises.
    assert registration.kv_transfer == KVTransferInfo(connector=KVConnector.NIXL, endpoint=f"10.1.2.3:{port}",
                                                      lease_s=45.0)


async def test_a_co_located_vllm_node_registers_no_kv_transfer(
    control_plane: tuple[StandInControlPlane, str], tiny_checkpoint: Path,
) -> None:
    cp, url = control_plane
    settings = agent_settings(tiny_checkpoint, url, engine="vllm")
    agent = NodeRuntime(settings, VllmEngine(settings, spec=DeploymentSpec(name="chat", model="tiny"))).agent
    await registered(agent)
    assert (cp.registrations()[0].role, cp.registrations()[0].kv_transfer) == (NodeRole.BOTH, None)


def test_a_prefill_node_that_cannot_say_how_its_kv_moves_does_not_start(tiny_checkpoint: Path) -> None:
    settings = agent_settings(tiny_checkpoint, "http://127.0.0.1:1", role="prefill")
    with pytest.raises(ValueError, match="must say how its KV moves"):
        NodeAgent(settings, models=["tiny"], status=lambda: NodeStatus.STARTING, load=NodeLoad)
