"""The routing table from the control plane: ETag long-poll, snapshot, static stability.

Where a test waits for the client's retry backoff, the client runs on a ManualClock and the
test moves it past the longest backoff (retry_max_s) once the client sleeps.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from router_harness import (
    GLOBAL_KEY,
    MODEL,
    NodeBehaviour,
    StandInControlPlane,
    eventually,
    make_table,
    node,
    node_app,
    reserve_port,
    router_settings,
    running,
    url_of,
)

from geo_router import create_app
from geo_router.snapshot import read_snapshot
from geo_router.table import RoutingTableClient
from meridian.clock import SYSTEM_CLOCK, Clock, ManualClock
from meridian.contracts import HEADER_REGION
from meridian.settings import RouterSettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def settings_for(cp_url: str, snapshot: Path | None, **overrides: object) -> RouterSettings:
    return router_settings(control_plane_url=cp_url, snapshot_path=snapshot,
                           table_poll_timeout_s=5.0, **overrides)


RETRY_MAX_S = 0.2


def fast_client(settings: RouterSettings, clock: Clock = SYSTEM_CLOCK) -> RoutingTableClient:
    return RoutingTableClient(settings, retry_base_s=0.05, retry_max_s=RETRY_MAX_S, clock=clock)


async def backing_off(clock: ManualClock) -> None:
    """Until the client sleeps on its retry backoff."""
    await eventually(lambda: clock.sleepers == 1)


async def failed_polls(clock: ManualClock, count: int) -> None:
    """Let `count` more polls fail: each time the client backs off, end its backoff."""
    for _ in range(count):
        await backing_off(clock)
        clock.advance(RETRY_MAX_S)
    await backing_off(clock)


async def test_follows_new_versions_by_long_poll_and_persists_them(tmp_path: Path):
    snapshot = tmp_path / "state" / "routing-table.json"
    cp = StandInControlPlane(make_table([node("us", "http://us:1")], version=1))
    async with cp.serving() as cp_url:
        client = fast_client(settings_for(cp_url, snapshot))
        await client.start()
        try:
            assert client.current() is not None and client.current().version == 1
            assert read_snapshot(snapshot).version == 1
            # The poller now waits on the control plane with the version it has.
            await eventually(lambda: len(cp.requests) >= 2)
            assert cp.requests[:2] == [(None, None), ('"1"', "5")]

            started = time.monotonic()
            cp.publish(make_table([node("us", "http://us:1"), node("eu", "http://eu:1")],
                                  version=2))
            loaded = await client.wait_for_version(2, timeout_s=3)
            # The long-poll returns as soon as the version changes, not after its 5 s.
            assert time.monotonic() - started < 2
            assert [n.node_id for n in loaded.table.nodes] == ["us-1", "eu-1"]
            # Installed first, persisted right after.
            await eventually(lambda: read_snapshot(snapshot).version == 2)
            assert not list(snapshot.parent.glob("*.tmp"))
        finally:
            await client.stop()
    # Unchanged tables are answered 304, never re-sent.
    assert cp.answers.count(200) == 2


async def test_router_serves_from_snapshot_while_the_control_plane_is_down(tmp_path: Path):
    snapshot = tmp_path / "routing-table.json"
    behaviour = NodeBehaviour("us")
    async with running(node_app(behaviour)) as node_url:
        # A first life: the router gets the table from the control plane and saves it.
        cp = StandInControlPlane(make_table([node("us", node_url)], version=7))
        async with cp.serving() as cp_url:
            client = fast_client(settings_for(cp_url, snapshot))
            await client.start()
            await client.stop()
        assert read_snapshot(snapshot).version == 7

        # Second life: the control plane is down (connections refused) from the start.
        cp_sock = reserve_port()
        settings = settings_for(url_of(cp_sock), snapshot)
        clock = ManualClock()
        source = fast_client(settings, clock)
        router = create_app(settings, table_source=source)
        async with running(router) as router_url:
            async with httpx.AsyncClient(base_url=router_url, timeout=10) as http:
                health = await http.get("/health")
                assert health.status_code == 200 and health.json()["routing_version"] == 7
                r = await http.post("/v1/chat/completions", json=CHAT,
                                    headers={"authorization": f"Bearer {GLOBAL_KEY}"})
                assert r.status_code == 200 and r.headers[HEADER_REGION] == "aws:us-east-1"
                await failed_polls(clock, 3)  # a few failed polls: the router keeps serving
                assert (await http.get("/health")).status_code == 200

                # The control plane comes back with a newer table: the router follows.
                cp.publish(make_table([node("us", node_url)], version=8))
                async with cp.serving(cp_sock):
                    clock.advance(RETRY_MAX_S)
                    await source.wait_for_version(8, timeout_s=5)
                assert (await http.get("/health")).json()["routing_version"] == 8
        assert read_snapshot(snapshot).version == 8


@pytest.mark.parametrize("snapshot_content", [None, b"{not json", b'{"version": "x"}'])
async def test_no_table_and_no_usable_snapshot_means_503_until_one_arrives(
    tmp_path: Path, snapshot_content: bytes | None
):
    snapshot = tmp_path / "routing-table.json"
    if snapshot_content is not None:
        snapshot.write_bytes(snapshot_content)
    cp_sock = reserve_port()
    settings = settings_for(url_of(cp_sock), snapshot)
    clock = ManualClock()
    source = fast_client(settings, clock)
    async with running(create_app(settings, table_source=source)) as router_url:
        async with httpx.AsyncClient(base_url=router_url, timeout=10) as http:
            assert (await http.get("/health")).status_code == 503
            r = await http.post("/v1/chat/completions", json=CHAT,
                                headers={"authorization": f"Bearer {GLOBAL_KEY}"})
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "routing_table_unavailable"

            cp = StandInControlPlane(make_table([node("us", "http://us:1")], version=3))
            await backing_off(clock)
            async with cp.serving(cp_sock):
                clock.advance(RETRY_MAX_S)
                await source.wait_for_version(3, timeout_s=5)
            assert (await http.get("/health")).status_code == 200


async def test_a_wrong_cluster_token_is_logged_not_fatal(tmp_path: Path):
    cp = StandInControlPlane(make_table([], version=1))
    async with cp.serving() as cp_url:
        clock = ManualClock()
        client = fast_client(settings_for(cp_url, None, cluster_token="wrong"), clock)
        await client.start()
        try:
            await failed_polls(clock, 2)
            assert client.current() is None
            assert len(cp.answers) >= 2 and set(cp.answers) == {401}
        finally:
            await client.stop()
