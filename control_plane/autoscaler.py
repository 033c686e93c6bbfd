"""The autoscaler: Knative-KPA-style replica counts from observed concurrency.

Every autoscale_interval_s the leader samples, per deployment, the concurrency its ready
nodes report in their heartbeats (running + waiting requests) plus the requests routers'
flow control holds for its model (control_plane.router_backlog: flow control keeps the nodes'
queues short, so without them a saturated deployment looks exactly full and never grows),
and `decide`s a replica count.
A deployment's replicas are the ready nodes of its model in regions its residency zone admits
(`in_zone_pools`): a node elsewhere can never serve its zone's tenants, so it is neither a
replica nor load of the deployment. The count:

- **stable mode**: desired = ceil(average concurrency over the stable window / target
  concurrency per replica);
- **panic mode**: when the average over the (short) panic window needs at least
  panic_threshold_pct % of the ready replicas' capacity, desired follows the panic window
  instead, but only ever upwards, until a whole stable window passes below the threshold;
- the step is limited by max_scale_up_rate / max_scale_down_rate, a lower count is applied only
  after it was wanted for scale_down_delay_s, counts stay within [min_replicas, max_replicas];
- **scale to zero** (min_replicas 0) only after a whole stable window without traffic, and never
  within a stable window of a router's scale-from-zero request.

A prefill/decode disaggregated deployment scales its pools separately: the decode pool
(`desired_replicas`) as above on the running and waiting requests of its decode nodes, the
prefill pool (`desired_prefill_replicas`, `decide_prefill`) by the same algorithm on the prompt
tokens waiting for prefill on its prefill nodes (NodeLoad.waiting_prompt_tokens) against a
per-replica target, within the prefill pool's bounds.

`decide` is a pure function of its inputs and state, so the algorithm is tested without a
database. Samples and state live in the leader's memory: a new leader starts observing afresh
and scales nothing down until it has watched a full stable window.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane import audit, deployment_store, router_backlog
from control_plane.audit import Actor
from control_plane.context import AppContext
from control_plane.db.clock import db_now
from control_plane.db.models import AutoscalerDecision, Deployment, Node
from control_plane.leader import Fence, check_fence
from meridian.contracts import AutoscalingSpec, DisaggregationSpec, NodeRole, NodeStatus, RegionInfo

log = logging.getLogger(__name__)

ACTOR = Actor.system("autoscaler")


@dataclass(frozen=True, slots=True)
class Sample:
    """Concurrency (running + waiting requests over the ready replicas) seen at `at` (monotonic s)."""

    at: float
    concurrency: float


@dataclass(frozen=True, slots=True)
class KpaState:
    """What `decide` remembers between decisions of one deployment."""

    # When this leader started observing the deployment (monotonic s).
    observing_since: float | None = None
    # Last time the panic-window demand was over the threshold; None: not panicking.
    panic_since: float | None = None
    # Highest count wanted during this panic (panic never scales down).
    max_panic: int = 0
    # Counts wanted recently, for the scale-down delay: (at, count).
    wanted: tuple[tuple[float, int], ...] = ()


class ScaleMode(StrEnum):
    """Which window a decision followed (stored as its string in autoscaler_decisions.mode)."""

    STABLE = "stable"
    PANIC = "panic"


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    mode: ScaleMode
    reason: str
    inputs: dict[str, Any]
    state: KpaState

    def changes(self, current: int) -> bool:
        return self.desired != current


def _mean(samples: Sequence[Sample]) -> float:
    return sum(s.concurrency for s in samples) / len(samples) if samples else 0.0


@dataclass(frozen=True, slots=True)
class _Load:
    """What the samples say over both windows, and the replicas each would need."""

    stable_w: float
    panic_w: float
    stable_samples: int
    panic_samples: int
    avg_stable: float
    avg_panic: float
    want_stable: int
    want_panic: int


def _load(spec: AutoscalingSpec, samples: Sequence[Sample], now: float) -> _Load:
    stable_w = spec.stable_window_s
    panic_w = stable_w * spec.panic_window_pct / 100.0
    stable = [s for s in samples if s.at > now - stable_w]
    panic = [s for s in samples if s.at > now - panic_w]
    avg_stable = _mean(stable)
    avg_panic = _mean(panic) if panic else avg_stable
    return _Load(
        stable_w=stable_w, panic_w=panic_w, stable_samples=len(stable), panic_samples=len(panic),
        avg_stable=avg_stable, avg_panic=avg_panic,
        want_stable=math.ceil(avg_stable / spec.target_concurrency),
        want_panic=math.ceil(avg_panic / spec.target_concurrency),
    )


def _panic_since(
    spec: AutoscalingSpec, load: _Load, base: int, now: float, state: KpaState, notes: list[str]
) -> tuple[float | None, int]:
    """Enter, stay in or leave panic: the new (panic_since, max_panic)."""
    over_threshold = (load.avg_panic / spec.target_concurrency) / base >= spec.panic_threshold_pct / 100.0
    if over_threshold:
        if state.panic_since is None:
            notes.append(f"entering panic: {load.avg_panic:.1f} in flight over {load.panic_w:g}s needs "
                         f"≥{spec.panic_threshold_pct:g}% of {base} ready")
        return now, state.max_panic
    if state.panic_since is not None and now - state.panic_since >= load.stable_w:
        notes.append(f"leaving panic: below the threshold for {load.stable_w:g}s")
        return None, 0
    return state.panic_since, state.max_panic


def _wanted(
    spec: AutoscalingSpec, load: _Load, mode: ScaleMode, ready: int, max_up: int, max_down: int, notes: list[str]
) -> int:
    """The count the window of `mode` asks for, limited to the scale rates (relative to the
    `ready` replicas, at least one)."""
    if mode is ScaleMode.PANIC:
        # Provision for the larger of both windows.
        raw = max(load.want_panic, load.want_stable)
        notes.append(f"panic: {load.avg_panic:.1f} in flight over {load.panic_w:g}s / "
                     f"{spec.target_concurrency:g} per replica")
    else:
        raw = load.want_stable
        notes.append(f"stable: {load.avg_stable:.1f} in flight over {load.stable_w:g}s / "
                     f"{spec.target_concurrency:g} per replica")
    wanted = min(max(raw, max_down), max_up)
    if wanted != raw:
        notes.append(f"rate-limited from {raw} to {wanted} (×{spec.max_scale_up_rate:g} up, "
                     f"÷{spec.max_scale_down_rate:g} down of {ready} ready)")
    return wanted


def _guarded(
    spec: AutoscalingSpec,
    wanted: int,
    delayed: int,
    *,
    current: int,
    observed_s: float,
    since_scale_request_s: float | None,
    min_replicas: int,
    max_replicas: int,
    notes: list[str],
) -> int:
    """`delayed` once the guards had their say: an observed window before any scale-down, a
    recent scale-from-zero request, the deployment's bounds."""
    desired = delayed
    if wanted < desired <= current:
        notes.append(f"scale-down to {wanted} delayed: {desired} was wanted within {spec.scale_down_delay_s:g}s")
    if observed_s < spec.stable_window_s and desired < current:
        desired = current
        notes.append(f"no scale-down yet: observed {observed_s:.0f}s of a {spec.stable_window_s:g}s window")
    if since_scale_request_s is not None and since_scale_request_s < spec.stable_window_s and desired < 1 <= current:
        desired = 1
        notes.append(f"kept at 1: scale-from-zero request {since_scale_request_s:.0f}s ago")
    bounded = max(min_replicas, min(desired, max_replicas))
    if bounded != desired:
        notes.append(f"bounded to [{min_replicas}, {max_replicas}]")
    if bounded == 0 and current > 0:
        notes.append(f"scale to zero: no traffic for {spec.stable_window_s:g}s")
    return bounded


