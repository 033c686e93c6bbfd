"""Routers' flow-control backlog reports (PUT /v1/routers/{id}/backlog) on SQLite and Postgres:
a report replaces its router's last, reports of several routers add up, a report past the TTL
counts for nothing, the console shows what is held, and bad reports are refused whole; and a
router's reporter against it."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import httpx
import pytest
from cp_harness import CLUSTER_TOKEN, ControlPlane
from pydantic import SecretStr
from sqlalchemy import select

from control_plane import router_backlog
from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import RouterBacklogRow
from geo_router.admission.flow_control import Capacity, FlowControl, FlowRequest
from geo_router.admission.flow_report import BacklogReporter
from meridian.clock import ManualClock
from meridian.cluster_client import ClusterAPIError, ClusterClient, ClusterEndpoint
from meridian.contracts import PoolBacklog, RouterBacklog
from meridian.settings.router import RouterSettings

MODEL = "tiny-llama"


def _client(app: object, token: str = CLUSTER_TOKEN) -> ClusterClient:
    endpoint = ClusterEndpoint("http://cp.test", SecretStr(token), 5.0)
    return ClusterClient(endpoint, transport=httpx.ASGITransport(app=app))  # type: ignore[arg-type]


def _report(*pools: tuple[str, str, int]) -> RouterBacklog:
    return RouterBacklog(pools=[PoolBacklog(zone=z, model=m, waiting=n) for z, m, n in pools])


async def _held(cp: ControlPlane) -> list[dict[str, Any]]:
    r = await cp.http.get("/v1/console/overview", headers=cp.admin)
    assert r.status_code == 200, r.text
    held: list[dict[str, Any]] = r.json()["router_backlog"]
    return held


async def test_reports_replace_their_routers_last_and_add_up_across_routers(cp: ControlPlane) -> None:
    async with _client(cp.app) as cluster:
        assert await _held(cp) == []
        await cluster.router_backlog("host-a:8080:11", _report(("eu", MODEL, 5), ("us", MODEL, 2)))
        await cluster.router_backlog("host-b:8080:12", _report(("eu", MODEL, 3)))
        assert await _held(cp) == [
            {"zone": "eu", "model": MODEL, "waiting": 8, "routers": 2},
            {"zone": "us", "model": MODEL, "waiting": 2, "routers": 1},
        ]
        # The next report of a router is its whole backlog: us emptied there, eu grew.
        await cluster.router_backlog("host-a:8080:11", _report(("eu", MODEL, 7)))
        assert await _held(cp) == [{"zone": "eu", "model": MODEL, "waiting": 10, "routers": 2}]
        # An empty report says nothing waits there any more.
        await cluster.router_backlog("host-a:8080:11", RouterBacklog())
        await cluster.router_backlog("host-b:8080:12", _report(("eu", MODEL, 1), ("eu", MODEL, 2)))  # one pool, twice
        assert await _held(cp) == [{"zone": "eu", "model": MODEL, "waiting": 3, "routers": 1}]


async def test_a_router_that_stopped_reporting_counts_for_nothing_and_its_rows_go(cp: ControlPlane) -> None:
    ctx: AppContext = cp.app.state.ctx
    ttl = cp.settings.router_backlog_ttl_s
    with ctx.write() as session:
        # A router that reported a backlog, then died (or was cut off) a TTL ago and more.
        session.add(RouterBacklogRow(router_id="gone:8080:1", zone="eu", model=MODEL, waiting=40,
                                     reported_at=db_now(session) - timedelta(seconds=ttl + 1)))
    assert await _held(cp) == []
    async with _client(cp.app) as cluster:
        await cluster.router_backlog("live:8080:2", _report(("eu", MODEL, 4)))
    with ctx.read() as session:
        assert [r.router_id for r in session.scalars(select(RouterBacklogRow))] == ["live:8080:2"]
        assert router_backlog.waiting_by_model(router_backlog.held(session, db_now(session), ttl)) == {MODEL: 4}


@pytest.mark.parametrize(("router_id", "body", "status"), [
    ("r1", {"pools": [{"zone": "eu", "model": MODEL, "waiting": -1}]}, 422),
    ("r1", {"pools": [{"zone": "EU!", "model": MODEL, "waiting": 1}]}, 422),
    ("r1", {"pools": [{"zone": "eu", "model": "", "waiting": 1}]}, 422),
    ("r1", {"pools": [{"zone": "eu", "model": MODEL, "waiting": 1}] * 1001}, 422),
    ("r1", {"pools": [], "extra": 1}, 422),
    ("-r1", {"pools": []}, 422),
    ("r" * 129, {"pools": []}, 422),
])
async def test_bad_reports_are_refused_whole(cp: ControlPlane, router_id: str, body: dict[str, Any],
                                            status: int) -> None:
    async with _client(cp.app) as cluster:
        await cluster.router_backlog("r1", _report(("eu", MODEL, 6)))
    r = await cp.http.put(f"/v1/routers/{router_id}/backlog", json=body, headers=cp.internal)
    cp.assert_problem(r, status)
    assert await _held(cp) == [{"zone": "eu", "model": MODEL, "waiting": 6, "routers": 1}]


async def test_only_the_cluster_token_reports(cp: ControlPlane) -> None:
    r = await cp.http.put("/v1/routers/r1/backlog", json={"pools": []}, headers=cp.admin)
    cp.assert_problem(r, 401)
    async with _client(cp.app, token="not-the-token") as cluster:
        with pytest.raises(ClusterAPIError) as refused:
            await cluster.router_backlog("r1", _report(("eu", MODEL, 6)))
    assert refused.value.status == 401
    assert await _held(cp) == []


async def test_a_routers_reporter_tells_what_its_flow_control_holds_and_when_it_empties(cp: ControlPlane) -> None:
    """The router side (geo_router.admission.flow_report) against this control plane: a report
    while requests wait, one empty report when they have gone, then silence; a refusal is
    counted and the next interval's report goes whole."""
    clock = ManualClock()
    settings = RouterSettings(cluster_token=SecretStr(CLUSTER_TOKEN), flow_reserve_share=0.0, router_id="edge-1:8080:7")
    flow = FlowControl(settings, lambda _key: Capacity(1), clock)
    outcomes: list[str] = []
    count = outcomes.append
    first = await flow.admit(FlowRequest(("eu", MODEL), "acme", 0, 1.0, 10, 10, 30))
    waiters = [asyncio.create_task(flow.admit(FlowRequest(("eu", MODEL), t, 0, 1.0, 10, 10, 30))) for t in "ab"]
    for _ in range(5):
        await asyncio.sleep(0)

    async with _client(cp.app, token="stale-token") as refused:
        reporter = BacklogReporter(settings, refused, flow, count, clock)
        assert not await reporter.report_once()
    assert outcomes == ["error"]
    assert await _held(cp) == []

    async with _client(cp.app) as cluster:
        reporter = BacklogReporter(settings, cluster, flow, count, clock)
        assert await reporter.report_once()
        assert await _held(cp) == [{"zone": "eu", "model": MODEL, "waiting": 2, "routers": 1}]
        first.release(10)
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        done.pop().result().release(10)  # the one the order picked; then the other goes
        for ticket in await asyncio.gather(*waiters):
            ticket.release(10)  # releasing the first again is nothing
        assert await reporter.report_once()  # nothing waits now: said once
        assert await _held(cp) == []
        assert not await reporter.report_once()  # and then nothing to say
    assert outcomes == ["error", "ok", "ok"]
    await flow.aclose()


