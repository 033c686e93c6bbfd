"""The placement solver's input and output: deployments, offerings, quotas, the current plan, results.

Units: demand and replica throughput in generated tokens per second; capacity in GPUs per
(region, SKU); prices and costs in USD per hour; RTT in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from control_plane.placement.fit import ModelFit
from meridian.contracts import GLOBAL_ZONE, RegionInfo
from meridian.geo import Point, estimate_rtt_ms
from providers.offerings import Offering

DEFAULT_MIN_REGIONS = 2
DEFAULT_MIN_PROVIDERS = 2


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    """One replica of a deployment on one SKU: GPUs it takes (TP degree) and tokens/s it serves."""

    tp: int
    tokens_per_s: float

    def __post_init__(self) -> None:
        if self.tp < 1 or self.tokens_per_s <= 0:
            raise ValueError("a replica needs tp >= 1 and tokens_per_s > 0")


def shapes_from_fit(fit: ModelFit) -> dict[str, ReplicaShape]:
    """Per-SKU replica shapes (TP degree, decode tokens/s) of a model fit."""
    return {sku: ReplicaShape(f.tp, f.decode_tokens_per_s) for sku, f in fit.per_sku.items()}


@dataclass(frozen=True, slots=True)
class Deployment:
    """One model deployment to place.

    A replica in region r may serve client region c only when the estimated RTT(c, r) is
    within `rtt_objective_ms`; when the deployment has client regions, only regions that
    serve at least one of them are candidates at all (a far replica is no failover).
    `min_providers` None means 2 where the candidate regions span ≥ 2 providers, else as many
    as they span; an explicit value is a hard requirement.
    """

    name: str
    shapes: Mapping[str, ReplicaShape]  # SKU name → replica shape; SKUs the model fits on
    zone: str = GLOBAL_ZONE
    demand_tokens_per_s: Mapping[str, float] = field(default_factory=dict)  # client region → tokens/s
    min_replicas_near: Mapping[str, int] = field(default_factory=dict)  # client region → replicas within RTT
    rtt_objective_ms: float = 50.0
    min_regions: int = DEFAULT_MIN_REGIONS
    min_providers: int | None = None
    allowed_skus: frozenset[str] | None = None  # None: any SKU in shapes
    spot_allowed: bool = False
    # Prefill/decode disaggregated: each region it uses holds >= 2 instances (both pools).
    disaggregated: bool = False

    def __post_init__(self) -> None:
        if any(v < 0 for v in self.demand_tokens_per_s.values()) or any(
            v < 0 for v in self.min_replicas_near.values()
        ):
            raise ValueError(f"deployment {self.name}: demand and replica counts must be >= 0")
        if self.min_regions < 1 or (self.min_providers is not None and self.min_providers < 1):
            raise ValueError(f"deployment {self.name}: min_regions and min_providers must be >= 1")
        if self.rtt_objective_ms <= 0:
            raise ValueError(f"deployment {self.name}: rtt_objective_ms must be positive")

    @property
    def client_regions(self) -> tuple[str, ...]:
        """Client regions with any demand or requested replicas, sorted."""
        return tuple(sorted(
            {c for c, v in self.demand_tokens_per_s.items() if v > 0}
            | {c for c, v in self.min_replicas_near.items() if v > 0}
        ))

    def usable_skus(self) -> list[str]:
        """SKUs the model fits on and the deployment allows, sorted."""
        return sorted(s for s in self.shapes if self.allowed_skus is None or s in self.allowed_skus)


@dataclass(frozen=True, slots=True)
class Assignment:
    """Instances of one offering given to one deployment (replicas = instances × replicas per instance)."""

    deployment: str
    region: str
    instance_type: str
    sku: str
    instances: int
    replicas: int
    spot: bool = False
    cost_per_hour: float = 0.0
    # The nodes' prefill/decode role (a meridian.contracts.NodeRole value): "both" unless the
    # deployment is disaggregated (control_plane.placement.pools).
    role: str = "both"

    @property
    def key(self) -> tuple[str, str, str, str, bool]:
        """What churn and diffs compare: the same deployment on the same kind of machine in the same place."""
        return (self.deployment, self.region, self.instance_type, self.sku, self.spot)


@dataclass(frozen=True, slots=True)
class SolveOptions:
    """Solver limits: wall-clock time limit for the whole solve, relative MIP gap, the size
    (instance options over all deployments) up to which the MILP goes to HiGHS whole rather than
    decomposed per deployment, and how many per-deployment MILPs run at once (HiGHS releases the
    GIL while it solves, so threads use the cores; 1 solves them one after another)."""

    time_limit_s: float = 10.0
    mip_rel_gap: float = 0.005
    joint_max_options: int = 1500
    threads: int = 2

    def __post_init__(self) -> None:
        if self.time_limit_s <= 0 or self.mip_rel_gap < 0 or self.threads < 1:
            raise ValueError("time_limit_s must be positive, mip_rel_gap >= 0 and threads >= 1")


@dataclass(frozen=True, slots=True)
class Problem:
    """Everything `solve` needs.

    `capacity` is a quota in GPUs per (region, SKU); a pair that is absent is unlimited.
    `current` is the placement in force: each replica added to or removed from where it was
    (same deployment, region, instance type, SKU, spot) costs `churn_penalty` × that replica's
    hourly price in the objective, so re-planning moves only what it must. Deployments with no
    current assignment pay no churn penalty (they are new).
    `providers` are those whose node groups the control plane can create (their drivers are
    enabled, MERIDIAN_PROVIDER_ENABLED); None: every provider. A region of any other provider
    is no candidate: a plan there could be applied but never carried out.
    """

    deployments: Sequence[Deployment]
    offerings: Sequence[Offering]
    regions: Mapping[str, RegionInfo]
    capacity: Mapping[tuple[str, str], int] = field(default_factory=dict)
    current: Sequence[Assignment] = ()
    churn_penalty: float = 0.5
    providers: frozenset[str] | None = None

    def __post_init__(self) -> None:
        names = [d.name for d in self.deployments]
        if len(names) != len(set(names)):
            raise ValueError("deployment names must be unique")
        for d in self.deployments:
            unknown = [c for c in d.client_regions if c not in self.regions]
            if unknown:
                raise ValueError(f"deployment {d.name}: unknown client regions {unknown}")
        if self.churn_penalty < 0:
            raise ValueError("churn_penalty must be >= 0")

    def provisions(self, region: RegionInfo) -> bool:
        """Whether this control plane can create node groups in `region` (its provider's driver is enabled)."""
        return self.providers is None or region.provider in self.providers


class SolveStatus(StrEnum):
    """How a placement solve ended (PlacementResult.status)."""

    OPTIMAL = "optimal"  # proven within the MIP gap
    FEASIBLE = "feasible"  # a valid plan whose proven gap is above the target (the time limit cut it short)
    INFEASIBLE = "infeasible"  # `explanation` names the constraints that cannot be met
    TIMEOUT = "timeout"  # no plan found in the time limit


@dataclass(frozen=True, slots=True)
class PlacementResult:
    """A plan, or why there is none (`status`: SolveStatus)."""

    status: SolveStatus
    assignments: tuple[Assignment, ...] = ()
    total_cost_per_hour: float = 0.0
    cost_per_deployment: Mapping[str, float] = field(default_factory=dict)
    replicas_added: int = 0
    replicas_removed: int = 0
    explanation: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # how a feasible plan was reached (quota repairs)
    objective: float = 0.0  # cost + churn penalty, what the solver minimised
    mip_gap: float = 0.0  # relative, against a proven lower bound
    lower_bound: float = 0.0  # that bound on the objective (-inf when none was proven in the time limit)
    solve_seconds: float = 0.0

    @property
    def feasible(self) -> bool:
        return self.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)

    @property
    def churn(self) -> int:
        """Replicas added plus replicas removed against the current placement."""
        return self.replicas_added + self.replicas_removed


