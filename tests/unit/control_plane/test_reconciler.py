"""The reconciler against a real control plane (SQLite and Postgres) and the on-prem driver:
plans become node groups, scale-downs drain first, failures back off, deposed leaders are fenced."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cp_harness import ControlPlane
from sqlalchemy import select, update

from control_plane.context import AppContext
from control_plane.db.models import AuditEntry, Deployment, NodeGroup, PlacementPlan, ReconcileStep
from control_plane.leader import FLEET, Deposed, Fence, claim
from control_plane.reconcile_state import (
    GroupRow,
    NodeGroupState,
    NodeSeen,
    PlacedGroup,
    Snapshot,
    apportion,
    deployment_targets,
    parse_assignments,
    reconciler_status,
    spread_replicas,
    target_sizes,
)
from control_plane.reconciler import Reconciler, StepResult, default_drivers
from meridian.admin_api import ReconcilerState
from meridian.clock import ManualClock
from meridian.contracts import NodeRole
from providers.onprem.driver import OnPremDriver

MODEL = "tiny-llama"
REGION = "onprem:lab-1"
HOST_TYPE = "l4-box"
INVENTORY = """
sites:
  - name: lab-1
    latitude: 50.1
    longitude: 8.7
    zones: [eu]
    hosts:
      - {instance_type: l4-box, sku: L4-24GB, gpu_count: 1, count: 2, vcpus: 8, memory_gib: 32}
"""
DRAIN_TIMEOUT_S = 30.0


@pytest.fixture
def settings_overrides(tmp_path: Path) -> dict[str, Any]:
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(INVENTORY)
    # The loops stay off: each test drives the reconciler itself, under a fence of its own.
    return {
        "onprem_inventory": inventory,
        "reconciler_enabled": False,
        "autoscaler_enabled": False,
        # Long enough that a loaded CI machine ticks again well inside a backoff.
        "reconcile_backoff_base_s": 1.0,
        "reconcile_backoff_max_s": 2.5,
        "reconcile_drain_timeout_s": DRAIN_TIMEOUT_S,
    }


@pytest.fixture
def clock_kind() -> str:
    # The app (and so the reconciler) runs on a ManualClock: drain timeouts and backoffs are
    # passed by moving it.
    return "manual"


def ctx_of(cp: ControlPlane) -> AppContext:
    ctx: AppContext = cp.app.state.ctx
    return ctx


def lead(ctx: AppContext, holder: str = "test") -> Fence:
    """Become the leader (a new epoch), as an elector's acquisition does."""
    with ctx.write() as session:
        return Fence(FLEET, claim(session, FLEET, holder, datetime.now(UTC), None))


def reconciler(cp: ControlPlane) -> Reconciler:
    return Reconciler(ctx_of(cp), default_drivers(cp.settings.onprem_inventory))


async def deploy(cp: ControlPlane, *, replicas: int, max_replicas: int = 4) -> None:
    body = {"min_replicas": 0, "max_replicas": max_replicas}
    r = await cp.http.put(f"/v1/deployments/{MODEL}", json=body, headers=cp.admin)
    assert r.status_code == 201, r.text
    set_desired(cp, replicas)


def set_desired(cp: ControlPlane, replicas: int) -> None:
    with ctx_of(cp).write() as session:
        session.execute(update(Deployment).where(Deployment.model == MODEL).values(desired_replicas=replicas))


def assignment(*, instances: int = 1, replicas: int = 1, **fields: Any) -> dict[str, Any]:
    """A plan row placing MODEL on the lab's hosts (control_plane.placement.problem.Assignment as JSON)."""
    return {
        "deployment": MODEL, "region": REGION, "instance_type": HOST_TYPE, "sku": "L4-24GB",
        "instances": instances, "replicas": replicas, "spot": False, "cost_per_hour": 0.0, **fields,
    }


