"""Registration admission: past the in-flight limit a registration is answered 429 at once,
with a Retry-After that follows how many nodes wait and how fast the control plane registers,
and nothing of it is written."""

from __future__ import annotations

from cp_harness import ControlPlane

from control_plane.context import AppContext
from control_plane.registration_gate import MAX_RETRY_AFTER_S, WINDOW_S, RegistrationGate
from meridian.clock import ManualClock


def test_the_gate_admits_its_limit_and_refuses_the_rest() -> None:
    gate = RegistrationGate(2, ManualClock())
    assert gate.try_enter() and gate.try_enter()
    assert not gate.try_enter()
    gate.leave()
    assert gate.try_enter()
    assert gate.in_flight == 2


def test_refused_nodes_are_given_turns_spread_at_the_rate_registrations_are_served() -> None:
    clock = ManualClock()
    gate = RegistrationGate(1, clock)
    for _ in range(50):  # 50 registrations served in the last window: 10 a second
        assert gate.try_enter()
        gate.leave()
    assert gate.try_enter()
    turns = [gate.refuse() for _ in range(40)]  # 40 nodes turned away at once
    # One turn every 0.1 s: about ten nodes come back in each second, the last after 4 s.
    assert turns[:10] == [1] * 10 and turns[-1] == 4
    assert all(turns.count(t) == 10 for t in (2, 3, 4))
    # A node that comes back refused again queues behind those already given turns.
    clock.advance(1.0)
    assert gate.refuse() == 4
    assert gate.refused_total == 41


def test_turns_are_capped_and_start_afresh_once_the_crowd_is_served() -> None:
    clock = ManualClock()
    gate = RegistrationGate(2, clock)  # nothing served lately: assume the limit a second
    assert gate.try_enter() and gate.try_enter()
    turns = [gate.refuse() for _ in range(5000)]
    assert turns[1] == 1 and turns[-1] == MAX_RETRY_AFTER_S
    clock.advance(2500 + WINDOW_S)  # past every turn handed out
    assert gate.refuse() == 1


def test_no_limit_admits_everything() -> None:
    gate = RegistrationGate(None, ManualClock())
    assert all(gate.try_enter() for _ in range(1000))


async def test_a_registration_past_the_limit_is_refused_429_and_writes_nothing(cp: ControlPlane) -> None:
    ctx: AppContext = cp.app.state.ctx
    gate = ctx.registrations
    held = 0
    while gate.try_enter():  # every slot taken, as by registrations still running
        held += 1
    assert held == ctx.settings.max_concurrent_registrations
    r = await cp.register("node-late")
    assert r.status_code == 429
    assert r.headers["content-type"].startswith("application/problem+json")
    assert 1 <= int(r.headers["retry-after"]) <= MAX_RETRY_AFTER_S
    assert "register again" in r.json()["detail"]
    assert (await cp.http.get("/v1/nodes/node-late", headers=cp.admin)).status_code == 404
    for _ in range(held):
        gate.leave()
    assert (await cp.register("node-late")).status_code == 200
    assert (await cp.http.get("/v1/nodes/node-late", headers=cp.admin)).status_code == 200
