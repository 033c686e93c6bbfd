"""Leader election of the fleet loops: one leader at a time, fast takeover, fenced epochs.

The handover test runs two real control-plane processes on one Postgres database and kills
the leader with SIGKILL. The in-process tests run the app on a ManualClock: each check
interval is passed by moving it, and the helpers wait for the electors' passes to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from cp_harness import (
    ADMIN_KEY,
    ControlPlane,
    advance,
    advance_until,
    poll,
    spawn_control_plane,
    stop_process,
    until,
    wait_until_up,
)
from sqlalchemy import text

from control_plane.context import AppContext
from control_plane.leader import ADVISORY_LOCK_KEY, Deposed, Fence, LeaderElector, check_fence, make_elector
from meridian.clock import ManualClock
from meridian.ports import free_port

TAKEOVER_S = 5.0
CHECK_S = 0.1
# Tests that run electors by hand turn the app's own off (it would compete with them).
own_electors = pytest.mark.parametrize(
    "settings_overrides",
    [{"reconciler_enabled": False, "autoscaler_enabled": False, "leader_check_interval_s": CHECK_S}],
    ids=["own-electors"],
)
# With the app's own electors off, its reaper is the one loop of its own on the clock.
APP_SLEEPERS = 1


@pytest.fixture
def clock_kind() -> str:
    return "manual"


@contextlib.asynccontextmanager
async def running(elector: LeaderElector) -> AsyncIterator[asyncio.Event]:
    """Run the elector for the block's duration; yields its stop event."""
    stop = asyncio.Event()
    task = asyncio.create_task(elector.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def refused(ctx: AppContext, fence: Fence) -> bool:
    try:
        with ctx.write() as session:
            check_fence(session, fence)
    except Deposed:
        return True
    return False


async def test_a_single_control_plane_leads(cp: ControlPlane) -> None:
    async def leader() -> dict[str, Any]:
        r = await cp.http.get("/v1/leader", headers=cp.admin)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    # The first campaign needs no time to pass: only its database call to finish.
    elector: LeaderElector = cp.app.state.elector
    await until(lambda: elector.is_leader)
    body = await leader()
    assert body["is_leader"]
    expected = "postgres-advisory-lock" if cp.settings.database_url.startswith("postgres") else "sqlite-lease"
    assert body["backend"] == expected
    assert body["epoch"] == 1
    assert body["holder"] == body["replica"]
    assert body["leader_since"] is not None
    # Fleet readers only.
    assert (await cp.http.get("/v1/leader")).status_code == 401


@own_electors
async def test_one_of_two_electors_leads_and_the_other_takes_over_when_it_stops(
    cp: ControlPlane, clock: ManualClock
) -> None:
    ctx: AppContext = cp.app.state.ctx
    electors = [make_elector(ctx, holder="a"), make_elector(ctx, holder="b")]
    stops = [asyncio.Event(), asyncio.Event()]
    tasks = [asyncio.create_task(e.run(stop)) for e, stop in zip(electors, stops, strict=True)]
    try:
        await until(lambda: any(e.is_leader for e in electors))
        await until(lambda: clock.sleepers >= APP_SLEEPERS + 2)
        for _ in range(5):  # several checks later: still exactly one
            await advance(clock, CHECK_S, sleepers=APP_SLEEPERS + 2)
        assert [e.is_leader for e in electors].count(True) == 1
        first = next(i for i, e in enumerate(electors) if e.is_leader)
        other = electors[1 - first]
        old = electors[first].fence()
        assert old is not None and refused(ctx, old) is False

        stops[first].set()  # a graceful stop gives leadership up at once
        await asyncio.wait_for(tasks[first], 10)
        await advance_until(
            clock, lambda: other.is_leader, step_s=CHECK_S, sleepers=APP_SLEEPERS + 1, within_s=TAKEOVER_S
        )
        new = other.fence()
        assert new is not None and new.epoch == old.epoch + 1
        assert refused(ctx, old)
        assert not refused(ctx, new)
    finally:
        for stop in stops:
            stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)