def apply_plan(cp: ControlPlane, *, instances: int = 1, replicas: int = 1, rows: list[dict[str, Any]] | None = None) -> str:
    """Store an applied plan (as the placement API's apply leaves it) placing MODEL on the lab's hosts."""
    now = datetime.now(UTC)
    plan_id = str(uuid.uuid4())
    assignments = rows if rows is not None else [assignment(instances=instances, replicas=replicas)]
    with ctx_of(cp).write() as session:
        session.add(PlacementPlan(
            id=plan_id, status="applied", base_plan_id=None, cost_per_hour=0.0, assignments=assignments,
            diff={}, explanation=None, solve_seconds=0.01, created_at=now, created_by="test",
            applied_at=now, applied_by="test",
        ))
    return plan_id


def supersede(cp: ControlPlane, plan_id: str) -> None:
    with ctx_of(cp).write() as session:
        session.execute(update(PlacementPlan).where(PlacementPlan.id == plan_id).values(status="superseded"))


def summary(results: list[StepResult]) -> list[tuple[str, int, str]]:
    return [(r.action, r.target, r.outcome) for r in results]


async def groups(cp: ControlPlane) -> list[dict[str, Any]]:
    return await cp.admin_list("/v1/node-groups", model=MODEL)


async def steps(cp: ControlPlane) -> list[dict[str, Any]]:
    return list(reversed(await cp.admin_list("/v1/reconciler/steps", model=MODEL)))  # oldest first


async def node_status(cp: ControlPlane) -> dict[str, str]:
    r = await cp.http.get("/v1/nodes", headers=cp.admin)
    return {n["node_id"]: n["status"] for n in r.json()}


# --- target computation (pure) -------------------------------------------------------------


def test_desired_replicas_spread_over_the_plans_groups() -> None:
    plan = [
        PlacedGroup(MODEL, "aws:us-east-1", "p5.48xlarge", "H100-80GB-SXM", False, 2, 4),
        PlacedGroup(MODEL, "gcp:europe-west4", "a3-highgpu-8g", "H100-80GB-SXM", False, 1, 2),
        PlacedGroup(MODEL, "onprem:tokyo-1", "dgx-h100", "H100-80GB-SXM", False, 1, 2),
    ]
    assert apportion(5, [1, 1, 1]) == [2, 2, 1]
    assert apportion(0, [1, 2]) == [0, 0]
    assert sum(spread_replicas(8, plan).values()) == 8
    assert spread_replicas(8, plan)[plan[0].key] == 4  # the baseline shape, at the baseline count
    # Every placed region keeps a replica while there are at least as many replicas as regions.
    assert sorted(spread_replicas(3, plan).values()) == [1, 1, 1]
    assert sorted(spread_replicas(4, plan).values()) == [1, 1, 2]
    assert sum(spread_replicas(2, plan).values()) == 2
    assert set(spread_replicas(0, plan).values()) == {0}
    # Nodes: replicas ÷ replicas per node (2 per node in every group here), rounded up.
    assert target_sizes(8, plan) == {plan[0].key: 2, plan[1].key: 1, plan[2].key: 1}
    assert target_sizes(3, plan) == {plan[0].key: 1, plan[1].key: 1, plan[2].key: 1}
    assert target_sizes(0, plan) == {g.key: 0 for g in plan}


def test_assignments_of_one_group_are_merged() -> None:
    rows = [
        {"deployment": MODEL, "region": REGION, "instance_type": HOST_TYPE, "sku": "L4-24GB", "instances": 1,
         "replicas": 1},
        {"deployment": MODEL, "region": REGION, "instance_type": HOST_TYPE, "sku": "L4-24GB", "instances": 2,
         "replicas": 2},
        {"region": REGION},
    ]
    (group,) = parse_assignments(rows)
    assert (group.instances, group.replicas, group.spot, group.role) == (3, 3, False, NodeRole.BOTH)


def test_a_disaggregated_plans_pools_are_groups_of_their_own() -> None:
    rows = [
        assignment(instances=1, replicas=1, role="prefill"),
        assignment(instances=2, replicas=2, role="decode"),
        assignment(instances=1, replicas=1, role="decode"),
        assignment(instances=1, replicas=1, role="sidecar"),  # a role this version does not know
    ]
    prefill, decode = parse_assignments(rows)
    assert (prefill.role, prefill.instances) == (NodeRole.PREFILL, 1)
    assert (decode.role, decode.instances) == (NodeRole.DECODE, 3)
    assert prefill.key != decode.key