def decide(
    spec: AutoscalingSpec,
    *,
    min_replicas: int,
    max_replicas: int,
    samples: Iterable[Sample],
    current: int,
    ready: int,
    now: float,
    state: KpaState,
    since_scale_request_s: float | None = None,
) -> Decision:
    """The replica count a deployment should have now (Knative KPA, see the module's doc).

    `current` is the desired count in force, `ready` the replicas serving now, `now` and the
    samples' times monotonic seconds; `since_scale_request_s` is the age of the last
    scale-from-zero request (None: none).
    """
    all_samples = sorted(samples, key=lambda s: s.at)
    load = _load(spec, all_samples, now)
    observing_since = state.observing_since
    if observing_since is None:
        observing_since = all_samples[0].at if all_samples else now
    # Knative: rates and the panic threshold are relative to the ready replicas, at least one.
    base = max(1, ready)
    max_up = math.ceil(spec.max_scale_up_rate * base)
    max_down = math.floor(base / spec.max_scale_down_rate)

    # Fewer ready than wanted: replicas starting, or lost (a zone without any answers its
    # tenants 503 until one is back), said first so the decision log shows it.
    notes: list[str] = [f"{ready} of {current} ready"] if ready < current else []
    panic_since, max_panic = _panic_since(spec, load, base, now, state, notes)
    mode = ScaleMode.PANIC if panic_since is not None else ScaleMode.STABLE
    wanted = _wanted(spec, load, mode, ready, max_up, max_down, notes)
    if mode is ScaleMode.PANIC:
        # Panic only scales up: never below what is in force or was wanted earlier in this panic.
        wanted = max(wanted, current, max_panic)
        max_panic = wanted

    # Scale-down delay: apply the highest count wanted within the delay (the unobserved past
    # before this leader started counts as wanting the count in force).
    history = tuple((t, n) for t, n in state.wanted if t > now - spec.scale_down_delay_s) + ((now, wanted),)
    delayed = max(n for _, n in history)
    if now - observing_since < spec.scale_down_delay_s:
        delayed = max(delayed, current)
    desired = _guarded(
        spec, wanted, delayed, current=current, observed_s=now - observing_since,
        since_scale_request_s=since_scale_request_s, min_replicas=min_replicas, max_replicas=max_replicas,
        notes=notes,
    )

    inputs: dict[str, Any] = {
        "avg_concurrency_stable": round(load.avg_stable, 3),
        "avg_concurrency_panic": round(load.avg_panic, 3),
        "stable_samples": load.stable_samples,
        "panic_samples": load.panic_samples,
        "stable_window_s": load.stable_w,
        "panic_window_s": load.panic_w,
        "target_concurrency": spec.target_concurrency,
        "current": current,
        "ready": ready,
        "want_stable": load.want_stable,
        "want_panic": load.want_panic,
        "max_scale_up": max_up,
        "max_scale_down": max_down,
        "panic": mode is ScaleMode.PANIC,
        "observed_s": round(now - observing_since, 1),
        "since_scale_request_s": None if since_scale_request_s is None else round(since_scale_request_s, 1),
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
    }
    new_state = KpaState(observing_since=observing_since, panic_since=panic_since, max_panic=max_panic, wanted=history)
    verdict = f"{current} → {desired}" if desired != current else f"hold at {current}"
    return Decision(desired=desired, mode=mode, reason=f"{verdict}; " + "; ".join(notes), inputs=inputs, state=new_state)


