"""Drill definitions: one YAML file per drill, validated with pydantic at the file boundary.

A drill states a steady-state hypothesis, the open-loop load that runs for the whole
drill, one fault with its target and its window, abort conditions and pass criteria.
All times are seconds from the start of the load. `short` overrides the durations
for CI; every drill's short version runs at most `MAX_SHORT_DURATION_S` seconds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meridian.contracts import REGION_PATTERN, ZONE_PATTERN, NodeRole, ProviderName
from meridian.registry import UnknownName
from providers.provider import PROVIDERS

MAX_SHORT_DURATION_S = 60.0
DRILLS_DIR = Path(__file__).parent / "drills"

class FaultKind(StrEnum):
    """The faults a drill may inject; each has one entry in FAULTS."""

    PROCESS_CRASH = "process_crash"
    PROCESS_HANG = "process_hang"
    SPOT_PREEMPTION = "spot_preemption"
    PROXY_LATENCY = "proxy_latency"
    PROXY_BANDWIDTH = "proxy_bandwidth"
    PROXY_RESET = "proxy_reset"
    PROXY_BLACKHOLE = "proxy_blackhole"
    PROXY_SLOW_CLOSE = "proxy_slow_close"
    REGION_OUTAGE = "region_outage"
    PROVIDER_OUTAGE = "provider_outage"
    CONTROL_PLANE_OUTAGE = "control_plane_outage"
    CONTROL_PLANE_STALL = "control_plane_stall"
    REDIS_OUTAGE = "redis_outage"
    POSTGRES_RESTART = "postgres_restart"
    CORRUPT_WEIGHT_CHUNK = "corrupt_weight_chunk"
    DISK_FULL_DURING_FETCH = "disk_full_during_fetch"
    SCALE_FROM_ZERO_BURST = "scale_from_zero_burst"
    CLOCK_SKEW = "clock_skew"
    PACKET_LOSS = "packet_loss"
    MID_STREAM_CRASH = "mid_stream_crash"
    MID_STREAM_HANG = "mid_stream_hang"
    PD_WORKER_CRASH = "pd_worker_crash"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    """A fault kind's parameters (required, optional) and its injector ("module:Class")."""

    required: frozenset[str]
    optional: frozenset[str]
    injector: str


# The injectors that make several kinds: a node's link through its proxy, a node's process.
_NODE_LINK = "chaos.faults.network:NodeLinkFault"
_NODE_CRASH = "chaos.faults.process:NodeCrash"