def test_each_pool_is_spread_over_its_own_groups() -> None:
    east, tokyo = "aws:us-east-1", "onprem:tokyo-1"
    plan = [
        PlacedGroup(MODEL, east, "p5.48xlarge", "H100-80GB-SXM", False, 1, 1, NodeRole.PREFILL),
        PlacedGroup(MODEL, east, "p5.48xlarge", "H100-80GB-SXM", False, 2, 2, NodeRole.DECODE),
        PlacedGroup(MODEL, tokyo, "dgx-h100", "H100-80GB-SXM", False, 1, 1, NodeRole.PREFILL),
        PlacedGroup(MODEL, tokyo, "dgx-h100", "H100-80GB-SXM", False, 1, 1, NodeRole.DECODE),
    ]
    p_east, d_east, p_tokyo, d_tokyo = (g.key for g in plan)
    # desired_replicas (5) is the decode pool's, desired_prefill_replicas (2) the prefill pool's;
    # every region keeps one of each while the counts allow.
    assert deployment_targets(5, 2, plan) == {p_east: 1, p_tokyo: 1, d_east: 3, d_tokyo: 2}
    assert deployment_targets(2, 4, plan) == {p_east: 2, p_tokyo: 2, d_east: 1, d_tokyo: 1}
    # A prefill count not set yet: the plan's own prefill replicas.
    assert deployment_targets(3, None, plan) == {p_east: 1, p_tokyo: 1, d_east: 2, d_tokyo: 1}
    # A co-located deployment's groups get desired_replicas, as before.
    both = [PlacedGroup(MODEL, east, "p5.48xlarge", "H100-80GB-SXM", False, 2, 2)]
    assert deployment_targets(3, None, both) == target_sizes(3, both) == {both[0].key: 3}


def test_a_plan_is_in_force_only_when_every_group_holds_its_target() -> None:
    placed = PlacedGroup(MODEL, REGION, HOST_TYPE, "L4-24GB", False, 2, 2)
    east = PlacedGroup(MODEL, "aws:us-east-1", "g5.xlarge", "A10G-24GB", False, 1, 1)
    at = datetime(2026, 11, 28, 9, 0, tzinfo=UTC)

    def row(group: PlacedGroup, nodes: tuple[str, ...], **fields: Any) -> GroupRow:
        values: dict[str, Any] = {"state": NodeGroupState.READY, "failures": 0, **fields}
        return GroupRow(id=f"g-{group.region}", model=MODEL, provider=group.provider, region=group.region,
                        instance_type=group.instance_type, sku=group.sku, spot=False, desired_size=2,
                        current_size=len(nodes), nodes=nodes, retry_at=None, updated_at=at, **values)

    def snapshot(targets: dict[Any, int], rows: list[GroupRow], plan_id: str | None = "p1") -> Snapshot:
        ready = {"lab-1": NodeSeen("ready", 0, at), "lab-2": NodeSeen("starting", 0, at)}
        return Snapshot(placed={placed.key: placed, east.key: east}, targets=targets,
                        groups={r.key: r for r in rows}, drains={}, nodes=ready, plan_id=plan_id)

    nothing = reconciler_status(snapshot({}, [], plan_id=None))
    assert (nothing.state, nothing.groups) == (ReconcilerState.NO_PLAN, [])

    # Applied, not created yet: reconciling, the group shown with no id and no nodes.
    pending = reconciler_status(snapshot({placed.key: 2}, []))
    assert pending.state is ReconcilerState.RECONCILING and pending.plan_id == "p1"
    (g,) = pending.groups
    assert (g.group_id, g.desired, g.actual, g.ready, g.state, g.provider) == (None, 2, 0, 0, None, "onprem")
    assert pending.summary == "node groups at their target: 0 of 1 (nodes: 0 of 2)"

    done = reconciler_status(snapshot({placed.key: 2}, [row(placed, ("lab-1", "lab-2"))]))
    assert done.state is ReconcilerState.IN_FORCE
    assert (done.groups[0].actual, done.groups[0].ready) == (2, 1)  # lab-2 is still starting
    assert done.summary == "every node group at its target (1 group, 2 nodes)"

    # One group at its target, one failing: the whole is failing, with the error and when.
    error = "UnknownName: this control plane has no driver for provider 'aws'"
    failing = reconciler_status(snapshot(
        {placed.key: 2, east.key: 1},
        [row(placed, ("lab-1", "lab-2")), row(east, (), last_error=error, failures=3, state=NodeGroupState.ERROR)],
    ))
    assert failing.state is ReconcilerState.FAILING
    assert failing.summary == f"{MODEL}@aws:us-east-1/g5.xlarge: {error}"
    bad = next(g for g in failing.groups if g.region == "aws:us-east-1")
    assert (bad.desired, bad.actual, bad.failures, bad.error_at, bad.state) == (1, 0, 3, at, "error")

    # A group the plan dropped still counts until it is gone.
    leaving = reconciler_status(snapshot({placed.key: 2}, [row(placed, ("lab-1", "lab-2")), row(east, ("i-1",))]))
    assert leaving.state is ReconcilerState.RECONCILING
    assert [(g.region, g.desired, g.actual) for g in leaving.groups] == [
        ("aws:us-east-1", 0, 1), (REGION, 2, 2),
    ]


