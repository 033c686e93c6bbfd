"""The routing table from the control plane: ETag long-poll, snapshot, static stability.

Where a test waits for the client's retry backoff, the client runs on a ManualClock and the
test moves it past the longest backoff (retry_max_s) once the client sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request, Response
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
from geo_router.state.snapshot import read_snapshot
from geo_router.state.table import RoutingTableClient
from meridian.clock import SYSTEM_CLOCK, Clock, ManualClock
from meridian.contracts import HEADER_REGION, HEADER_TABLE_BUILD, TABLE_DELTA_IM, RoutingTableDelta
from meridian.settings.router import RouterSettings

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def settings_for(cp_url: str, snapshot: Path | None, **overrides: object) -> RouterSettings:
    # Snapshots written at once: these tests read each version back from disk.
    values: dict[str, object] = {"table_poll_timeout_s": 5.0, "snapshot_interval_s": 0.0, **overrides}
    return router_settings(control_plane_url=cp_url, snapshot_path=snapshot, **values)


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
    # A control plane that names no build (one that knows no deltas) sends full tables.
    assert (client.full_tables, client.deltas_applied) == (2, 0)


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


# --- deltas ---------------------------------------------------------------------------------


class DeltaControlPlane:
    """Serves version 1 (build "b1") in full, then version 2 as a delta from `delta_base`;
    records (if-none-match, a-im, build) of each request."""

    def __init__(self, delta_base: tuple[int, str]) -> None:
        self.delta_base = delta_base
        self.version = 1
        self.requests: list[tuple[str | None, str | None, str | None]] = []
        self.changed = asyncio.Event()
        self.app = FastAPI()
        self.app.get("/v1/routing-table")(self._routing_table)

    def table(self) -> bytes:
        nodes = [node("us", "http://us:1")] + ([node("eu", "http://eu:1")] if self.version == 2 else [])
        return make_table(nodes, version=self.version).model_dump_json().encode()

    async def _routing_table(self, request: Request) -> Response:
        h = request.headers
        self.requests.append((h.get("if-none-match"), h.get("a-im"), h.get(HEADER_TABLE_BUILD)))
        if h.get("if-none-match") == f'"{self.version}"':
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), float(request.query_params.get("wait", "0")))
            if h.get("if-none-match") == f'"{self.version}"':
                return Response(status_code=304)
        build = f"b{self.version}"
        if self.version == 2 and h.get("a-im") == TABLE_DELTA_IM:
            delta = RoutingTableDelta(
                base_version=self.delta_base[0], base_build=self.delta_base[1], version=2, build=build,
                generated_at=datetime.now(UTC), nodes_upserted=[node("eu", "http://eu:1")],
            )
            return Response(delta.model_dump_json(), status_code=226, media_type="application/json",
                            headers={"etag": '"2"', "im": TABLE_DELTA_IM, HEADER_TABLE_BUILD: build})
        return Response(self.table(), media_type="application/json",
                        headers={"etag": f'"{self.version}"', HEADER_TABLE_BUILD: build})

    def publish_v2(self) -> None:
        self.version = 2
        self.changed.set()


@pytest.mark.parametrize(("base", "deltas", "fulls"), [((1, "b1"), 1, 1), ((1, "b0"), 0, 2), ((0, "b1"), 0, 2)],
                         ids=["its-base", "another-build", "another-version"])
async def test_a_delta_is_applied_only_to_its_base_else_the_full_table_is_fetched(
    base: tuple[int, str], deltas: int, fulls: int
):
    cp = DeltaControlPlane(delta_base=base)
    async with running(cp.app) as cp_url:
        client = fast_client(settings_for(cp_url, None))
        await client.start()
        try:
            await eventually(lambda: len(cp.requests) >= 2)
            # Holding build b1 of version 1, the client asks for the changes since it.
            assert cp.requests[:2] == [(None, None, None), ('"1"', TABLE_DELTA_IM, "b1")]
            cp.publish_v2()
            loaded = await client.wait_for_version(2, timeout_s=5)
            assert sorted(n.node_id for n in loaded.table.nodes) == ["eu-1", "us-1"]
            assert (client.deltas_applied, client.full_tables) == (deltas, fulls)
            if fulls == 2:  # the delta was refused: the next ask was a plain one
                assert cp.requests[2] == ('"1"', None, None)
        finally:
            await client.stop()


async def test_the_snapshot_is_written_at_most_every_interval_and_at_stop(tmp_path: Path):
    snapshot = tmp_path / "routing-table.json"
    cp = StandInControlPlane(make_table([node("us", "http://us:1")], version=1))
    async with cp.serving() as cp_url:
        clock = ManualClock()
        client = fast_client(settings_for(cp_url, snapshot, snapshot_interval_s=30.0), clock)
        await client.start()
        try:
            assert read_snapshot(snapshot).version == 1  # on disk once start returns
            cp.publish(make_table([node("us", "http://us:2")], version=2))
            await client.wait_for_version(2, timeout_s=5)
            await eventually(lambda: clock.sleepers >= 1)  # the writer waits out its interval
            assert read_snapshot(snapshot).version == 1
            clock.advance(30.0)
            await eventually(lambda: read_snapshot(snapshot).version == 2)
            cp.publish(make_table([node("us", "http://us:3")], version=3))
            await client.wait_for_version(3, timeout_s=5)
        finally:
            await client.stop()
    assert read_snapshot(snapshot).version == 3  # the newest, written at stop
