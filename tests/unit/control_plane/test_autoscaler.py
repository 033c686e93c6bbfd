"""The KPA decision function without a database (windows, panic, delays, rates, scale to zero),
then the leader's loop on SQLite and Postgres (heartbeat load in, desired replicas and records out)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest
from cp_harness import ControlPlane
from sqlalchemy import select

from control_plane.autoscaler import (
    Autoscaler,
    Decision,
    KpaState,
    Sample,
    decide,
    decide_prefill,
    in_zone_pools,
)
from control_plane.context import AppContext
from control_plane.db.models import AuditEntry, Node
from control_plane.leader import FLEET, Deposed, Fence, claim
from meridian.clock import ManualClock
from meridian.contracts import AutoscalingSpec, DisaggregationSpec, RegionInfo

TICK_S = 2.0


@dataclass
class Sim:
    """A deployment whose replicas become ready at once, sampled every TICK_S seconds."""

    spec: AutoscalingSpec
    current: int
    min_replicas: int = 0
    max_replicas: int = 100
    now: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    state: KpaState = KpaState()
    decisions: list[Decision] = field(default_factory=list)
    since_scale_request_s: float | None = None

    def run(self, seconds: float, load: Callable[[float], float] | float) -> Decision:
        """Advance `seconds`, observing `load` (in-flight requests) each tick; the last decision."""
        end = self.now + seconds
        while self.now < end - 1e-9:
            self.now += TICK_S
            concurrency = load(self.now) if callable(load) else load
            self.samples.append(Sample(self.now, concurrency))
            if self.since_scale_request_s is not None:
                self.since_scale_request_s += TICK_S
            d = decide(
                self.spec, min_replicas=self.min_replicas, max_replicas=self.max_replicas, samples=self.samples,
                current=self.current, ready=self.current, now=self.now, state=self.state,
                since_scale_request_s=self.since_scale_request_s,
            )
            self.decisions.append(d)
            self.state = d.state
            self.current = d.desired
        return self.decisions[-1]


def spec(**fields: Any) -> AutoscalingSpec:
    values: dict[str, Any] = {
        "target_concurrency": 10, "stable_window_s": 60, "panic_window_pct": 10, "panic_threshold_pct": 200,
        "scale_down_delay_s": 0, "max_scale_up_rate": 1000, "max_scale_down_rate": 2, **fields,
    }
    return AutoscalingSpec(**values)


def test_stable_scale_up_follows_the_window_average() -> None:
    sim = Sim(spec(), current=1, min_replicas=1)
    # 15 in flight on one replica (150% of its target: under the 200% panic threshold).
    d = sim.run(60, 15)
    assert d.mode == "stable"
    assert sim.current == 2
    # Sustained 35 in flight: ceil(35 / 10) = 4 once the window is full of it.
    d = sim.run(70, 35)
    assert sim.current == 4
    assert d.mode == "stable"
    assert d.inputs["avg_concurrency_stable"] == 35
    assert d.inputs["stable_samples"] == 30
    assert d.inputs["panic_samples"] == 3
    assert "stable: 35.0 in flight" in d.reason


def test_a_burst_panics_and_scales_up_on_the_panic_window() -> None:
    sim = Sim(spec(), current=2)
    sim.run(58, 10)
    assert sim.current == 2  # wants 1, but has not watched a whole window yet
    # A burst to 100 in flight: the 6 s panic window sees it long before the 60 s average does.
    d = sim.run(6, 100)
    assert d.mode == "panic"
    assert "entering panic" in sim.decisions[-3].reason
    assert sim.current == 10  # ceil(100 / 10), far above the stable window's ceil(~19 / 10)
    assert d.inputs["want_stable"] < 10


def test_no_scale_down_during_panic_and_panic_ends_after_a_calm_stable_window() -> None:
    sim = Sim(spec(), current=2)
    sim.run(58, 10)
    sim.run(6, 100)
    assert sim.current == 10
    # The burst ends: still panicking for a stable window after the last time over the threshold.
    d = sim.run(50, 0)
    assert d.mode == "panic"
    assert sim.current == 10
    assert all(x.desired >= 10 for x in sim.decisions[-25:])
    d = sim.run(12, 0)
    assert d.mode == "stable"
    assert any("leaving panic" in x.reason for x in sim.decisions[-6:])
    # Back in stable mode it scales down (rate-limited by max_scale_down_rate 2: 10 → 5 → 2 → 1).
    assert sim.current < 10


def test_scale_down_waits_for_the_scale_down_delay() -> None:
    sim = Sim(spec(scale_down_delay_s=30, max_scale_down_rate=100), current=1, min_replicas=1)
    sim.run(70, 50)
    assert sim.current == 5
    # Load drops to 10 (1 replica): the average falls within the window, the count must wait.
    drop_at = sim.now
    sim.run(70, 10)
    went_down = next(i for i, x in enumerate(sim.decisions) if x.desired < 5)
    lowered_at = (went_down + 1) * TICK_S
    # The stable average needs a while to fall; then the count goes down only once 5 was
    # last wanted 30 s ago.
    last_wanted_5 = max((i + 1) * TICK_S for i, x in enumerate(sim.decisions) if x.inputs["want_stable"] >= 5)
    assert last_wanted_5 > drop_at
    assert lowered_at - last_wanted_5 >= 30
    assert lowered_at - last_wanted_5 <= 30 + TICK_S
    assert any("delayed" in x.reason for x in sim.decisions)
    sim.run(40, 10)
    assert sim.current == 1


def test_min_zero_scales_to_zero_after_an_idle_stable_window() -> None:
    sim = Sim(spec(max_scale_down_rate=100), current=3)
    sim.run(30, 0)
    # The window is not yet covered by observation: no scale-down at all.
    assert sim.current == 3
    assert "no scale-down yet" in sim.decisions[-1].reason
    d = sim.run(40, 0)
    assert sim.current == 0
    zero = next(x for x in sim.decisions if x.desired == 0)
    assert "scale to zero" in zero.reason
    assert zero.inputs["avg_concurrency_stable"] == 0
    assert d.desired == 0


def test_no_scale_to_zero_within_a_stable_window_of_a_scale_from_zero_request() -> None:
    sim = Sim(spec(), current=0)
    sim.run(70, 0)
    assert sim.current == 0
    # A router asked for a replica (the control plane set desired to 1); no request arrives yet.
    sim.current = 1
    sim.since_scale_request_s = 0.0
    sim.run(50, 0)
    assert sim.current == 1
    assert "scale-from-zero request" in sim.decisions[-1].reason
    sim.run(14, 0)
    assert sim.current == 0
    # Held requests never scale from zero on their own: at zero with no request it stays there.
    sim.since_scale_request_s = None
    sim.run(10, 0)
    assert sim.current == 0


def test_a_new_leader_does_not_scale_a_zero_deployment_up_for_an_old_request() -> None:
    d = decide(spec(), min_replicas=0, max_replicas=5, samples=[Sample(1.0, 0.0)], current=0, ready=0,
               now=1.0, state=KpaState(), since_scale_request_s=0.0)
    assert d.desired == 0


def test_rate_limits_bound_each_step() -> None:
    up = Sim(spec(max_scale_up_rate=2), current=2)
    up.run(2, 400)  # panic: wants 40
    assert up.current == 4  # at most ×2 the 2 ready
    assert "rate-limited from 40 to 4" in up.decisions[-1].reason
    up.run(2, 400)
    assert up.current == 8

    down = Sim(spec(max_scale_down_rate=2), current=16, min_replicas=1)
    down.run(70, 0)
    steps = [x.desired for x in down.decisions if x.desired != 16]
    assert steps[:3] == [8, 4, 2]  # at most ÷2 per decision


def test_counts_stay_within_min_and_max() -> None:
    sim = Sim(spec(), current=2, min_replicas=2, max_replicas=3)
    sim.run(70, 500)
    assert sim.current == 3
    assert "bounded to [2, 3]" in sim.decisions[-1].reason
    sim.run(200, 0)
    assert sim.current == 2


REGIONS = {r.name: r for r in (
    RegionInfo(name="aws:us-east-1", provider="aws", location="N. Virginia", zones=["us"],
               latitude=38.9, longitude=-77.4),
    RegionInfo(name="gcp:europe-west4", provider="gcp", location="Netherlands", zones=["eu"],
               latitude=53.4, longitude=6.8),
    RegionInfo(name="onprem:tokyo-1", provider="onprem", location="Tokyo", zones=["apac"],
               latitude=35.7, longitude=139.7),
)}


def ready_node(node_id: str, region: str, running: int, models: tuple[str, ...] = ("tiny-llama",)) -> Node:
    return Node(node_id=node_id, region=region, models=list(models), role="both", status="ready",
                load={"running": running, "waiting": 0})


def test_a_deployment_counts_only_the_replicas_its_zone_admits() -> None:
    """Issue 32: an eu deployment whose only eu replica died was held at "1 of 2 ready", the us
    and apac nodes of its model counted as its replicas (and their load as its load)."""
    nodes = [ready_node("us", "aws:us-east-1", 30), ready_node("apac", "onprem:tokyo-1", 30),
             ready_node("nowhere", "aws:mars-1", 30)]
    pools = in_zone_pools(nodes, {"tiny-llama": "eu"}, REGIONS)
    assert pools == {}  # no eu node: no replica, no load
    eu = ready_node("eu", "gcp:europe-west4", 3)
    pools = in_zone_pools([*nodes, eu], {"tiny-llama": "eu"}, REGIONS)
    (pool,) = pools.values()
    assert (pool.ready, pool.in_flight) == (1, 3)
    # A global deployment may use every region this control plane describes (not aws:mars-1),
    # and a model without a deployment counts nowhere.
    pools = in_zone_pools([*nodes, eu, ready_node("x", "aws:us-east-1", 1, ("other",))],
                          {"tiny-llama": "global"}, REGIONS)
    assert {k: (p.ready, p.in_flight) for k, p in pools.items()} == {("tiny-llama", "both"): (3, 63)}

    # The decision says how many replicas its zone really has.
    d = decide(spec(), min_replicas=1, max_replicas=2, samples=[Sample(0, 0)], current=1, ready=0, now=0,
               state=KpaState())
    assert d.desired == 1 and d.inputs["ready"] == 0
    assert d.reason.startswith("hold at 1; 0 of 1 ready;")


# --- the leader's loop against the database (SQLite and Postgres) -------------------------

loops_off = pytest.mark.parametrize(
    "settings_overrides", [{"reconciler_enabled": False, "autoscaler_enabled": False}], ids=["loops-off"]
)
MODEL = "tiny-llama"


def test_the_prefill_pool_follows_queued_prompt_tokens_within_its_bounds() -> None:
    topology = DisaggregationSpec(target_waiting_prompt_tokens=4096, min_prefill_replicas=1, max_prefill_replicas=6)
    state, samples, current = KpaState(), [], 1
    now = 0.0
    for _ in range(30):  # a minute of 20,000 prompt tokens waiting: ceil(20000 / 4096) = 5
        now += TICK_S
        samples.append(Sample(now, 20_000))
        d = decide_prefill(spec(), topology, samples=samples, current=current, ready=current, now=now, state=state)
        state, current = d.state, d.desired
    assert current == 5
    assert d.inputs["pool"] == "prefill" and d.inputs["target_concurrency"] == 4096
    assert d.reason.startswith("prefill ")
    for _ in range(60):  # a burst beyond the pool's bound stops at max_prefill_replicas
        now += TICK_S
        samples.append(Sample(now, 200_000))
        d = decide_prefill(spec(), topology, samples=samples, current=current, ready=current, now=now, state=state)
        state, current = d.state, d.desired
    assert current == 6
    for _ in range(120):  # the queue drains: down to the pool's minimum, never to zero
        now += TICK_S
        samples.append(Sample(now, 0))
        d = decide_prefill(spec(), topology, samples=samples, current=current, ready=current, now=now, state=state)
        state, current = d.state, d.desired
    assert current == 1


@pytest.fixture
def clock_kind() -> str:
    # The app (the autoscaler and the scale-up route that stamps requests) runs on a
    # ManualClock the tests move.
    return "manual"


def lead(cp: ControlPlane, holder: str = "test") -> Fence:
    ctx: AppContext = cp.app.state.ctx
    with ctx.write() as session:
        return Fence(FLEET, claim(session, FLEET, holder, datetime.now(UTC), None))


async def desired(cp: ControlPlane) -> int:
    r = await cp.http.get(f"/v1/deployments/{MODEL}", headers=cp.admin)
    value: int = r.json()["desired_replicas"]
    return value


async def decisions(cp: ControlPlane) -> list[dict[str, Any]]:
    return list(reversed(await cp.admin_list("/v1/autoscaler/decisions", model=MODEL)))  # oldest first


async def setup_deployment(cp: ControlPlane) -> None:
    autoscaling = {"target_concurrency": 2, "stable_window_s": 6, "panic_threshold_pct": 1000,
                   "scale_down_delay_s": 0, "max_scale_down_rate": 100}
    r = await cp.http.put(f"/v1/deployments/{MODEL}", headers=cp.admin,
                          json={"min_replicas": 0, "max_replicas": 5, "autoscaling": autoscaling})
    assert r.status_code == 201, r.text
    assert (await cp.register("n1", models=[MODEL])).status_code == 200


@loops_off
async def test_the_autoscaler_follows_heartbeat_load_and_records_each_decision(
    cp: ControlPlane, clock: ManualClock
) -> None:
    await setup_deployment(cp)
    assert (await cp.heartbeat("n1", load={"running": 4, "waiting": 2})).status_code == 200
    scaler = Autoscaler(cp.app.state.ctx)
    fence = lead(cp)

    await scaler.tick(fence)
    assert await desired(cp) == 3  # ceil(6 in flight / 2 per replica)
    (first,) = await decisions(cp)
    assert (first["current"], first["desired"], first["mode"], first["epoch"]) == (0, 3, "stable", fence.epoch)
    assert first["inputs"]["avg_concurrency_stable"] == 6
    assert first["inputs"]["ready"] == 1
    assert first["reason"].startswith("0 → 3")

    # Idle: after a whole stable window without traffic it scales to zero.
    assert (await cp.heartbeat("n1", load={"running": 0, "waiting": 0})).status_code == 200
    for _ in range(4):
        clock.advance(2)
        await scaler.tick(fence)
    assert await desired(cp) == 0
    last = (await decisions(cp))[-1]
    assert (last["current"], last["desired"]) == (3, 0)
    assert "scale to zero" in last["reason"]
    with cp.app.state.ctx.read() as session:
        entries = session.scalars(select(AuditEntry).where(AuditEntry.actor_id == "system:autoscaler")).all()
        assert [(e.before, e.after) for e in entries] == [
            ({"desired_replicas": 0}, {"desired_replicas": 3, "mode": "stable"}),
            ({"desired_replicas": 3}, {"desired_replicas": 0, "mode": "stable"}),
        ]


@loops_off
async def test_a_scale_from_zero_request_is_kept_for_a_stable_window(cp: ControlPlane, clock: ManualClock) -> None:
    await setup_deployment(cp)
    scaler = Autoscaler(cp.app.state.ctx)
    fence = lead(cp)
    for _ in range(4):
        await scaler.tick(fence)
        clock.advance(2)
    assert await desired(cp) == 0

    r = await cp.http.post(f"/v1/deployments/{MODEL}/scale-up", json={"queued_requests": 1}, headers=cp.internal)
    assert r.status_code == 200, r.text
    assert await desired(cp) == 1
    for _ in range(2):  # 4 s of a 6 s window: the replica is kept although no request ran yet
        await scaler.tick(fence)
        clock.advance(2)
    assert await desired(cp) == 1
    for _ in range(3):
        await scaler.tick(fence)
        clock.advance(2)
    assert await desired(cp) == 0


@loops_off
async def test_a_deposed_autoscaler_changes_nothing(cp: ControlPlane) -> None:
    await setup_deployment(cp)
    assert (await cp.heartbeat("n1", load={"running": 8})).status_code == 200
    old = lead(cp, "old")
    lead(cp, "new")
    with pytest.raises(Deposed):
        await Autoscaler(cp.app.state.ctx).tick(old)
    assert await desired(cp) == 0
    assert await decisions(cp) == []


@loops_off
async def test_a_disaggregated_deployment_scales_its_pools_separately(cp: ControlPlane, clock: ManualClock) -> None:
    autoscaling = {"target_concurrency": 2, "stable_window_s": 6, "panic_threshold_pct": 1000,
                   "scale_down_delay_s": 0, "max_scale_down_rate": 100}
    topology = {"target_waiting_prompt_tokens": 1000, "min_prefill_replicas": 1, "max_prefill_replicas": 4}
    r = await cp.http.put(f"/v1/deployments/{MODEL}", headers=cp.admin, json={
        "min_replicas": 1, "max_replicas": 5, "autoscaling": autoscaling, "disaggregation": topology})
    assert r.status_code == 201, r.text
    transfer = {"connector": "NixlConnector", "endpoint": "10.0.0.7:5600", "lease_s": 30}
    for node, role in (("p1", "prefill"), ("d1", "decode")):
        assert (await cp.register(node, models=[MODEL], role=role, kv_transfer=transfer)).status_code == 200
    # Prompts pile up on the prefill node while the decode node is calm: only prefill grows.
    await cp.heartbeat("p1", load={"running": 1, "waiting": 9, "waiting_prompt_tokens": 3500})
    await cp.heartbeat("d1", load={"running": 1, "waiting": 0})
    scaler = Autoscaler(cp.app.state.ctx)
    fence = lead(cp)
    await scaler.tick(fence)
    view = (await cp.http.get(f"/v1/deployments/{MODEL}", headers=cp.admin)).json()
    assert (view["desired_prefill_replicas"], view["desired_replicas"]) == (4, 1)  # ceil(3500 / 1000); 1 in flight

    # Then generation is the bottleneck: the decode pool grows; the drained prefill queue
    # brings its pool back to its minimum after a window.
    await cp.heartbeat("p1", load={"running": 0, "waiting": 0, "waiting_prompt_tokens": 0})
    await cp.heartbeat("d1", load={"running": 7, "waiting": 1})
    for _ in range(4):
        clock.advance(2)
        await scaler.tick(fence)
    view = (await cp.http.get(f"/v1/deployments/{MODEL}", headers=cp.admin)).json()
    assert (view["desired_prefill_replicas"], view["desired_replicas"]) == (1, 4)  # 8 in flight / 2
    pools = {(d["inputs"]["pool"], d["desired"]) for d in await decisions(cp)}
    assert ("prefill", 4) in pools and ("prefill", 1) in pools and ("decode", 4) in pools


async def autoscaler_status(cp: ControlPlane, **params: str) -> list[dict[str, Any]]:
    return await cp.admin_list("/v1/autoscaler/status", **params)


@loops_off
async def test_the_status_shows_each_pools_counts_and_its_last_decision(cp: ControlPlane) -> None:
    await setup_deployment(cp)
    topology = {"target_waiting_prompt_tokens": 1000, "min_prefill_replicas": 1, "max_prefill_replicas": 4}
    r = await cp.http.put("/v1/deployments/rag", headers=cp.admin,
                          json={"min_replicas": 1, "max_replicas": 3, "disaggregation": topology})
    assert r.status_code == 201, r.text
    transfer = {"connector": "NixlConnector", "endpoint": "10.0.0.7:5600", "lease_s": 30}
    assert (await cp.register("p1", models=["rag"], role="prefill", kv_transfer=transfer)).status_code == 200
    await cp.heartbeat("p1", load={"running": 1, "waiting": 9, "waiting_prompt_tokens": 3500})
    # Nothing decided yet: the counts, and no decision.
    before = {(s["model"], s["pool"]): s for s in await autoscaler_status(cp)}
    assert set(before) == {("rag", "decode"), ("rag", "prefill"), (MODEL, "both")}
    assert before[(MODEL, "both")]["last_decision"] is None

    assert (await cp.heartbeat("n1", load={"running": 4, "waiting": 2})).status_code == 200
    await Autoscaler(cp.app.state.ctx).tick(lead(cp))
    (mine,) = await autoscaler_status(cp, model=MODEL)
    assert (mine["min_replicas"], mine["max_replicas"], mine["ready"], mine["desired"]) == (0, 5, 1, 3)
    assert mine["last_decision"]["reason"].startswith("0 → 3; stable: 6.0 in flight")
    # A disaggregated deployment: each pool with its own bounds, count and last decision.
    rag = {s["pool"]: s for s in await autoscaler_status(cp, model="rag")}
    assert (rag["prefill"]["min_replicas"], rag["prefill"]["max_replicas"], rag["prefill"]["ready"]) == (1, 4, 1)
    assert (rag["prefill"]["desired"], rag["prefill"]["last_decision"]["desired"]) == (4, 4)
    assert rag["prefill"]["last_decision"]["reason"].startswith("prefill ")
    assert (rag["decode"]["min_replicas"], rag["decode"]["ready"], rag["decode"]["desired"]) == (1, 0, 1)
    assert rag["decode"]["last_decision"]["inputs"]["pool"] == "decode"


@loops_off
async def test_other_zones_nodes_are_neither_replicas_nor_load_of_a_zoned_deployment(
    cp: ControlPlane, clock: ManualClock
) -> None:
    autoscaling = {"target_concurrency": 2, "stable_window_s": 6, "panic_threshold_pct": 1000,
                   "scale_down_delay_s": 0, "max_scale_down_rate": 100}
    r = await cp.http.put(f"/v1/deployments/{MODEL}", headers=cp.admin,
                          json={"zone": "eu", "min_replicas": 1, "max_replicas": 4, "autoscaling": autoscaling})
    assert r.status_code == 201, r.text
    for node, region, running in (("us", "aws:us-east-1", 8), ("eu", "gcp:europe-west4", 0),
                                  ("apac", "onprem:tokyo-1", 8)):
        assert (await cp.register(node, region=region, models=[MODEL])).status_code == 200
        assert (await cp.heartbeat(node, load={"running": running, "waiting": 0})).status_code == 200
    scaler = Autoscaler(cp.app.state.ctx)
    fence = lead(cp)
    await scaler.tick(fence)
    # The us and apac nodes are busy with their own zones' tenants: no reason to scale eu up.
    assert await desired(cp) == 1
    (first,) = await decisions(cp)
    assert (first["inputs"]["ready"], first["inputs"]["avg_concurrency_stable"]) == (1, 0)

    # The eu replica goes (draining, then lost): the zone has none, whatever us and apac run.
    assert (await cp.heartbeat("eu", status="draining")).status_code == 200
    clock.advance(cp.settings.autoscale_hold_record_s)
    await scaler.tick(fence)
    last = (await decisions(cp))[-1]
    assert (last["inputs"]["ready"], last["desired"]) == (0, 1)
    assert last["reason"].startswith("hold at 1; 0 of 1 ready;")


@loops_off
async def test_requests_held_at_the_routers_scale_a_deployment_its_nodes_show_as_just_full(
    cp: ControlPlane, clock: ManualClock
) -> None:
    """Flow control keeps node queues short: the nodes report a full batch and nothing waiting,
    the backlog is at the routers. Their reports are load; without them nothing would grow."""
    await setup_deployment(cp)  # target 2 per replica
    assert (await cp.heartbeat("n1", load={"running": 2, "waiting": 0})).status_code == 200
    scaler = Autoscaler(cp.app.state.ctx)
    fence = lead(cp)
    await scaler.tick(fence)
    assert await desired(cp) == 1  # exactly full, by the nodes
    for router_id, waiting in (("router-a:8080:1", 5), ("router-b:8080:2", 3)):
        r = await cp.http.put(f"/v1/routers/{router_id}/backlog", headers=cp.internal,
                              json={"pools": [{"zone": "global", "model": MODEL, "waiting": waiting}]})
        assert r.status_code == 204, r.text
    clock.advance(2)
    await scaler.tick(fence)
    # ceil((2 running + 8 held) / 2): the stable window's mean of 2 and 10 is 6, so 3 now.
    last = (await decisions(cp))[-1]
    assert last["inputs"]["router_waiting"] == 8
    assert await desired(cp) == 3
    # The routers' queues empty: nothing more is held, and the next decision has no router load.
    for router_id in ("router-a:8080:1", "router-b:8080:2"):
        r = await cp.http.put(f"/v1/routers/{router_id}/backlog", headers=cp.internal, json={"pools": []})
        assert r.status_code == 204
    clock.advance(cp.settings.autoscale_hold_record_s)
    await scaler.tick(fence)
    assert "router_waiting" not in (await decisions(cp))[-1]["inputs"]