# --- against the database ------------------------------------------------------------------


async def test_an_applied_plan_creates_node_groups_and_sizes_them(cp: ControlPlane) -> None:
    await deploy(cp, replicas=2)
    apply_plan(cp)
    fence = lead(ctx_of(cp))
    rec = reconciler(cp)

    assert summary(await rec.tick(fence)) == [("create", 2, "ok"), ("scale_up", 2, "ok")]
    (group,) = await groups(cp)
    assert group["nodes"] == ["lab-1-l4-box-1", "lab-1-l4-box-2"]
    assert (group["current_size"], group["desired_size"], group["state"]) == (2, 2, "ready")
    assert (group["provider"], group["region"], group["sku"], group["gpus_per_node"]) == ("onprem", REGION, "L4-24GB", 1)
    assert [(s["action"], s["outcome"], s["epoch"]) for s in await steps(cp)] == [
        ("create", "ok", fence.epoch), ("scale_up", "ok", fence.epoch),
    ]
    with ctx_of(cp).read() as session:
        entries = session.scalars(select(AuditEntry).where(AuditEntry.resource_type == "node_group")).all()
        assert [(e.actor_id, e.action) for e in entries] == [
            ("system:reconciler", "create"), ("system:reconciler", "scale_up"),
        ]
        assert entries[1].after is not None and entries[1].after["current_size"] == 2

    # Idempotent: nothing left to do.
    assert await rec.tick(fence) == []
    # A new leader (a fresh driver, as in another process) adopts the recorded hosts.
    successor = reconciler(cp)
    assert await successor.tick(lead(ctx_of(cp), "successor")) == []
    assert (await groups(cp))[0]["nodes"] == ["lab-1-l4-box-1", "lab-1-l4-box-2"]


