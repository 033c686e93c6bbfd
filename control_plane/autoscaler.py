"""The autoscaler: Knative-KPA-style replica counts from observed concurrency.

Every autoscale_interval_s the leader samples, per deployment, the concurrency its ready
nodes report in their heartbeats (running + waiting requests) and `decide`s a replica count:

- **stable mode**: desired = ceil(average concurrency over the stable window / target
  concurrency per replica);
- **panic mode**: when the average over the (short) panic window needs at least
  panic_threshold_pct % of the ready replicas' capacity, desired follows the panic window
  instead, but only ever upwards, until a whole stable window passes below the threshold;
- the step is limited by max_scale_up_rate / max_scale_down_rate, a lower count is applied only
  after it was wanted for scale_down_delay_s, counts stay within [min_replicas, max_replicas];
- **scale to zero** (min_replicas 0) only after a whole stable window without traffic, and never
  within a stable window of a router's scale-from-zero request.

`decide` is a pure function of its inputs and state, so the algorithm is tested without a
database. Samples and state live in the leader's memory: a new leader starts observing afresh
and scales nothing down until it has watched a full stable window.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane import audit
from control_plane.audit import Actor
from control_plane.context import AppContext
from control_plane.db.models import AutoscalerDecision, Deployment, Node
from control_plane.leader import Fence, check_fence
from meridian.contracts import AutoscalingSpec, NodeStatus

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


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    mode: str  # "stable" or "panic"
    reason: str
    inputs: dict[str, Any]
    state: KpaState

    def changes(self, current: int) -> bool:
        return self.desired != current


def _mean(samples: Sequence[Sample]) -> float:
    return sum(s.concurrency for s in samples) / len(samples) if samples else 0.0


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
    stable_w = spec.stable_window_s
    panic_w = stable_w * spec.panic_window_pct / 100.0
    all_samples = sorted(samples, key=lambda s: s.at)
    stable = [s for s in all_samples if s.at > now - stable_w]
    panic = [s for s in all_samples if s.at > now - panic_w]
    observing_since = state.observing_since
    if observing_since is None:
        observing_since = all_samples[0].at if all_samples else now
    covered = now - observing_since >= stable_w
    avg_stable = _mean(stable)
    avg_panic = _mean(panic) if panic else avg_stable
    want_stable = math.ceil(avg_stable / spec.target_concurrency)
    want_panic = math.ceil(avg_panic / spec.target_concurrency)
    # Knative: rates and the panic threshold are relative to the ready replicas, at least one.
    base = max(1, ready)
    max_up = math.ceil(spec.max_scale_up_rate * base)
    max_down = math.floor(base / spec.max_scale_down_rate)
    over_threshold = (avg_panic / spec.target_concurrency) / base >= spec.panic_threshold_pct / 100.0

    panic_since = state.panic_since
    max_panic = state.max_panic
    notes: list[str] = []
    if over_threshold:
        if panic_since is None:
            notes.append(f"entering panic: {avg_panic:.1f} in flight over {panic_w:g}s needs "
                         f"≥{spec.panic_threshold_pct:g}% of {base} ready")
        panic_since = now
    elif panic_since is not None and now - panic_since >= stable_w:
        notes.append(f"leaving panic: below the threshold for {stable_w:g}s")
        panic_since, max_panic = None, 0

    mode = "panic" if panic_since is not None else "stable"
    if mode == "panic":
        # Provision for the larger of both windows.
        raw = max(want_panic, want_stable)
        notes.append(f"panic: {avg_panic:.1f} in flight over {panic_w:g}s / {spec.target_concurrency:g} per replica")
    else:
        raw = want_stable
        notes.append(f"stable: {avg_stable:.1f} in flight over {stable_w:g}s / {spec.target_concurrency:g} per replica")
    wanted = min(max(raw, max_down), max_up)
    if wanted != raw:
        notes.append(f"rate-limited from {raw} to {wanted} (×{spec.max_scale_up_rate:g} up, "
                     f"÷{spec.max_scale_down_rate:g} down of {base} ready)")
    if mode == "panic":
        # Panic only scales up: never below what is in force or was wanted earlier in this panic.
        wanted = max(wanted, current, max_panic)
        max_panic = wanted

    # Scale-down delay: apply the highest count wanted within the delay (the unobserved past
    # before this leader started counts as wanting the count in force).
    history = tuple((t, n) for t, n in state.wanted if t > now - spec.scale_down_delay_s) + ((now, wanted),)
    delayed = max(n for _, n in history)
    if now - observing_since < spec.scale_down_delay_s:
        delayed = max(delayed, current)
    desired = delayed
    if wanted < desired <= current:
        notes.append(f"scale-down to {wanted} delayed: {desired} was wanted within {spec.scale_down_delay_s:g}s")
    if not covered and desired < current:
        desired = current
        notes.append(f"no scale-down yet: observed {now - observing_since:.0f}s of a {stable_w:g}s window")
    if since_scale_request_s is not None and since_scale_request_s < stable_w and desired < 1 <= current:
        desired = 1
        notes.append(f"kept at 1: scale-from-zero request {since_scale_request_s:.0f}s ago")
    bounded = max(min_replicas, min(desired, max_replicas))
    if bounded != desired:
        notes.append(f"bounded to [{min_replicas}, {max_replicas}]")
    desired = bounded
    if desired == 0 and current > 0:
        notes.append(f"scale to zero: no traffic for {stable_w:g}s")

    inputs: dict[str, Any] = {
        "avg_concurrency_stable": round(avg_stable, 3),
        "avg_concurrency_panic": round(avg_panic, 3),
        "stable_samples": len(stable),
        "panic_samples": len(panic),
        "stable_window_s": stable_w,
        "panic_window_s": panic_w,
        "target_concurrency": spec.target_concurrency,
        "current": current,
        "ready": ready,
        "want_stable": want_stable,
        "want_panic": want_panic,
        "max_scale_up": max_up,
        "max_scale_down": max_down,
        "panic": mode == "panic",
        "observed_s": round(now - observing_since, 1),
        "since_scale_request_s": None if since_scale_request_s is None else round(since_scale_request_s, 1),
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
    }
    new_state = KpaState(observing_since=observing_since, panic_since=panic_since, max_panic=max_panic, wanted=history)
    verdict = f"{current} → {desired}" if desired != current else f"hold at {current}"
    return Decision(desired=desired, mode=mode, reason=f"{verdict}; " + "; ".join(notes), inputs=inputs, state=new_state)


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
    concurrency: float


def observe(session: Session) -> list[Observed]:
    """Every deployment with the load its ready nodes report now."""
    ready: dict[str, int] = {}
    load: dict[str, float] = {}
    for node in session.scalars(select(Node).where(Node.status == NodeStatus.READY.value)):
        in_flight = float((node.load or {}).get("running", 0)) + float((node.load or {}).get("waiting", 0))
        for model in node.models or ():
            ready[model] = ready.get(model, 0) + 1
            # A node serving several models reports one figure; each model is charged all of it.
            load[model] = load.get(model, 0.0) + in_flight
    return [
        Observed(
            model=d.model,
            spec=AutoscalingSpec.model_validate(d.autoscaling or {}),
            min_replicas=d.min_replicas,
            max_replicas=d.max_replicas,
            desired=d.desired_replicas,
            last_scale_request_at=d.last_scale_request_at,
            ready=ready.get(d.model, 0),
            concurrency=load.get(d.model, 0.0),
        )
        for d in session.scalars(select(Deployment).order_by(Deployment.model))
    ]


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

    def __init__(
        self,
        ctx: AppContext,
        *,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._ctx = ctx
        self._monotonic = monotonic
        self._wall = wall
        self._epoch: int | None = None
        self._tracked: dict[str, _Tracked] = {}

    async def tick(self, fence: Fence) -> list[tuple[str, Decision]]:
        """Sample, decide and write (fenced) what changed; returns the decisions made."""
        if self._epoch != fence.epoch:
            # A new term starts observing afresh (another leader may have acted meanwhile).
            self._epoch, self._tracked = fence.epoch, {}
        observed = await asyncio.to_thread(self._read)
        now = self._monotonic()
        wall = self._wall()
        decisions: list[tuple[str, Decision]] = []
        for obs in observed:
            tracked = self._tracked.setdefault(obs.model, _Tracked())
            tracked.samples.append(Sample(now, obs.concurrency))
            horizon = now - obs.spec.stable_window_s - self._ctx.settings.autoscale_interval_s
            while tracked.samples and tracked.samples[0].at < horizon:
                tracked.samples.popleft()
            decision = decide(
                obs.spec, min_replicas=obs.min_replicas, max_replicas=obs.max_replicas,
                samples=tracked.samples, current=obs.desired, ready=obs.ready, now=now, state=tracked.state,
                since_scale_request_s=self._request_age(tracked, obs.last_scale_request_at, now, wall),
            )
            hold_due = tracked.last_recorded is None or now - tracked.last_recorded >= (
                self._ctx.settings.autoscale_hold_record_s
            )
            if decision.changes(obs.desired) or hold_due:
                applied = await self._apply(fence, obs, decision, wall)
                if not applied:
                    continue  # the deployment changed under us; decide again next tick
                tracked.last_recorded = now
            tracked.state = decision.state
            decisions.append((obs.model, decision))
        for model in set(self._tracked) - {o.model for o in observed}:
            del self._tracked[model]
        return decisions

    def _read(self) -> list[Observed]:
        with self._ctx.read() as session:
            return observe(session)

    @staticmethod
    def _request_age(tracked: _Tracked, request_at: datetime | None, now: float, wall: datetime) -> float | None:
        if request_at is None:
            return None
        if request_at != tracked.request_at:
            tracked.request_at, tracked.request_seen = request_at, now
        return max(0.0, min((wall - request_at).total_seconds(), now - tracked.request_seen))

    async def _apply(self, fence: Fence, obs: Observed, decision: Decision, wall: datetime) -> bool:
        def write() -> bool:
            with self._ctx.write() as session:
                check_fence(session, fence)
                row = session.scalars(select(Deployment).where(Deployment.model == obs.model).with_for_update()).first()
                # A scale-up request or an operator's edit since the read: decide again on fresh data.
                if row is None or row.desired_replicas != obs.desired or (
                    row.last_scale_request_at != obs.last_scale_request_at
                ) or (row.min_replicas, row.max_replicas) != (obs.min_replicas, obs.max_replicas):
                    return False
                session.add(AutoscalerDecision(
                    model=obs.model, at=wall, mode=decision.mode, inputs=decision.inputs, current=obs.desired,
                    desired=decision.desired, reason=decision.reason[:500], epoch=fence.epoch,
                ))
                if decision.changes(obs.desired):
                    row.desired_replicas = decision.desired
                    row.last_scale_reason = f"autoscaler: {decision.reason}"[:200]
                    row.updated_at = wall
                    audit.record(session, ACTOR, action="scale", resource_type="deployment", resource_id=obs.model,
                                 before={"desired_replicas": obs.desired},
                                 after={"desired_replicas": decision.desired, "mode": decision.mode},
                                 now=wall)
                return True

        applied = await asyncio.to_thread(write)
        if applied and decision.changes(obs.desired):
            log.info("autoscaler: %s %s", obs.model, decision.reason)
        return applied

