"""A fourth provider, registered with one call, is a provider like the built-in three: it is in
`meridian catalog gpus`, in the control plane's providers, regions and routing table, in
placement plans once its driver is enabled, and its node-group driver is among the control
plane's drivers.

"lattice" is an in-test stand-in: two regions in a residency zone of their own ("is"), an
8×H100 offering in each, no quotas, and a node-group driver that keeps its groups in memory.
Nothing outside this file knows it; `PROVIDERS.register_provider` is the only call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from cp_harness import ControlPlane
from typer.testing import CliRunner

from chaos.drill import Target
from cli.main import app as cli_app
from control_plane.reconciler import default_drivers
from meridian.contracts import RegionInfo
from meridian.settings.providers import ProviderSettings
from providers.driver import GroupSpec, GroupState, NodeGroupDriver, PreemptionNotice
from providers.offerings import Offering
from providers.provider import PROVIDERS, Provider, ProviderConfig, ProviderDescription, Quota

NAME = "lattice"
ZONE = "is"
SKU = "H100-80GB-SXM"
INSTANCE_TYPE = "lx-h100x8"
SITES = {"reykjavik-1": (64.1, -21.9), "akureyri-1": (65.7, -18.1)}
REGIONS = {f"{NAME}:{site}" for site in SITES}


def lattice_regions() -> list[RegionInfo]:
    return [
        RegionInfo(name=f"{NAME}:{site}", provider=NAME, location=site, zones=[ZONE], latitude=lat, longitude=lon)
        for site, (lat, lon) in SITES.items()
    ]


def lattice_offerings() -> list[Offering]:
    return [
        Offering(provider=NAME, region=f"{NAME}:{site}", instance_type=INSTANCE_TYPE, sku=SKU, gpu_count=8,
                 vcpus=208, memory_gib=1800, price_per_hour=16.0, spot_price_per_hour=None)
        for site in SITES
    ]


class LatticeDriver:
    """A stand-in node-group driver: groups are lists of node names in memory."""

    provider = NAME

    def __init__(self) -> None:
        self.groups: dict[str, list[str]] = {}

    def _state(self, spec: GroupSpec) -> GroupState:
        return GroupState(nodes=tuple(self.groups.get(spec.group_id, ())), gpus_per_node=8)

    async def ensure_group(self, spec: GroupSpec, known_nodes: Sequence[str] = ()) -> GroupState:
        self.groups.setdefault(spec.group_id, list(known_nodes))
        return self._state(spec)

    async def resize(self, spec: GroupSpec, size: int) -> GroupState:
        nodes = self.groups.setdefault(spec.group_id, [])
        nodes[:] = nodes[:size] + [f"{spec.group_id}-{i}" for i in range(len(nodes), size)]
        return self._state(spec)

    async def list_nodes(self, spec: GroupSpec) -> GroupState:
        return self._state(spec)

    async def terminate(self, spec: GroupSpec, node: str) -> GroupState:
        nodes = self.groups.get(spec.group_id, [])
        if node in nodes:
            nodes.remove(node)
        return self._state(spec)

    async def delete_group(self, spec: GroupSpec) -> None:
        self.groups.pop(spec.group_id, None)

    async def preemption_notices(self, spec: GroupSpec) -> list[PreemptionNotice]:
        return []


class LatticeProvider:
    name = NAME

    def __init__(self) -> None:
        self._driver = LatticeDriver()

    @classmethod
    def from_config(cls, config: ProviderConfig) -> LatticeProvider:
        return cls()

    def regions(self) -> list[RegionInfo]:
        return lattice_regions()

    def offerings(self) -> list[Offering]:
        return lattice_offerings()

    async def quotas(self, region: str) -> list[Quota]:
        return []

    def driver(self) -> NodeGroupDriver:
        return self._driver


@pytest.fixture(autouse=True)
def lattice() -> Iterator[None]:
    """Registered before the control plane starts (autouse fixtures come first), gone after."""
    PROVIDERS.register_provider(ProviderDescription.fixed(
        NAME, regions=lattice_regions, offerings=lattice_offerings, factory=LatticeProvider.from_config
    ))
    yield
    PROVIDERS.unregister(NAME)


@pytest.fixture
def settings_overrides() -> dict[str, Any]:
    # What is looked at here is read at start-up; the fleet loops stay off.
    return {"reconciler_enabled": False, "autoscaler_enabled": False}


@pytest.fixture
def provider_settings() -> ProviderSettings:
    # Its driver enabled, so that the control plane plans for it.
    return ProviderSettings(enabled=["onprem", NAME])


def catalog_gpus(*args: str) -> str:
    r = CliRunner().invoke(cli_app, ["catalog", "gpus", *args], env={"COLUMNS": "220"})
    assert r.exit_code == 0, r.output
    return r.output


def test_the_cli_catalog_lists_it() -> None:
    table = catalog_gpus()
    assert "lattice $/GPU-h" in table and "aws $/GPU-h" in table
    h100 = next(line for line in table.splitlines() if SKU in line)
    assert "$2.000" in h100  # 16 $/h over 8 GPUs
    assert "H100-80GB-SXM" in catalog_gpus("--provider", NAME)
    rows = [line for line in catalog_gpus(SKU, "--region", f"{NAME}:reykjavik-1").splitlines() if INSTANCE_TYPE in line]
    assert len(rows) == 1 and f"{NAME}:reykjavik-1" in rows[0]


def test_its_driver_is_built_and_drill_targets_may_name_it() -> None:
    assert isinstance(PROVIDERS.create(NAME, ProviderConfig(ProviderSettings())), Provider)
    drivers = default_drivers(None, ProviderSettings(enabled=["onprem", NAME]), providers=PROVIDERS)
    assert drivers.providers() == [NAME, "onprem"]
    assert isinstance(drivers.get_driver(NAME), LatticeDriver)
    assert Target(provider=NAME).provider == NAME
    with pytest.raises(ValueError, match=r"unknown provider 'azure'; known: aws, gcp, lattice, onprem"):
        Target(provider="azure")


async def test_the_control_plane_lists_it_and_routes_to_it(cp: ControlPlane) -> None:
    providers = (await cp.http.get("/v1/providers", headers=cp.admin)).json()
    assert [p["name"] for p in providers] == ["aws", "gcp", NAME, "onprem"]
    lattice = (await cp.http.get(f"/v1/providers/{NAME}", headers=cp.admin)).json()
    assert set(lattice["regions"]) == REGIONS and lattice["skus"] == [SKU]
    body = cp.assert_problem(await cp.http.get("/v1/providers/azure", headers=cp.admin), 404)
    assert "known: aws, gcp, lattice, onprem" in body["detail"]

    assert (await cp.register("lx-node-1", region=f"{NAME}:reykjavik-1")).status_code == 200
    assert (await cp.heartbeat("lx-node-1")).status_code == 200
    table = (await cp.table()).json()
    assert REGIONS <= {r["name"] for r in table["regions"]}
    assert [(n["node_id"], n["region"]) for n in table["nodes"]] == [("lx-node-1", f"{NAME}:reykjavik-1")]
    # A provider nobody registered has no regions: its nodes are refused.
    body = cp.assert_problem(await cp.register("az-node-1", region="azure:westeurope"), 400)
    assert "unknown region" in body["detail"]


async def test_placement_plans_use_it(cp: ControlPlane) -> None:
    model = {
        "params_b": 8.03, "layers": 32, "kv_heads": 8, "head_dim": 128, "attention_heads": 32,
        "hidden_size": 4096, "quantization": "bf16", "kv_cache_dtype": "bf16",
        "max_context": 8192, "target_concurrent_seqs": 16,
    }
    r = await cp.http.put("/v1/models/chat-8b", json=model, headers=cp.admin)
    assert r.status_code == 201, r.text
    # Zone "is" has the lattice regions alone, so residency puts every replica there.
    deployment = {"zone": ZONE, "min_replicas": 1, "max_replicas": 8,
                  "placement": {"demand": {f"{NAME}:reykjavik-1": 1500.0}, "rtt_objective_ms": 40}}
    r = await cp.http.put("/v1/deployments/chat-8b", json=deployment, headers=cp.admin)
    assert r.status_code == 201, r.text

    r = await cp.http.post("/v1/placement/plans", json={"time_limit_s": 10}, headers=cp.admin)
    assert r.status_code == 201, r.text
    plan = r.json()
    assert plan["status"] == "preview", plan["explanation"]
    assert {a["region"] for a in plan["assignments"]} == REGIONS  # active-active over both sites
    assert {(a["instance_type"], a["sku"]) for a in plan["assignments"]} == {(INSTANCE_TYPE, SKU)}
    r = await cp.http.post(f"/v1/placement/plans/{plan['id']}/apply", headers=cp.admin)
    assert r.status_code == 200 and r.json()["status"] == "applied", r.text