async def test_desired_zero_drains_nodes_then_scales_down(cp: ControlPlane, clock: ManualClock) -> None:
    await deploy(cp, replicas=2)
    plan_id = apply_plan(cp)
    fence = lead(ctx_of(cp))
    rec = reconciler(cp)
    await rec.tick(fence)
    for node in ("lab-1-l4-box-1", "lab-1-l4-box-2"):
        assert (await cp.register(node, region=REGION, models=[MODEL])).status_code == 200
    assert (await cp.heartbeat("lab-1-l4-box-1", load={"running": 2, "waiting": 1})).status_code == 200
    assert (await cp.heartbeat("lab-1-l4-box-2")).status_code == 200
    version = await cp.version()

    set_desired(cp, 0)
    assert summary(await rec.tick(fence)) == [("drain", 0, "pending")]
    # Routers see both draining at once; the hosts are still in the group.
    assert await cp.version() > version
    assert await node_status(cp) == {"lab-1-l4-box-1": "draining", "lab-1-l4-box-2": "draining"}
    (group,) = await groups(cp)
    assert (group["state"], group["current_size"], group["draining"]) == (
        "draining", 2, ["lab-1-l4-box-1", "lab-1-l4-box-2"],
    )
    # No heartbeat since the drain began: nothing is known to be idle yet.
    assert await rec.tick(fence) == []

    # A heartbeat reporting "ready" cannot undo the drain; an idle one lets the node go.
    assert (await cp.heartbeat("lab-1-l4-box-2", load={"running": 0, "waiting": 0})).status_code == 200
    assert (await cp.heartbeat("lab-1-l4-box-1", load={"running": 1, "waiting": 0})).status_code == 200
    assert (await node_status(cp))["lab-1-l4-box-2"] == "draining"
    assert summary(await rec.tick(fence)) == [("scale_down", 0, "ok")]
    (group,) = await groups(cp)
    assert group["nodes"] == ["lab-1-l4-box-1"]
    # The busy node is removed when the drain timeout passes.
    assert await rec.tick(fence) == []
    clock.advance(DRAIN_TIMEOUT_S)
    assert summary(await rec.tick(fence)) == [("scale_down", 0, "ok")]
    (group,) = await groups(cp)
    assert (group["current_size"], group["nodes"], group["state"]) == (0, [], "ready")
    removals = [s for s in await steps(cp) if s["action"] == "scale_down"]
    assert removals[0]["detail"] == "removed lab-1-l4-box-2"
    assert "drain timed out" in removals[1]["detail"]
    # Removed nodes stay out of routing.
    assert (await cp.heartbeat("lab-1-l4-box-1")).status_code == 200
    assert (await node_status(cp))["lab-1-l4-box-1"] == "draining"

    # The plan no longer places it: the empty group is deleted.
    supersede(cp, plan_id)
    assert summary(await rec.tick(fence)) == [("delete", 0, "ok")]
    assert await groups(cp) == []


async def test_a_rising_target_cancels_a_drain(cp: ControlPlane) -> None:
    await deploy(cp, replicas=2)
    apply_plan(cp)
    fence = lead(ctx_of(cp))
    rec = reconciler(cp)
    await rec.tick(fence)
    for node, running in (("lab-1-l4-box-1", 5), ("lab-1-l4-box-2", 3)):
        assert (await cp.register(node, region=REGION, models=[MODEL])).status_code == 200
        assert (await cp.heartbeat(node, load={"running": running})).status_code == 200
    set_desired(cp, 1)
    assert summary(await rec.tick(fence)) == [("drain", 1, "pending")]
    # The least busy node goes.
    assert await node_status(cp) == {"lab-1-l4-box-1": "ready", "lab-1-l4-box-2": "draining"}
    set_desired(cp, 2)
    assert summary(await rec.tick(fence)) == [("undrain", 2, "ok")]
    assert (await cp.heartbeat("lab-1-l4-box-2")).status_code == 200
    assert (await node_status(cp))["lab-1-l4-box-2"] == "ready"
    assert (await groups(cp))[0]["draining"] == []