def prefill_spec(autoscaling: AutoscalingSpec, topology: DisaggregationSpec) -> AutoscalingSpec:
    """The prefill pool's KPA: the deployment's windows, delays and rates, aimed at waiting
    prompt tokens per replica instead of requests in flight (a target the spec's own bound on
    target_concurrency does not cover, hence a copy rather than a validated spec)."""
    return autoscaling.model_copy(update={"target_concurrency": float(topology.target_waiting_prompt_tokens)})


def decide_prefill(
    autoscaling: AutoscalingSpec,
    topology: DisaggregationSpec,
    *,
    samples: Iterable[Sample],
    current: int,
    ready: int,
    now: float,
    state: KpaState,
    since_scale_request_s: float | None = None,
) -> Decision:
    """The prefill pool's count now: `decide` on samples of waiting prompt tokens (a Sample's
    `concurrency`) within [min_prefill_replicas, max_prefill_replicas]."""
    d = decide(
        prefill_spec(autoscaling, topology), min_replicas=topology.min_prefill_replicas,
        max_replicas=topology.max_prefill_replicas, samples=samples, current=current, ready=ready, now=now,
        state=state, since_scale_request_s=since_scale_request_s,
    )
    inputs = {**d.inputs, "pool": NodeRole.PREFILL.value, "signal": "waiting_prompt_tokens"}
    return replace(d, inputs=inputs, reason=f"prefill {d.reason}")