# Each fault kind once: the parameters its injector understands (required, optional; anything
# else is a typo the injector would silently ignore, so it is refused here) and the injector
# that makes it ("module:Class", loaded when a drill uses it: chaos.faults.injector.INJECTORS).
FAULTS: dict[FaultKind, FaultSpec] = {
    FaultKind.PROCESS_CRASH: FaultSpec(frozenset(), frozenset({"restart_after_s"}), _NODE_CRASH),
    FaultKind.PROCESS_HANG: FaultSpec(frozenset(), frozenset(), "chaos.faults.process:NodeHang"),
    FaultKind.SPOT_PREEMPTION: FaultSpec(frozenset({"drain_deadline_s"}), frozenset(), "chaos.faults.process:SpotPreemption"),
    FaultKind.PROXY_LATENCY: FaultSpec(frozenset({"latency_ms"}), frozenset({"jitter_ms"}), _NODE_LINK),
    FaultKind.PROXY_BANDWIDTH: FaultSpec(frozenset({"bytes_per_s"}), frozenset(), _NODE_LINK),
    FaultKind.PROXY_RESET: FaultSpec(frozenset(), frozenset({"probability"}), _NODE_LINK),
    FaultKind.PROXY_BLACKHOLE: FaultSpec(frozenset(), frozenset(), _NODE_LINK),
    FaultKind.PROXY_SLOW_CLOSE: FaultSpec(frozenset(), frozenset({"delay_ms"}), _NODE_LINK),
    FaultKind.REGION_OUTAGE: FaultSpec(frozenset(), frozenset(), _NODE_CRASH),
    FaultKind.PROVIDER_OUTAGE: FaultSpec(frozenset(), frozenset(), _NODE_CRASH),
    FaultKind.CONTROL_PLANE_OUTAGE: FaultSpec(frozenset(), frozenset(), "chaos.faults.process:ControlPlaneOutage"),
    # Routing-version bumps allowed from the stall to the end of the load (default 0).
    FaultKind.CONTROL_PLANE_STALL: FaultSpec(frozenset(), frozenset({"max_version_bumps"}), "chaos.faults.control_plane_stall:ControlPlaneStall"),
    FaultKind.REDIS_OUTAGE: FaultSpec(frozenset(), frozenset(), "chaos.faults.network:RedisOutage"),
    FaultKind.POSTGRES_RESTART: FaultSpec(frozenset(), frozenset({"down_s"}), "chaos.faults.network:PostgresRestart"),
    FaultKind.CORRUPT_WEIGHT_CHUNK: FaultSpec(frozenset(), frozenset({"chunk_index"}), "chaos.faults.weights:CorruptWeightChunk"),
    FaultKind.DISK_FULL_DURING_FETCH: FaultSpec(frozenset(), frozenset({"free_bytes"}), "chaos.faults.weights:DiskFullDuringFetch"),
    FaultKind.SCALE_FROM_ZERO_BURST: FaultSpec(frozenset({"burst_requests"}), frozenset({"queue_deadline_s"}), "chaos.faults.burst:ScaleFromZeroBurst"),
    FaultKind.CLOCK_SKEW: FaultSpec(frozenset({"offset_s"}), frozenset(), "chaos.faults.process:ClockSkew"),
    FaultKind.PACKET_LOSS: FaultSpec(frozenset({"percent"}), frozenset(), "chaos.faults.packet_loss:PacketLoss"),
    # The target's nodes, plus (also_region) the node of that region serving the most long
    # streams, once every long stream has received min_events events (or wait_s passed).
    FaultKind.MID_STREAM_CRASH: FaultSpec(frozenset(), frozenset({"also_region", "min_events", "wait_s"}), "chaos.faults.mid_stream:MidStreamCrash"),
    FaultKind.MID_STREAM_HANG: FaultSpec(frozenset(), frozenset({"also_region", "min_events", "wait_s"}), "chaos.faults.mid_stream:MidStreamHang"),
    # The target's busiest prefill worker at the start, its busiest decode worker
    # decode_after_s later (default: half the window); both restart at the end.
    FaultKind.PD_WORKER_CRASH: FaultSpec(frozenset(), frozenset({"decode_after_s"}), "chaos.faults.pd:PDWorkerCrash"),
}

# The parameters alone, by kind (the proxy faults' tests read them).
FAULT_PARAMS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    k.value: (f.required, f.optional) for k, f in FAULTS.items()
}

# Properties that are not visible in a request history; the runner observes them (leader
# leases, the weight cache, the control plane's database) and hands the results to the verdict.
Invariant = Literal[
    "outlier_ejected",
    "region_ejected",
    "served_from_snapshot",
    "kv_routing_degraded_gracefully",
    "acknowledged_writes_present",
    "admin_errors_clean",
    "node_drained_within_deadline",
    "replacement_node_ready",
    "corruption_detected_by_digest",
    "corrupt_model_never_served",
    "clear_disk_full_error",
    "cache_consistent",
    "node_recovers_after_space_freed",
    "single_leader",
    "no_healthy_node_flapped",
    "no_live_node_left_the_table",
    "caught_up_without_storm",
    "pd_served_disaggregated",
    "flow_control_held",
]

Service = Literal["control_plane", "router", "node", "redis", "postgres", "weights_origin"]
_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"