async def test_a_failing_step_is_retried_with_backoff_and_recorded(cp: ControlPlane, clock: ManualClock) -> None:
    await deploy(cp, replicas=3)  # the lab has 2 hosts
    apply_plan(cp)
    fence = lead(ctx_of(cp))
    rec = reconciler(cp)

    assert summary(await rec.tick(fence)) == [("create", 3, "ok"), ("scale_up", 3, "error")]
    (group,) = await groups(cp)
    assert (group["state"], group["failures"], group["current_size"]) == ("error", 1, 0)
    assert "CapacityError" in group["last_error"]
    failed = (await steps(cp))[-1]
    assert (failed["attempt"], failed["outcome"]) == (1, "error")
    assert "2 free l4-box host(s)" in failed["error"]
    first_retry = datetime.fromisoformat(failed["next_attempt_at"])
    assert 0.5 < (first_retry - datetime.fromisoformat(failed["at"])).total_seconds() <= 1.25

    # Backing off: nothing is tried before next_attempt_at.
    assert await rec.tick(fence) == []
    clock.advance((first_retry - clock.now()).total_seconds() + 0.05)
    assert summary(await rec.tick(fence)) == [("scale_up", 3, "error")]
    second = (await steps(cp))[-1]
    assert second["attempt"] == 2
    # The delay doubles (1 s, then 2 s; ±20% jitter).
    gap = (datetime.fromisoformat(second["next_attempt_at"]) - datetime.fromisoformat(second["at"])).total_seconds()
    assert 1.5 < gap <= 2.5

    # The autoscaler settles for what fits: the next attempt succeeds and clears the failures.
    set_desired(cp, 2)
    clock.advance(gap + 0.05)
    assert summary(await rec.tick(fence)) == [("scale_up", 2, "ok")]
    (group,) = await groups(cp)
    assert (group["state"], group["failures"], group["current_size"], group["last_error"]) == ("ready", 0, 2, None)
    assert (await steps(cp))[-1]["attempt"] == 3
    with ctx_of(cp).read() as session:
        actions = session.scalars(select(AuditEntry.action).where(AuditEntry.resource_type == "node_group")).all()
        assert list(actions) == ["create", "scale_up", "scale_up", "scale_up"]


async def test_a_deposed_leaders_write_is_refused(cp: ControlPlane) -> None:
    await deploy(cp, replicas=1)
    apply_plan(cp)
    old = lead(ctx_of(cp), "old")
    new = lead(ctx_of(cp), "new")
    assert new.epoch == old.epoch + 1

    with pytest.raises(Deposed):
        await reconciler(cp).tick(old)
    with ctx_of(cp).read() as session:
        assert session.scalars(select(NodeGroup)).all() == []
        assert session.scalars(select(ReconcileStep)).all() == []

    assert summary(await reconciler(cp).tick(new)) == [("create", 1, "ok"), ("scale_up", 1, "ok")]


async def test_a_disaggregated_deployment_gets_a_prefill_and_a_decode_group_in_their_roles(cp: ControlPlane) -> None:
    body = {"min_replicas": 0, "max_replicas": 2,
            "disaggregation": {"prefill_per_decode": 1.0, "min_prefill_replicas": 0, "max_prefill_replicas": 2}}
    r = await cp.http.put(f"/v1/deployments/{MODEL}", json=body, headers=cp.admin)
    assert r.status_code == 201, r.text
    set_desired(cp, 1)
    set_desired_prefill(cp, 1)
    apply_plan(cp, rows=[assignment(role="prefill"), assignment(role="decode")])
    drivers = default_drivers(cp.settings.onprem_inventory)
    rec = Reconciler(ctx_of(cp), drivers)
    fence = lead(ctx_of(cp))

    assert summary(await rec.tick(fence)) == [("create", 1, "ok"), ("scale_up", 1, "ok")] * 2
    by_role = {g["role"]: g for g in await groups(cp)}
    assert set(by_role) == {"prefill", "decode"}
    assert by_role["prefill"]["nodes"] != by_role["decode"]["nodes"]
    # Each group's host starts its node agent in the group's role.
    onprem = drivers.get_driver("onprem")
    assert isinstance(onprem, OnPremDriver)
    for role, group in by_role.items():
        (host,) = group["nodes"]
        assert onprem.host_env(host)["MERIDIAN_NODE_ROLE"] == role
    assert await rec.tick(fence) == []

    # The prefill pool scales on its own count; the decode pool is left alone.
    # (Its host never registered, so it is drained at once.)
    set_desired_prefill(cp, 0)
    assert summary(await rec.tick(fence)) == [("drain", 0, "pending"), ("scale_down", 0, "ok")]
    after = {g["role"]: g for g in await groups(cp)}
    assert (after["prefill"]["desired_size"], after["prefill"]["nodes"]) == (0, [])
    assert (after["decode"]["desired_size"], after["decode"]["nodes"]) == (1, by_role["decode"]["nodes"])


def set_desired_prefill(cp: ControlPlane, replicas: int) -> None:
    with ctx_of(cp).write() as session:
        session.execute(update(Deployment).where(Deployment.model == MODEL).values(desired_prefill_replicas=replicas))


# --- where the reconciler stands: GET /v1/reconciler/status --------------------------------