# --- the leader's loop -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Observed:
    """A deployment as one autoscaler pass reads it."""

    model: str
    spec: AutoscalingSpec
    min_replicas: int
    max_replicas: int
    desired: int
    last_scale_request_at: datetime | None
    ready: int
    # The nodes' running + waiting plus the requests routers' flow control holds for the model.
    concurrency: float
    # A disaggregated deployment's prefill pool (then ready and concurrency are its decode pool's).
    prefill: PrefillObserved | None = None
    # Of concurrency, the requests held at routers (router_backlog), which no node reports.
    router_waiting: int = 0


@dataclass(frozen=True, slots=True)
class PrefillObserved:
    """A disaggregated deployment's prefill pool as one pass reads it."""

    topology: DisaggregationSpec
    desired: int
    ready: int
    waiting_prompt_tokens: float


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool's count as the autoscaler keeps it (what GET /v1/autoscaler/status shows)."""

    pool: NodeRole
    min_replicas: int
    max_replicas: int
    ready: int
    desired: int


@dataclass
class _Pool:
    ready: int = 0
    in_flight: float = 0.0
    waiting: float = 0.0
    # Prompt tokens waiting, from the nodes that measure them.
    prompt_tokens: float = 0.0

    def add(self, load: dict[str, Any]) -> None:
        self.ready += 1
        self.in_flight += float(load.get("running", 0)) + float(load.get("waiting", 0))
        self.waiting += float(load.get("waiting", 0))
        self.prompt_tokens += float(load.get("waiting_prompt_tokens") or 0)


def in_zone_pools(
    nodes: Iterable[Node], zones: Mapping[str, str], regions: Mapping[str, RegionInfo]
) -> dict[tuple[str, str], _Pool]:
    """Load of the ready `nodes` per (model, role), each model counting only the nodes in
    regions its deployment's zone admits (`zones`: model -> zone).

    A node outside the zone serves the model to other zones' tenants and can never serve this
    deployment's: counted, it held an eu deployment at "1 of 2 ready" while its only eu
    replica was dead (issue 32). A node in a region this control plane does not describe has
    no known zone and counts for no deployment.
    """
    pools: dict[tuple[str, str], _Pool] = {}
    for node in nodes:
        region = regions.get(node.region)
        for model in node.models or ():
            zone = zones.get(model)
            if zone is None or region is None or not region.admits(zone):
                continue
            # A node serving several models reports one figure; each model is charged all of it.
            pools.setdefault((model, node.role), _Pool()).add(node.load or {})
    return pools


def _observed(d: Deployment, pools: dict[tuple[str, str], _Pool], router_waiting: int) -> Observed:
    topology = deployment_store.disaggregation_of(d)
    roles = list(NodeRole) if topology is None else [NodeRole.DECODE, NodeRole.BOTH]
    serving = [pools[(d.model, r.value)] for r in roles if (d.model, r.value) in pools]
    prefill = None
    if topology is not None:
        p = pools.get((d.model, NodeRole.PREFILL.value), _Pool())
        prefill = PrefillObserved(topology=topology, desired=d.desired_prefill_replicas or 0, ready=p.ready,
                                  waiting_prompt_tokens=p.prompt_tokens)
    return Observed(
        model=d.model,
        spec=AutoscalingSpec.model_validate(d.autoscaling or {}),
        min_replicas=d.min_replicas,
        max_replicas=d.max_replicas,
        desired=d.desired_replicas,
        last_scale_request_at=d.last_scale_request_at,
        ready=sum(p.ready for p in serving),
        concurrency=sum(p.in_flight for p in serving) + router_waiting,
        prefill=prefill,
        router_waiting=router_waiting,
    )


def observe(session: Session, regions: Mapping[str, RegionInfo], backlog_ttl_s: float) -> list[Observed]:
    """Every deployment with the load its ready nodes in its zone report now (per pool when
    disaggregated) and what routers hold for it."""
    rows = session.scalars(select(Deployment).order_by(Deployment.model)).all()
    return observe_rows(session, rows, regions, backlog_ttl_s)