def rtt_ms(a: RegionInfo, b: RegionInfo) -> float:
    """Estimated RTT between two regions (meridian.geo's great-circle model)."""
    return estimate_rtt_ms(Point(a.latitude, a.longitude), Point(b.latitude, b.longitude))


@dataclass(frozen=True, slots=True)
class UsableOffering:
    """An offering a deployment may use, with its region, the replica shape on its SKU and the
    deployment's client regions within the RTT objective of it."""

    offering: Offering
    region: RegionInfo
    shape: ReplicaShape
    near: list[str]


def usable_offerings(problem: Problem, d: Deployment) -> Iterator[UsableOffering]:
    """The offerings in a known region of `d`'s zone whose provider the control plane can provision,
    of a SKU `d` allows and fits with at least TP GPUs, and (when `d` names client regions) within the RTT objective of at least one of them."""
    skus = set(d.usable_skus())
    clients = d.client_regions
    for off in problem.offerings:
        region = problem.regions.get(off.region)
        shape = d.shapes.get(off.sku)
        if region is None or shape is None or off.sku not in skus or off.gpu_count < shape.tp:
            continue
        if not region.admits(d.zone) or not problem.provisions(region):
            continue
        near = [c for c in clients if rtt_ms(problem.regions[c], region) <= d.rtt_objective_ms]
        if clients and not near:
            continue
        yield UsableOffering(off, region, shape, near)