# A model small enough for the lab's one-L4 hosts.
SMALL_MODEL = {"params_b": 0.5, "layers": 24, "kv_heads": 2, "head_dim": 64, "max_context": 2048,
               "target_concurrent_seqs": 4}


async def reconcile_status(cp: ControlPlane) -> dict[str, Any]:
    r = await cp.http.get("/v1/reconciler/status", headers=cp.admin)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_a_plan_previewed_and_applied_here_is_carried_out_and_called_in_force_once_it_is(cp: ControlPlane) -> None:
    assert (await cp.http.put(f"/v1/models/{MODEL}", json=SMALL_MODEL, headers=cp.admin)).status_code == 201
    body = {"zone": "eu", "min_replicas": 2, "max_replicas": 2, "placement": {"min_regions": 1}}
    assert (await cp.http.put(f"/v1/deployments/{MODEL}", json=body, headers=cp.admin)).status_code == 201
    assert (await reconcile_status(cp))["state"] == "no_plan"

    # Only on-prem's driver runs here: the plan is on the lab's hosts, never on aws or gcp.
    r = await cp.http.post("/v1/placement/plans", json={"time_limit_s": 10}, headers=cp.admin)
    plan = r.json()
    assert plan["status"] == "preview", plan["explanation"]
    assert {a["region"] for a in plan["assignments"]} == {REGION}
    r = await cp.http.post(f"/v1/placement/plans/{plan['id']}/apply", headers=cp.admin)
    assert r.status_code == 200, r.text

    # Applied is not yet in force: the group has no node until the reconciler has acted.
    status = await reconcile_status(cp)
    assert (status["state"], status["plan_id"]) == ("reconciling", plan["id"])
    assert [(g["region"], g["group_id"], g["desired"], g["actual"]) for g in status["groups"]] == [(REGION, None, 2, 0)]

    rec = reconciler(cp)
    fence = lead(ctx_of(cp))
    assert [r.outcome for r in await rec.tick(fence)] == ["ok", "ok"]
    status = await reconcile_status(cp)
    assert status["state"] == "in_force", status
    (group,) = status["groups"]
    assert (group["desired"], group["actual"], group["last_error"], group["state"]) == (2, 2, None, "ready")
    assert await rec.tick(fence) == []


async def test_a_group_no_driver_can_create_fails_clearly_until_a_plan_drops_it(
    cp: ControlPlane, clock: ManualClock
) -> None:
    # A plan applied before aws's driver was turned off: its aws group can never be created.
    await deploy(cp, replicas=2)
    east = assignment(region="aws:us-east-1", instance_type="g5.xlarge", sku="A10G-24GB")
    first = apply_plan(cp, rows=[assignment(), east])
    rec = reconciler(cp)
    fence = lead(ctx_of(cp))
    assert sorted(summary(await rec.tick(fence))) == [("create", 1, "error"), ("create", 1, "ok"), ("scale_up", 1, "ok")]

    status = await reconcile_status(cp)
    assert status["state"] == "failing"
    assert "no driver for provider 'aws' (MERIDIAN_PROVIDER_ENABLED: onprem)" in status["summary"]
    failing = next(g for g in status["groups"] if g["region"] == "aws:us-east-1")
    assert (failing["desired"], failing["actual"], failing["state"], failing["failures"]) == (1, 0, "error", 1)
    # Retrying cannot help: it waits the longest backoff (2.5 s here), not the first (1 s).
    waited = datetime.fromisoformat(failing["retry_at"]) - datetime.fromisoformat(failing["error_at"])
    assert waited.total_seconds() == 2.5

    # A plan without aws: its row goes on the next tick, backoff or not, and the lab's group takes
    # both replicas; then the plan is in force.
    supersede(cp, first)
    apply_plan(cp, rows=[assignment()])
    assert summary(await rec.tick(fence)) == [("delete", 0, "ok"), ("scale_up", 2, "ok")]
    status = await reconcile_status(cp)
    assert status["state"] == "in_force", status
    assert [(g["region"], g["actual"]) for g in status["groups"]] == [(REGION, 2)]
