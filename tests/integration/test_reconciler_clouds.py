"""The reconciler drives the cloud drivers end to end: AWS against moto's server, GCP against
the Compute Engine stand-in. A plan places a deployment; the reconciler creates and grows the
cloud's group; the instances' agents register; the plan shrinks; the reconciler drains a node
and only then removes it from the cloud; the plan drops the region and the group goes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from aws_moto import PREFIX, aws_client, make_network
from cp_harness import ADMIN_KEY, CLUSTER_TOKEN, ControlPlane
from gcp_compute_standin import ComputeStandIn, serving
from pydantic import SecretStr
from sqlalchemy import update

from control_plane.app import create_app
from control_plane.context import AppContext
from control_plane.db.models import Deployment, PlacementPlan
from control_plane.leader import FLEET, Fence, claim
from control_plane.reconciler import Reconciler, StepResult, default_drivers
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.providers import ProviderSettings
from providers.aws import naming as aws_naming
from providers.gcp import naming as gcp_naming

MODEL = "tiny-llama"


@dataclass
class Cloud:
    """One provider set up as iac would leave it, and a way to see its instances directly."""

    settings: ProviderSettings
    region: str
    instance_type: str
    sku: str
    instances: Callable[[], set[str]]  # the group's live instances, asked of the cloud's own API


@pytest.fixture(scope="module")
def gcp_standin() -> Iterator[ComputeStandIn]:
    standin = ComputeStandIn(project="meridian-e2e")
    with serving(standin):
        yield standin


@pytest.fixture(params=["aws", "gcp"])
def cloud(request: pytest.FixtureRequest) -> Cloud:
    if request.param == "aws":
        request.getfixturevalue("aws_env")
        endpoint: str = request.getfixturevalue("private_moto_server")
        make_network(endpoint, "us-east-1", {"us-east-1a": True, "us-east-1b": True}, [("g5.xlarge", False)])

        def aws_instances() -> set[str]:
            groups = aws_client(endpoint, "autoscaling", "us-east-1").describe_auto_scaling_groups()
            return {i["InstanceId"] for g in groups["AutoScalingGroups"] for i in g["Instances"]
                    if g["Tags"] and any(t["Key"] == aws_naming.MODEL_TAG and t["Value"] == MODEL for t in g["Tags"])
                    and i["LifecycleState"] in ("Pending", "InService")}

        settings = ProviderSettings(enabled=["aws"], aws_endpoint_url=endpoint, aws_name_prefix=PREFIX,
                                    call_timeout_s=10, operation_timeout_s=20)
        return Cloud(settings, "aws:us-east-1", "g5.xlarge", "A10G-24GB", aws_instances)
    standin: ComputeStandIn = request.getfixturevalue("gcp_standin")
    standin.reset()
    standin.set_quota("us-central1", "NVIDIA_L4_GPUS", 16)
    standin.add_template(gcp_naming.instance_template_name("meridian", "g2-standard-8", False), "g2-standard-8",
                         accelerator="NVIDIA_L4", gpus=1)

    def gcp_instances() -> set[str]:
        return {name for mig in standin.migs.values() for name, inst in mig.instances.items()
                if inst.deleting_since is None}

    settings = ProviderSettings(enabled=["gcp"], gcp_project="meridian-e2e", gcp_endpoint_url=standin.url,
                                call_timeout_s=10, operation_timeout_s=20)
    return Cloud(settings, "gcp:us-central1", "g2-standard-8", "L4-24GB", gcp_instances)


@pytest.fixture
async def cp(tmp_path: Path) -> AsyncIterator[ControlPlane]:
    settings = ControlPlaneSettings(
        database_url=f"sqlite:///{tmp_path / 'cp.db'}", cluster_token=SecretStr(CLUSTER_TOKEN),
        bootstrap_admin_key=SecretStr(ADMIN_KEY), reconciler_enabled=False, autoscaler_enabled=False,
        reconcile_drain_timeout_s=300,
    )
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://cp.test") as http:
            yield ControlPlane(app=app, http=http, settings=settings)


def ctx_of(cp: ControlPlane) -> AppContext:
    ctx: AppContext = cp.app.state.ctx
    return ctx


def apply_plan(cp: ControlPlane, cloud: Cloud, instances: int) -> str:
    """An applied plan placing MODEL on `instances` machines of the cloud (as the placement API leaves it)."""
    now = datetime.now(UTC)
    plan_id = str(uuid.uuid4())
    assignments = [] if instances == 0 else [{
        "deployment": MODEL, "region": cloud.region, "instance_type": cloud.instance_type, "sku": cloud.sku,
        "instances": instances, "replicas": instances, "spot": False, "cost_per_hour": 1.0,
    }]
    with ctx_of(cp).write() as session:
        session.execute(update(PlacementPlan).where(PlacementPlan.status == "applied").values(status="superseded"))
        session.add(PlacementPlan(
            id=plan_id, status="applied", base_plan_id=None, cost_per_hour=1.0, assignments=assignments, diff={},
            explanation=None, solve_seconds=0.01, created_at=now, created_by="test", applied_at=now,
            applied_by="test",
        ))
        session.execute(update(Deployment).where(Deployment.model == MODEL).values(desired_replicas=instances))
    return plan_id


def summary(results: list[StepResult]) -> list[tuple[str, int, str]]:
    return [(r.action, r.target, r.outcome) for r in results]


async def group_nodes(cp: ControlPlane) -> list[str]:
    r = await cp.http.get("/v1/node-groups", params={"model": MODEL}, headers=cp.admin)
    groups: list[dict[str, Any]] = r.json()
    return sorted(n for g in groups for n in g["nodes"])


async def test_plan_scale_up_nodes_appear_shrink_drain_scale_down(cp: ControlPlane, cloud: Cloud) -> None:
    r = await cp.http.put(f"/v1/deployments/{MODEL}", json={"min_replicas": 0, "max_replicas": 4},
                          headers=cp.admin)
    assert r.status_code == 201, r.text
    with ctx_of(cp).write() as session:
        fence = Fence(FLEET, claim(session, FLEET, "test", datetime.now(UTC), None))
    rec = Reconciler(ctx_of(cp), default_drivers(cp.settings.onprem_inventory, cloud.settings))

    # The plan places two machines: the cloud's group is created and grown to two.
    apply_plan(cp, cloud, 2)
    assert summary(await rec.tick(fence)) == [("create", 2, "ok"), ("scale_up", 2, "ok")]
    nodes = await group_nodes(cp)
    assert len(nodes) == 2 and set(nodes) == cloud.instances()

    # Their agents start (cloud-init) and register under the instance names the cloud gave.
    for node in nodes:
        assert (await cp.register(node, region=cloud.region, models=[MODEL])).status_code == 200
        assert (await cp.heartbeat(node, load={"running": 3, "waiting": 0})).status_code == 200
    assert await rec.tick(fence) == []

    # The plan shrinks to one machine: one node is drained first and stays in the cloud
    # while it still has requests in flight...
    apply_plan(cp, cloud, 1)
    assert summary(await rec.tick(fence)) == [("drain", 1, "pending")]
    statuses = {n["node_id"]: n["status"] for n in (await cp.http.get("/v1/nodes", headers=cp.admin)).json()}
    (draining,) = [n for n in nodes if statuses[n] == "draining"]
    assert await rec.tick(fence) == []
    assert cloud.instances() == set(nodes)
    # ...and is removed from the cloud once its heartbeat shows it idle.
    assert (await cp.heartbeat(draining, load={"running": 0, "waiting": 0})).status_code == 200
    assert summary(await rec.tick(fence)) == [("scale_down", 1, "ok")]
    (kept,) = [n for n in nodes if n != draining]
    assert await group_nodes(cp) == [kept]
    assert cloud.instances() == {kept}

    # The plan drops the region: the last node drains, goes, and the empty group is deleted.
    apply_plan(cp, cloud, 0)
    assert summary(await rec.tick(fence)) == [("drain", 0, "pending")]
    assert (await cp.heartbeat(kept, load={"running": 0, "waiting": 0})).status_code == 200
    assert summary(await rec.tick(fence)) == [("scale_down", 0, "ok")]
    assert summary(await rec.tick(fence)) == [("delete", 0, "ok")]
    assert await group_nodes(cp) == []
    assert cloud.instances() == set()