class DrillError(ValueError):
    """A drill file is unreadable or invalid; the message names the file and the field."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class SteadyState(_Spec):
    """What "healthy" means, measured over `window_s` seconds before the fault starts."""

    min_success_rate: float = Field(ge=0, le=1)
    max_p99_ms: float | None = Field(None, gt=0)
    window_s: float = Field(gt=0)


class TenantLoad(_Spec):
    """A tenant of the load: its residency zone and its share of the arrivals."""

    name: str = Field(pattern=_NAME)
    zone: str = Field(pattern=ZONE_PATTERN)
    weight: float = Field(gt=0)


class LongStreams(_Spec):
    """A burst of long greedy streams on top of the load (chaos.streams): `count` streams
    within `spread_s` seconds of `at_s`, split over `tenants` (load tenant names; default
    all) in proportion to their weights, each with its own prompt, temperature 0,
    ignore_eos and `max_tokens`, so every one yields exactly `max_tokens` tokens, the same
    ones on every healthy replica: the reference a migrated stream is compared with."""

    count: int = Field(ge=1, le=500)
    at_s: float = Field(ge=0)
    spread_s: float = Field(0.5, ge=0)
    max_tokens: int = Field(200, ge=1, le=4096)
    tenants: list[str] | None = Field(None, min_length=1)
    # Ask the router for token ids too (it passes them through when the client asked).
    return_token_ids: bool = False
    request_timeout_s: float = Field(120.0, gt=0)


class Load(_Spec):
    """Open-loop load: arrivals do not wait for answers, so a slow fabric meets full load."""

    arrivals_per_s: float = Field(gt=0)
    duration_s: float = Field(gt=0)
    streaming_fraction: float = Field(ge=0, le=1)
    tenants: list[TenantLoad] = Field(min_length=1)
    shared_prefix: bool = False
    max_tokens: int = Field(16, ge=1, le=4096)
    # After this the client gives up and records the request as indeterminate.
    request_timeout_s: float = Field(30.0, gt=0)
    long_streams: LongStreams | None = None
    # Share of the arrivals sent over each of the router's protocols (relative weights):
    # http (the OpenAI API), websocket (the Responses API's WebSocket mode), grpc (KServe v2).
    # Long streams are HTTP.
    protocols: dict[Literal["http", "websocket", "grpc"], float] = Field(default_factory=lambda: {"http": 1.0})

    @model_validator(mode="after")
    def _unique_tenants(self) -> Load:
        names = [t.name for t in self.tenants]
        if len(names) != len(set(names)):
            raise ValueError(f"tenant names must be unique, got {names}")
        unknown = sorted(set(self.long_streams.tenants or ()) - set(names)) if self.long_streams else []
        if unknown:
            raise ValueError(f"long_streams.tenants {unknown} are not tenants of the load")
        if not self.protocols or any(w < 0 for w in self.protocols.values()) or sum(self.protocols.values()) <= 0:
            raise ValueError(f"protocols must give a positive weight to at least one protocol, got {self.protocols}")
        return self


class Topology(_Spec):
    """The fabric the drill needs; the runner starts it (locally) or checks it (deployed)."""

    # None: the local fabric's demo regions.
    regions: list[str] | None = Field(None, min_length=1)
    nodes_per_region: int = Field(1, ge=1, le=8)
    # Exceptions to nodes_per_region (e.g. two nodes only where the fault strikes).
    region_nodes: dict[str, int] = Field(default_factory=dict)
    # Prefill/decode disaggregated regions: the role of each node there (instead of a count).
    region_roles: dict[str, list[NodeRole]] = Field(default_factory=dict)
    routers: int = Field(1, ge=1, le=8)
    control_plane_replicas: int = Field(1, ge=1, le=4)
    redis: bool = False
    postgres: bool = False
    # Regions whose nodes run in their own network namespace, as separate hosts whose
    # packets nftables can drop (the packet_loss fault).
    netns_regions: list[str] = Field(default_factory=list)
    # Settings the fabric's processes need for this drill (e.g. a short router read timeout).
    env: dict[str, str] = Field(default_factory=dict)
    # Simulated nodes (chaos.sim_fleet: the real node agent, in one extra process) registered
    # with the drill's control plane beside the real ones, over the catalog's regions, serving
    # models the load never asks for: a fleet for faults whose effect grows with it.
    simulated_nodes: int = Field(0, ge=0, le=2000)

    @model_validator(mode="after")
    def _check(self) -> Topology:
        named = [*(self.regions or ()), *self.region_nodes, *self.region_roles, *self.netns_regions]
        bad = [r for r in named if not re.match(REGION_PATTERN, r)]
        if bad:
            raise ValueError(f"regions {bad} do not look like <provider>:<location>")
        if any(not 1 <= n <= 8 for n in self.region_nodes.values()):
            raise ValueError(f"region_nodes counts must be 1 to 8, got {self.region_nodes}")
        if any(not 1 <= len(roles) <= 8 for roles in self.region_roles.values()):
            raise ValueError("region_roles must list 1 to 8 nodes per region")
        bad = [k for k in self.env if not re.match(r"^MERIDIAN_[A-Z0-9_]+$", k)]
        if bad:
            raise ValueError(f"env keys {bad} are not MERIDIAN_* settings")
        return self


class Target(_Spec):
    """What the fault hits. `node: any` picks, of the nodes matching the rest, the one the
    routers have sent the most requests (ties: a seeded choice)."""

    node: str | None = None
    region: str | None = Field(None, pattern=REGION_PATTERN)
    provider: ProviderName | None = None
    service: Service | None = None
    model: str | None = None
    # Only nodes of this prefill/decode role.
    role: NodeRole | None = None

    def matches(self, node_id: str, region: str, models: Iterable[str], role: NodeRole = NodeRole.BOTH) -> bool:
        """Whether a node (its id, region, the models it serves, its role) is hit by this target."""
        return (
            (self.role is None or role == self.role)
            and (self.region is None or region == self.region)
            and (self.provider is None or region.split(":", 1)[0] == self.provider)
            and (self.node in (None, "any") or node_id == self.node)
            and (self.model is None or self.model in models)
        )

    @field_validator("provider")
    @classmethod
    def _registered(cls, provider: str | None) -> str | None:
        """A provider of the registry (providers.provider.PROVIDERS); the error lists them."""
        if provider is not None and provider not in PROVIDERS:
            raise ValueError(str(UnknownName(PROVIDERS.kind, provider, PROVIDERS.names())))
        return provider

    @model_validator(mode="after")
    def _not_empty(self) -> Target:
        if not any(v is not None for v in (self.node, self.region, self.provider, self.service, self.model)):
            raise ValueError("a target needs at least one of node, region, provider, service, model")
        return self


class Fault(_Spec):
    """One fault, injected at `start_s` and removed at `end_s`.

    For instantaneous faults (a crash, a preemption, a burst) `end_s` is when the injector
    heals what it broke (restarts the process), and the fault window the checker measures.
    """

    kind: FaultKind
    target: Target
    params: dict[str, float | int | str | bool] = Field(default_factory=dict)
    start_s: float = Field(ge=0)
    end_s: float = Field(ge=0)

    @model_validator(mode="after")
    def _check(self) -> Fault:
        if self.end_s < self.start_s:
            raise ValueError(f"end_s ({self.end_s}) is before start_s ({self.start_s})")
        required, optional = FAULT_PARAMS[self.kind]
        missing = sorted(required - self.params.keys())
        unknown = sorted(self.params.keys() - required - optional)
        if missing:
            raise ValueError(f"{self.kind} needs params {missing}")
        if unknown:
            raise ValueError(f"{self.kind} does not take params {unknown} (known: {sorted(required | optional)})")
        if self.kind is FaultKind.REGION_OUTAGE and self.target.region is None:
            raise ValueError("region_outage needs target.region")
        if self.kind is FaultKind.PROVIDER_OUTAGE and self.target.provider is None:
            raise ValueError("provider_outage needs target.provider")
        if self.kind is FaultKind.PACKET_LOSS:
            percent = self.params["percent"]
            if self.target.region is None:
                raise ValueError("packet_loss needs target.region (a region in topology.netns_regions)")
            if isinstance(percent, bool) or not isinstance(percent, int | float) or not 0 < percent <= 100:
                raise ValueError(f"packet_loss percent must be in (0, 100], got {percent!r}")
        also = self.params.get("also_region")
        if also is not None and not (isinstance(also, str) and re.match(REGION_PATTERN, also)):
            raise ValueError(f"{self.kind} also_region must be a region (<provider>:<location>), got {also!r}")
        return self


class AbortCondition(_Spec):
    """Stop the drill early (and fail it) when errors stay above a rate for a while."""

    error_rate_above: float = Field(gt=0, le=1)
    for_s: float = Field(gt=0)


class AllowedError(_Spec):
    """A failure that is the correct answer under this fault (a clean error)."""

    status: int = Field(ge=400, le=599)
    code: str = Field(min_length=1)
    retry_after: bool = False  # the answer must carry Retry-After


class StreamCriteria(_Spec):
    """Long streams under a mid-stream fault (chaos.checker.check_streams has the definitions)."""

    max_broken_streams: int = Field(0, ge=0)
    max_token_mismatches: int = Field(0, ge=0)
    # Streams whose greedy decode took another token than the reference's away from any
    # seam (float32 near-ties flip in another batch; chaos.stream_check).
    max_diverged_streams: int = Field(0, ge=0)
    max_residency_violations: int = Field(0, ge=0)
    # p99 of migrated streams' longest silence, plus one prefill of the longest prompt
    # (measured alone on the healthy fabric); a gray failure adds its inter-token timeout.
    max_resume_p99_s: float | None = Field(None, gt=0)
    # The fault must have moved at least this many streams (else it hit nothing).
    min_migrated: int = Field(1, ge=0)
    # Zones with no other replica left under the fault: their streams may end with a clean
    # SSE error event (code upstream_disconnected) after a prefix of the reference.
    unmigratable_zones: list[str] = Field(default_factory=list)


class PassCriteria(_Spec):
    """What the checker asserts; see chaos.checker for the exact definitions."""

    max_lost: int = Field(0, ge=0)
    max_duplicated: int = Field(0, ge=0)
    max_unexpected: int = Field(0, ge=0)
    max_residency_violations: int = Field(0, ge=0)
    max_unclean_errors: int = Field(0, ge=0)
    max_indeterminate: int | None = Field(None, ge=0)
    max_error_rate_during_fault: float | None = Field(None, ge=0, le=1)
    max_p99_during_fault_ms: float | None = Field(None, gt=0)
    max_latency_during_fault_ms: float | None = Field(None, gt=0)
    max_recovery_s: float | None = Field(None, ge=0)
    recovery_from: Literal["fault_end", "fault_start"] = "fault_end"
    recovery_window_s: float = Field(2.0, gt=0)
    allowed_errors: list[AllowedError] = Field(default_factory=list)
    # A stream that breaks after its first byte must end with an SSE error event; such a
    # stream then counts as a clean error.
    streams_end_with_error_event: bool = False
    invariants: list[Invariant] = Field(default_factory=list)
    streams: StreamCriteria | None = None


class ShortOverride(_Spec):
    """Shorter timings for CI; the rest of the drill is unchanged."""

    duration_s: float = Field(gt=0, le=MAX_SHORT_DURATION_S)
    fault_start_s: float = Field(ge=0)
    fault_end_s: float = Field(ge=0)
    steady_state_window_s: float | None = Field(None, gt=0)
    arrivals_per_s: float | None = Field(None, gt=0)
    long_streams_at_s: float | None = Field(None, ge=0)
    long_streams_count: int | None = Field(None, ge=1)


class Drill(_Spec):
    """A chaos drill."""

    name: str = Field(pattern=_NAME)
    description: str = Field(min_length=1)
    topology: Topology = Field(default_factory=Topology)
    steady_state: SteadyState
    load: Load
    fault: Fault
    abort: list[AbortCondition] = Field(default_factory=list)
    pass_criteria: PassCriteria = Field(alias="pass")
    short: ShortOverride | None = None

    @model_validator(mode="after")
    def _timeline(self) -> Drill:
        f, duration = self.fault, self.load.duration_s
        if f.start_s < self.steady_state.window_s:
            raise ValueError(
                f"fault.start_s ({f.start_s}) leaves no room for the steady-state window "
                f"({self.steady_state.window_s} s) before it"
            )
        if f.end_s > duration:
            raise ValueError(f"fault.end_s ({f.end_s}) is after the load ends ({duration} s)")
        c = self.pass_criteria
        if c.max_recovery_s is not None:
            ref = f.end_s if c.recovery_from == "fault_end" else f.start_s
            # Otherwise the bound could never be confirmed before the load stops.
            if duration - ref < c.max_recovery_s + c.recovery_window_s:
                raise ValueError(
                    f"the load ends {duration - ref:g} s after the {c.recovery_from.replace('_', ' ')}, "
                    f"too soon to measure recovery within {c.max_recovery_s:g} s "
                    f"(+ a {c.recovery_window_s:g} s window)"
                )
        ls = self.load.long_streams
        if ls is not None and ls.at_s >= f.end_s:
            raise ValueError(f"long_streams.at_s ({ls.at_s}) must be before the fault ends ({f.end_s}): "
                             "the fault strikes them mid-generation")
        if c.streams is not None and ls is None:
            raise ValueError("pass.streams needs load.long_streams")
        if self.short is None and duration > MAX_SHORT_DURATION_S:
            raise ValueError(f"load.duration_s is {duration} s: add a `short` block of at most {MAX_SHORT_DURATION_S:g} s")
        if self.short is not None:
            self.short_version()  # its timeline must be valid too
        return self

    def short_version(self) -> Drill:
        """The drill with the `short` timings applied (itself when it has none)."""
        s = self.short
        if s is None:
            return self
        data: dict[str, Any] = self.model_dump(by_alias=True)
        data["short"] = None
        data["load"]["duration_s"] = s.duration_s
        data["fault"]["start_s"] = s.fault_start_s
        data["fault"]["end_s"] = s.fault_end_s
        if s.steady_state_window_s is not None:
            data["steady_state"]["window_s"] = s.steady_state_window_s
        if s.arrivals_per_s is not None:
            data["load"]["arrivals_per_s"] = s.arrivals_per_s
        if data["load"]["long_streams"] is not None:
            if s.long_streams_at_s is not None:
                data["load"]["long_streams"]["at_s"] = s.long_streams_at_s
            if s.long_streams_count is not None:
                data["load"]["long_streams"]["count"] = s.long_streams_count
        try:
            return Drill.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"short version is invalid: {describe_errors(e)}") from None


def describe_errors(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def load_drill(path: str | Path) -> Drill:
    """Read and validate one drill file."""
    return load_yaml_model(path, Drill, DrillError, "drill")


M = TypeVar("M", bound=BaseModel)


def load_yaml_model(path: str | Path, model: type[M], error: type[ValueError], what: str) -> M:
    """Read a YAML mapping into `model`; `error` names the file and every invalid field."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise error(f"{path}: cannot read {what}: {e}") from None
    if not isinstance(data, dict):
        raise error(f"{path}: a {what} is a YAML mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise error(f"{path}: {describe_errors(e)}") from None


def load_drills(directory: str | Path = DRILLS_DIR) -> list[Drill]:
    """Every drill in a directory (*.yaml, *.yml), sorted by name; duplicate names are refused."""
    directory = Path(directory)
    files = sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")])
    seen: dict[str, Path] = {}
    drills = []
    for path in files:
        drill = load_drill(path)
        if drill.name in seen:
            raise DrillError(f"{path}: drill name {drill.name!r} is already used by {seen[drill.name]}")
        seen[drill.name] = path
        drills.append(drill)
    return sorted(drills, key=lambda d: d.name)