def observe_rows(
    session: Session, rows: Sequence[Deployment], regions: Mapping[str, RegionInfo], backlog_ttl_s: float
) -> list[Observed]:
    """These deployments with the load their ready nodes in their zones report now, plus the
    requests routers' flow control holds for their models (reports younger than `backlog_ttl_s`)."""
    ready = session.scalars(select(Node).where(Node.status == NodeStatus.READY.value))
    pools = in_zone_pools(ready, {d.model: d.zone for d in rows}, regions)
    held = router_backlog.waiting_by_model(router_backlog.held(session, db_now(session), backlog_ttl_s))
    return [_observed(d, pools, held.get(d.model, 0)) for d in rows]


def pools_of(obs: Observed) -> list[PoolView]:
    """The pools the autoscaler keeps a count for: a co-located deployment's one, or a
    disaggregated one's decode and prefill pools, each with its bounds, ready and desired replicas."""
    if obs.prefill is None:
        return [PoolView(NodeRole.BOTH, obs.min_replicas, obs.max_replicas, obs.ready, obs.desired)]
    p = obs.prefill
    return [
        PoolView(NodeRole.DECODE, obs.min_replicas, obs.max_replicas, obs.ready, obs.desired),
        PoolView(NodeRole.PREFILL, p.topology.min_prefill_replicas, p.topology.max_prefill_replicas, p.ready,
                 p.desired),
    ]


def decision_pool(inputs: dict[str, Any] | None) -> NodeRole:
    """The pool a recorded decision was for (its inputs name a disaggregated deployment's pool)."""
    try:
        return NodeRole((inputs or {}).get("pool", NodeRole.BOTH.value))
    except ValueError:
        return NodeRole.BOTH


@dataclass
class _Tracked:
    """The leader's memory of one deployment."""

    samples: deque[Sample] = field(default_factory=deque)
    state: KpaState = KpaState()
    last_recorded: float | None = None
    # The scale-from-zero request last seen, and when (monotonic) this leader first saw it:
    # its age is taken as the younger of both, so a replica's clock skew cannot shorten it.
    request_at: datetime | None = None
    request_seen: float = 0.0