async def test_the_reporter_wakes_for_a_backlog_reports_each_interval_and_sleeps_on_no_timer_after(
    cp: ControlPlane,
) -> None:
    clock = ManualClock()
    settings = RouterSettings(cluster_token=SecretStr(CLUSTER_TOKEN), flow_reserve_share=0.0,
                              flow_backlog_report_s=2.0, probe_interval_s=1.0, router_id="edge-2:8080:9")
    flow = FlowControl(settings, lambda _key: Capacity(1), clock)
    async with _client(cp.app) as cluster:
        reporter = BacklogReporter(settings, cluster, flow, lambda _outcome: None, clock)
        await reporter.start()
        for _ in range(10):
            await asyncio.sleep(0)
        assert clock.sleepers == 0  # idle: no timer of its own
        first = await flow.admit(FlowRequest(("eu", MODEL), "acme", 0, 1.0, 10, 10, 30))
        waiter = asyncio.create_task(flow.admit(FlowRequest(("eu", MODEL), "beta", 0, 1.0, 10, 10, 30)))
        await clock.settled(3)  # the waiter's deadline, flow control's ticker, the report's interval
        await clock.advance_async(2.0)
        await until_held(cp, [{"zone": "eu", "model": MODEL, "waiting": 1, "routers": 1}])
        first.release(10)
        (await waiter).release(10)
        await clock.advance_async(2.0)  # the ticker sees the queue empty; the report says so
        await until_held(cp, [])
        await clock.advance_async(2.0)
        assert clock.sleepers == 0
        await reporter.stop()
    await flow.aclose()


async def until_held(cp: ControlPlane, expected: list[dict[str, Any]]) -> None:
    """The console shows `expected` within a few seconds (a report is an HTTP round trip)."""
    for _ in range(100):
        if await _held(cp) == expected:
            return
        await asyncio.sleep(0.05)
    assert await _held(cp) == expected