# Advisory locks and their connections are Postgres's: this one runs on Postgres only.
@pytest.mark.postgres
@pytest.mark.parametrize("database_url", ["postgres"], indirect=True)
@own_electors
async def test_a_leader_that_loses_its_connection_is_replaced_and_fenced(
    cp: ControlPlane, clock: ManualClock
) -> None:
    ctx: AppContext = cp.app.state.ctx
    both = APP_SLEEPERS + 2
    a = make_elector(ctx, holder="a")
    async with running(a):
        await until(lambda: a.is_leader)
        old = a.fence()
        assert old is not None
        b = make_elector(ctx, holder="b")
        async with running(b):
            await until(lambda: clock.sleepers >= both)
            for _ in range(3):
                await advance(clock, CHECK_S, sleepers=both)
            assert not b.is_leader
            # The leader's database session dies (a network cut, a server restart of the backend).
            with ctx.engine.connect() as conn:
                killed = conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
                        " AND ((classid::bigint << 32) | objid::bigint) = :k AND granted"
                        # Advisory locks are the server's: another test's control plane on
                        # another database (a parallel worker) holds the same key there.
                        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                    ),
                    {"k": ADVISORY_LOCK_KEY},
                ).scalars().all()
            assert killed == [True]
            await advance_until(clock, lambda: b.is_leader, step_s=CHECK_S, sleepers=both, within_s=TAKEOVER_S)
            await advance_until(clock, lambda: not a.is_leader, step_s=CHECK_S, sleepers=both, within_s=TAKEOVER_S)
            new = b.fence()
            assert new is not None and new.epoch > old.epoch
            assert refused(ctx, old)
            # The old leader keeps campaigning on a fresh connection but cannot lead now.
            for _ in range(5):
                await advance(clock, CHECK_S, sleepers=both)
            assert not a.is_leader and b.is_leader


# --- two real control-plane processes ------------------------------------------------------


@pytest.fixture
def processes() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for proc in started:
        stop_process(proc)


def leader_view(port: int) -> dict[str, Any] | None:
    try:
        r = httpx.get(f"http://127.0.0.1:{port}/v1/leader", headers={"authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=2)
    except httpx.TransportError:
        return None
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.postgres
def test_two_control_plane_processes_hand_over_leadership(postgres_url: str, processes: list[Any]) -> None:
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        processes.append(spawn_control_plane(
            port, postgres_url, MERIDIAN_CP_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY, MERIDIAN_CP_REPLICA_ID=f"cp-{i}",
        ))
    for proc, port in zip(processes, ports, strict=True):
        wait_until_up(proc, port, timeout_s=30)

    # Exactly one leads, and both agree on who.
    views: list[dict[str, Any] | None] = []
    leaders: list[dict[str, Any]] = []

    def one_agreed_leader() -> bool:
        views[:] = [leader_view(p) for p in ports]
        leaders[:] = [v for v in views if v and v["is_leader"]]
        assert len(leaders) <= 1, views
        return len(leaders) == 1 and all(v and v["holder"] == leaders[0]["replica"] for v in views)

    poll(one_agreed_leader, TAKEOVER_S, "no single agreed leader")
    for _ in range(5):  # and it stays that way
        views = [leader_view(p) for p in ports]
        assert sum(1 for v in views if v and v["is_leader"]) == 1, views
        time.sleep(0.2)
    old = leaders[0]
    index = ports.index(next(p for p, v in zip(ports, views, strict=True) if v and v["is_leader"]))
    survivor = ports[1 - index]

    killed_at = time.monotonic()
    processes[index].kill()  # SIGKILL: no graceful release
    processes[index].wait(timeout=10)
    seen: list[dict[str, Any] | None] = [None]

    def survivor_leads() -> bool:
        seen[0] = leader_view(survivor)
        return bool(seen[0] and seen[0]["is_leader"])

    poll(survivor_leads, TAKEOVER_S - (time.monotonic() - killed_at), "the survivor did not take over",
         interval_s=0.05)
    took_over_s = time.monotonic() - killed_at
    view = seen[0]
    assert view is not None
    assert view["epoch"] > old["epoch"]
    assert view["holder"] == view["replica"] == f"cp-{1 - index}"
    assert datetime.fromisoformat(view["acquired_at"]) <= datetime.now(UTC)
    print(f"takeover after SIGKILL: {took_over_s:.2f}s")