class Autoscaler:
    """Samples load and applies `decide` to every deployment; `tick` is one pass (leader only)."""

    def __init__(self, ctx: AppContext) -> None:
        self._ctx = ctx
        self._clock = ctx.clock
        self._epoch: int | None = None
        self._tracked: dict[str, _Tracked] = {}

    async def tick(self, fence: Fence) -> list[tuple[str, Decision]]:
        """Sample, decide and write (fenced) what changed; returns the decisions made."""
        if self._epoch != fence.epoch:
            # A new term starts observing afresh (another leader may have acted meanwhile).
            self._epoch, self._tracked = fence.epoch, {}
        observed = await asyncio.to_thread(self._read)
        now = self._clock.monotonic()
        wall = self._clock.now()
        decisions: list[tuple[str, Decision]] = []
        for obs in observed:
            pools = [NodeRole.BOTH] if obs.prefill is None else [NodeRole.DECODE, NodeRole.PREFILL]
            for pool in pools:
                decision = await self._step(fence, obs, pool, now, wall)
                if decision is not None:
                    decisions.append((obs.model, decision))
        for key in set(self._tracked) - {_key(o.model, p) for o in observed for p in NodeRole}:
            del self._tracked[key]
        return decisions

    async def _step(
        self, fence: Fence, obs: Observed, pool: NodeRole, now: float, wall: datetime
    ) -> Decision | None:
        """Sample one pool of a deployment, decide, and write what changed (None: not applied)."""
        tracked = self._tracked.setdefault(_key(obs.model, pool), _Tracked())
        prefill = obs.prefill if pool is NodeRole.PREFILL else None
        tracked.samples.append(Sample(now, obs.concurrency if prefill is None else prefill.waiting_prompt_tokens))
        horizon = now - obs.spec.stable_window_s - self._ctx.settings.autoscale_interval_s
        while tracked.samples and tracked.samples[0].at < horizon:
            tracked.samples.popleft()
        request_age = self._request_age(tracked, obs.last_scale_request_at, now, wall)
        if prefill is None:
            decision = decide(
                obs.spec, min_replicas=obs.min_replicas, max_replicas=obs.max_replicas,
                samples=tracked.samples, current=obs.desired, ready=obs.ready, now=now, state=tracked.state,
                since_scale_request_s=request_age,
            )
        else:
            decision = decide_prefill(
                obs.spec, prefill.topology, samples=tracked.samples, current=prefill.desired, ready=prefill.ready,
                now=now, state=tracked.state, since_scale_request_s=request_age,
            )
        if pool is NodeRole.DECODE:
            decision = replace(decision, inputs={**decision.inputs, "pool": NodeRole.DECODE.value})
        if prefill is None and obs.router_waiting:
            # Requests flow control holds at routers: part of the concurrency, never on a node.
            decision = replace(decision, inputs={**decision.inputs, "router_waiting": obs.router_waiting})
        current = obs.desired if prefill is None else prefill.desired
        hold_due = tracked.last_recorded is None or now - tracked.last_recorded >= (
            self._ctx.settings.autoscale_hold_record_s
        )
        if decision.changes(current) or hold_due:
            if not await self._apply(fence, obs, decision, wall, prefill=prefill is not None):
                return None  # the deployment changed under us; decide again next tick
            tracked.last_recorded = now
        tracked.state = decision.state
        return decision

    def _read(self) -> list[Observed]:
        with self._ctx.read() as session:
            return observe(session, self._ctx.regions, self._ctx.settings.router_backlog_ttl_s)

    @staticmethod
    def _request_age(tracked: _Tracked, request_at: datetime | None, now: float, wall: datetime) -> float | None:
        if request_at is None:
            return None
        if request_at != tracked.request_at:
            tracked.request_at, tracked.request_seen = request_at, now
        return max(0.0, min((wall - request_at).total_seconds(), now - tracked.request_seen))

    async def _apply(
        self, fence: Fence, obs: Observed, decision: Decision, wall: datetime, *, prefill: bool = False
    ) -> bool:
        """Record the decision and set the pool's count (desired_replicas, or
        desired_prefill_replicas for a prefill pool), unless the deployment changed since the read."""
        column = "desired_prefill_replicas" if prefill else "desired_replicas"
        current = obs.prefill.desired if prefill and obs.prefill is not None else obs.desired

        def write() -> bool:
            with self._ctx.write() as session:
                check_fence(session, fence)
                row = session.scalars(select(Deployment).where(Deployment.model == obs.model).with_for_update()).first()
                # A scale-up request or an operator's edit since the read: decide again on fresh data.
                if row is None or row.desired_replicas != obs.desired or (
                    row.last_scale_request_at != obs.last_scale_request_at
                ) or (row.min_replicas, row.max_replicas) != (obs.min_replicas, obs.max_replicas) or (
                    _prefill_fields(row) != _observed_prefill(obs)
                ):
                    return False
                session.add(AutoscalerDecision(
                    model=obs.model, at=wall, mode=decision.mode.value, inputs=decision.inputs, current=current,
                    desired=decision.desired, reason=decision.reason[:500], epoch=fence.epoch,
                ))
                if decision.changes(current):
                    setattr(row, column, decision.desired)
                    row.last_scale_reason = f"autoscaler: {decision.reason}"[:200]
                    row.updated_at = wall
                    audit.record(session, ACTOR, action="scale", resource_type="deployment", resource_id=obs.model,
                                 before={column: current},
                                 after={column: decision.desired, "mode": decision.mode.value},
                                 now=wall)
                return True

        applied = await asyncio.to_thread(write)
        if applied and decision.changes(current):
            log.info("autoscaler: %s %s", obs.model, decision.reason)
        return applied



def _key(model: str, pool: NodeRole) -> str:
    """The leader's memory key of one pool (a co-located deployment's is its model's name)."""
    return model if pool is NodeRole.BOTH or pool is NodeRole.DECODE else f"{model}\x00{pool.value}"


def _prefill_fields(row: Deployment) -> tuple[object, ...]:
    if row.disaggregation is None:
        return (None, None)
    return (row.disaggregation, row.desired_prefill_replicas or 0)


def _observed_prefill(obs: Observed) -> tuple[object, ...]:
    if obs.prefill is None:
        return (None, None)
    return (obs.prefill.topology.model_dump(mode="json"), obs.prefill.desired)
