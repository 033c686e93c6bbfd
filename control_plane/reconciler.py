"""The reconciler: moves the fleet's node groups towards the applied placement and the
autoscaler's replica counts, through the providers' drivers.

Each tick of the leader (see control_plane.leader):

1. reads the applied placement plan (its shape: which regions and instance types each
   deployment runs on, and their baseline replica counts) and each deployment's
   `desired_replicas`, and spreads the desired count over the plan's groups (`target_sizes`);
2. takes, per node group, the next idempotent step towards its target: `create`,
   `scale_up`, `drain` (mark the nodes to remove draining so routers stop sending, then
   wait until their heartbeats show no request in flight, or the drain timeout),
   `scale_down` (terminate the drained nodes), `undrain` (the target rose again) and
   `delete` (a group the plan dropped, once empty).

Every step writes a `reconcile_steps` row and an audit entry in one transaction that first
checks the leader's fencing epoch. A failed step is retried after exponential backoff with
jitter (`node_groups.retry_at`), recorded each time; one that cannot succeed by retrying (a
provider's non-retryable error, or a group on a provider this control plane has no driver for,
left by a plan applied before its driver was turned off) waits the longest backoff, and its
error says what to do. Backoffs, drain timeouts and records
read the app's clock (`AppContext.clock`).

What the reconciler aims at and sees (targets, the snapshot, its states and steps) is pure
and lives in control_plane.reconcile_state; this module takes the steps.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from control_plane import audit
from control_plane.audit import Actor
from control_plane.context import AppContext
from control_plane.db.models import Node, NodeDrain, NodeGroup, ReconcileStep
from control_plane.leader import Deposed, Fence, check_fence
from control_plane.reconcile_state import (
    GroupKey,
    GroupRow,
    NodeGroupState,
    PlacedGroup,
    Snapshot,
    StepAction,
    StepOutcome,
    choose_victims,
    group_row,
    read_snapshot,
    stale_drains,
    state_after,
)
from control_plane.routing_table import bump_version
from meridian.backoff import Backoff
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import NodeRole, NodeStatus
from meridian.registry import UnknownName
from meridian.settings.providers import ProviderSettings
from providers.driver import DriverRegistry, GroupSpec, GroupState
from providers.errors import ProviderError
from providers.onprem.inventory import Inventory, load_inventory
from providers.provider import PROVIDERS, ProviderConfig, ProviderRegistry

log = logging.getLogger(__name__)

ACTOR = Actor.system("reconciler")
T = TypeVar("T")


# --- the reconciler ----------------------------------------------------------------------


def group_as_dict(g: NodeGroup) -> dict[str, Any]:
    """A node group as the audit log and the API show it."""
    return {
        "id": g.id, "model": g.model, "provider": g.provider, "region": g.region,
        "instance_type": g.instance_type, "sku": g.sku, "spot": g.spot, "role": g.role, "gpus_per_node": g.gpus_per_node,
        "desired_size": g.desired_size, "current_size": g.current_size, "nodes": list(g.nodes or ()),
        "state": g.state, "failures": g.failures,
        "retry_at": g.retry_at.isoformat() if g.retry_at else None, "last_error": g.last_error,
        "resource_version": g.resource_version,
    }


@dataclass(frozen=True, slots=True)
class StepResult:
    """What a step did, as the tick reports it (tests and logs)."""

    group_id: str
    action: StepAction
    target: int
    outcome: StepOutcome
    error: str | None = None


@dataclass
class _DrainWatch:
    """What this leader saw of a node when it first met it draining: a later heartbeat is fresh."""

    heartbeat: datetime | None
    since: float  # monotonic


@dataclass
class _Term:
    """In-memory state of one leadership term (reset when the epoch changes)."""

    epoch: int
    synced: set[str] = field(default_factory=set)
    drain_watch: dict[str, _DrainWatch] = field(default_factory=dict)


class Reconciler:
    """Takes the steps that bring node groups to their targets; `tick` is one pass (leader only)."""

    def __init__(self, ctx: AppContext, drivers: DriverRegistry) -> None:
        self._ctx = ctx
        self._drivers = drivers
        self._clock = ctx.clock
        self._backoff = Backoff(
            base_s=ctx.settings.reconcile_backoff_base_s, max_s=ctx.settings.reconcile_backoff_max_s
        )
        self._term: _Term | None = None

    async def tick(self, fence: Fence) -> list[StepResult]:
        """One pass over every node group; raises Deposed when another replica took over."""
        if self._term is None or self._term.epoch != fence.epoch:
            # A new term knows nothing of its predecessor's drivers or drain observations.
            self._term = _Term(epoch=fence.epoch)
        snap = await asyncio.to_thread(self._read)
        results: list[StepResult] = []
        for key in sorted(set(snap.targets) | set(snap.groups)):
            results.extend(await self._reconcile_group(fence, key, snap))
        stale = stale_drains(snap)
        if stale:
            await self._write(fence, lambda s: s.execute(delete(NodeDrain).where(NodeDrain.node_id.in_(stale))))
        return results

    def _read(self) -> Snapshot:
        with self._ctx.read() as session:
            return read_snapshot(session)

    async def _write(self, fence: Fence, fn: Callable[[Session], T]) -> T:
        def run() -> T:
            with self._ctx.write() as session:
                check_fence(session, fence)
                return fn(session)

        return await asyncio.to_thread(run)

    async def _check_leading(self, fence: Fence) -> None:
        # Before a driver call: a deposed leader must not act on the provider either.
        def run() -> None:
            with self._ctx.read() as session:
                check_fence(session, fence)

        await asyncio.to_thread(run)

    async def _driver_call(self, fn: Callable[[], Awaitable[T]]) -> T:
        return await asyncio.wait_for(fn(), self._ctx.settings.driver_timeout_s)

    # --- per group ---------------------------------------------------------------------

    async def _reconcile_group(self, fence: Fence, key: GroupKey, snap: Snapshot) -> list[StepResult]:
        target = snap.targets.get(key, 0)
        row = snap.groups.get(key)
        now = self._clock.now()
        if row is None:
            placed = snap.placed.get(key)
            if target == 0 or placed is None:
                return []
            row = await self._write(fence, lambda s: _insert_group(s, placed, target, now))
        dropped = target == 0 and key not in snap.placed and not row.nodes
        if dropped and row.provider not in self._drivers.providers():
            # Never created (no driver for its provider): only its row to drop, no backoff to wait out.
            return [await self._delete(fence, row)]
        if row.retry_at is not None and row.retry_at > now:
            return []  # backing off after a failed step
        if dropped:
            return [await self._delete(fence, row)]
        results: list[StepResult] = []
        term = self._term
        assert term is not None
        if row.id not in term.synced:
            result, row = await self._create(fence, row, target)
            if result is not None:
                results.append(result)
            if row.id not in term.synced:
                return results
        drains = {n: at for n, at in snap.drains.get(row.id, {}).items() if n in row.nodes}
        current = len(row.nodes)
        if drains and target >= current:
            results.append(await self._undrain(fence, row, target, list(drains)))
            drains = {}
        if target > current:
            results.append(await self._scale_up(fence, row, target))
        elif target < current:
            results.extend(await self._scale_down(fence, row, target, drains, snap))
        elif current == 0 and key not in snap.placed:
            results.append(await self._delete(fence, row))
        elif row.desired_size != target or row.state is not NodeGroupState.READY:
            await self._write(fence, lambda s: _set_target(s, row.id, target, NodeGroupState.READY, now))
        return results

    async def _create(self, fence: Fence, row: GroupRow, target: int) -> tuple[StepResult | None, GroupRow]:
        """Ensure the group exists at the provider, adopting the nodes recorded for it."""
        term = self._term
        assert term is not None
        await self._check_leading(fence)
        try:
            driver = self._drivers.get_driver(row.provider)
            state = await self._driver_call(lambda: driver.ensure_group(row.spec, row.nodes))
        except Exception as e:
            return await self._record(fence, row, StepAction.CREATE, target, error=e), row
        term.synced.add(row.id)
        # Recorded when it creates the group or clears an error; a plain adoption is silent.
        if row.state in (NodeGroupState.CREATING, NodeGroupState.ERROR) or state.nodes != row.nodes:
            result = await self._record(fence, row, StepAction.CREATE, target, state=state)
            return result, _with_nodes(row, state)
        return None, row

    async def _scale_up(self, fence: Fence, row: GroupRow, target: int) -> StepResult:
        await self._check_leading(fence)
        try:
            driver = self._drivers.get_driver(row.provider)
            state = await self._driver_call(lambda: driver.resize(row.spec, target))
        except Exception as e:
            return await self._record(fence, row, StepAction.SCALE_UP, target, error=e)
        return await self._record(fence, row, StepAction.SCALE_UP, target, state=state)

    async def _undrain(self, fence: Fence, row: GroupRow, target: int, nodes: list[str]) -> StepResult:
        term = self._term
        assert term is not None
        for n in nodes:
            term.drain_watch.pop(n, None)
        detail = f"target rose to {target}; no longer removing {', '.join(sorted(nodes))}"
        return await self._record(fence, row, StepAction.UNDRAIN, target, undrain=nodes, detail=detail)

    async def _scale_down(
        self, fence: Fence, row: GroupRow, target: int, drains: dict[str, datetime], snap: Snapshot
    ) -> list[StepResult]:
        term = self._term
        assert term is not None
        results: list[StepResult] = []
        need = len(row.nodes) - target
        if len(drains) > need:
            # The target rose part of the way back: keep the nodes marked last.
            extra = sorted(drains, key=lambda n: (drains[n], n), reverse=True)[: len(drains) - need]
            for n in extra:
                drains.pop(n)
                term.drain_watch.pop(n, None)
            results.append(await self._record(fence, row, StepAction.UNDRAIN, target, undrain=extra,
                                              detail=f"target {target}: keeping {', '.join(sorted(extra))}"))
        mono = self._clock.monotonic()
        fresh: dict[str, datetime | None] = {}
        if len(drains) < need:
            victims = choose_victims([n for n in row.nodes if n not in drains], snap.nodes, need - len(drains))
            results.append(await self._record(
                fence, row, StepAction.DRAIN, target, drain=victims, outcome=StepOutcome.PENDING, heartbeats_at_drain=fresh,
                detail=f"draining {', '.join(victims)} before removing them",
            ))
            for n in victims:
                drains[n] = self._clock.now()
                term.drain_watch[n] = _DrainWatch(fresh.get(n), mono)
        drained: list[str] = []
        timed_out: list[str] = []
        # Skew-proof: a drain is over when this leader sees a heartbeat other than the last one
        # before the drain began (whatever the clocks of the replicas that stamped them) showing
        # nothing in flight. A new leader starts watching afresh.
        timeout = self._ctx.settings.reconcile_drain_timeout_s
        for n in sorted(drains):
            seen = snap.nodes.get(n)
            if n not in term.drain_watch:
                term.drain_watch[n] = _DrainWatch(seen.last_heartbeat if seen else None, mono)
            watch = term.drain_watch[n]
            if fresh.get(n) is not None:
                continue  # registered when marked: what the snapshot says of it predates the drain
            if seen is None or seen.status == NodeStatus.LOST.value:
                drained.append(n)
            elif seen.last_heartbeat != watch.heartbeat and seen.in_flight == 0:
                drained.append(n)
            elif mono - watch.since >= timeout:
                timed_out.append(n)
        if not drained and not timed_out:
            return results
        await self._check_leading(fence)
        removed = [*drained, *timed_out]
        state: GroupState | None = None
        try:
            driver = self._drivers.get_driver(row.provider)
            for n in removed:
                state = await self._driver_call(_bind(driver.terminate, row.spec, n))
        except Exception as e:
            results.append(await self._record(fence, row, StepAction.SCALE_DOWN, target, error=e, state=state))
            return results
        for n in removed:
            term.drain_watch.pop(n, None)
        detail = f"removed {', '.join(removed)}"
        if timed_out:
            detail += f" (drain timed out after {timeout:g}s with requests in flight on {', '.join(timed_out)})"
        results.append(await self._record(fence, row, StepAction.SCALE_DOWN, target, state=state, detail=detail))
        return results

    async def _delete(self, fence: Fence, row: GroupRow) -> StepResult:
        await self._check_leading(fence)
        try:
            driver = self._drivers.get_driver(row.provider)
            await self._driver_call(lambda: driver.delete_group(row.spec))
        except UnknownName as e:
            # A group never created (no driver for its provider) leaves only its row to delete.
            if row.nodes:
                return await self._record(fence, row, StepAction.DELETE, 0, error=e)
        except Exception as e:
            return await self._record(fence, row, StepAction.DELETE, 0, error=e)
        if self._term is not None:
            self._term.synced.discard(row.id)
        return await self._record(fence, row, StepAction.DELETE, 0, delete_group=True, detail="the placement no longer has it")

    async def _record(
        self,
        fence: Fence,
        row: GroupRow,
        action: StepAction,
        target: int,
        *,
        state: GroupState | None = None,
        error: BaseException | None = None,
        outcome: StepOutcome | None = None,
        detail: str | None = None,
        drain: Sequence[str] = (),
        heartbeats_at_drain: dict[str, datetime | None] | None = None,
        undrain: Sequence[str] = (),
        delete_group: bool = False,
    ) -> StepResult:
        """Write the step, the group's new state and an audit entry, fenced, in one transaction."""
        now = self._clock.now()
        outcome = StepOutcome.ERROR if error is not None else (outcome or StepOutcome.OK)
        message = _error_text(error) if error is not None else None
        if error is not None:
            log.warning("reconciler: %s of group %s (%s %s %s) failed: %s",
                        action, row.id, row.model, row.region, row.instance_type, message)
        else:
            log.info("reconciler: %s group %s (%s %s %s) → %d%s", action, row.id, row.model, row.region,
                     row.instance_type, target, f": {detail}" if detail else "")

        def write(session: Session) -> StepResult:
            group = session.get(NodeGroup, row.id)
            if group is None:
                raise Deposed(f"node group {row.id} vanished under the reconciler")
            before = group_as_dict(group)
            attempt = group.failures + 1
            next_attempt_at: datetime | None = None
            if state is not None:
                added = [n for n in state.nodes if n not in (group.nodes or ())]
                if added:
                    # A host allocated afresh is no longer being drained from an earlier life.
                    session.execute(delete(NodeDrain).where(NodeDrain.node_id.in_(added)))
                group.nodes = list(state.nodes)
                group.current_size = state.size
                group.gpus_per_node = state.gpus_per_node
            if error is not None:
                group.failures = attempt
                retryable = not isinstance(error, UnknownName) and (
                    not isinstance(error, ProviderError) or error.retryable
                )
                delay = self._backoff.delay(attempt) if retryable else self._backoff.max_s
                next_attempt_at = now + timedelta(seconds=delay)
                group.retry_at = next_attempt_at
                group.last_error = message
                group.state = NodeGroupState.ERROR.value
            else:
                group.failures = 0
                group.retry_at = None
                group.last_error = None
                group.state = state_after(action, outcome, group.current_size, target).value
            if drain:
                marked = _mark_draining(session, group.id, drain, now)
                if heartbeats_at_drain is not None:
                    heartbeats_at_drain.update(marked)
            if undrain:
                session.execute(delete(NodeDrain).where(NodeDrain.node_id.in_(list(undrain))))
            group.desired_size = target
            group.resource_version += 1
            group.updated_at = now
            session.add(ReconcileStep(
                at=now, node_group_id=group.id, model=group.model, action=action.value, target=target,
                outcome=outcome.value, attempt=attempt, detail=detail[:1000] if detail else None,
                error=message, next_attempt_at=next_attempt_at, epoch=fence.epoch,
            ))
            after: dict[str, Any] | None = group_as_dict(group)
            if delete_group:
                session.execute(delete(NodeDrain).where(NodeDrain.node_group_id == group.id))
                session.delete(group)
                after = None
            audit.record(session, ACTOR, action=action.value, resource_type="node_group",
                         resource_id=_resource_id(group),
                         before=before, after=after, now=now)
            return StepResult(group_id=group.id, action=action, target=target, outcome=outcome, error=message)

        return await self._write(fence, write)


def _resource_id(g: NodeGroup) -> str:
    """The audit log's name of a group: a prefill or decode group is suffixed with its role."""
    base = f"{g.model}@{g.region}/{g.instance_type}"
    return base if g.role == NodeRole.BOTH.value else f"{base}/{g.role}"


def _error_text(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, TimeoutError):
        text = "the provider did not answer in time"
    elif isinstance(error, UnknownName):
        text = (f"this control plane has no driver for provider {error.name!r} (MERIDIAN_PROVIDER_ENABLED:"
                f" {', '.join(error.known) or 'none'}); enable it, or preview and apply a plan without it")
    return f"{type(error).__name__}: {text}"[:1000]


def _with_nodes(row: GroupRow, state: GroupState) -> GroupRow:
    return replace(row, current_size=state.size, nodes=state.nodes, failures=0, retry_at=None)


def _insert_group(session: Session, placed: PlacedGroup, target: int, now: datetime) -> GroupRow:
    group = NodeGroup(
        id=str(uuid.uuid4()), model=placed.model, provider=placed.provider, region=placed.region,
        instance_type=placed.instance_type, sku=placed.sku, spot=placed.spot, role=placed.role.value, gpus_per_node=0,
        desired_size=target, current_size=0, nodes=[], state=NodeGroupState.CREATING.value, failures=0, resource_version=1,
        created_at=now, updated_at=now,
    )
    session.add(group)
    session.flush()
    return group_row(group)


def _set_target(session: Session, group_id: str, target: int, state: NodeGroupState, now: datetime) -> None:
    group = session.get(NodeGroup, group_id)
    if group is not None:
        group.desired_size = target
        group.state = state.value
        group.failures = 0
        group.retry_at = None
        group.last_error = None
        group.resource_version += 1
        group.updated_at = now


def _mark_draining(
    session: Session, group_id: str, node_ids: Sequence[str], now: datetime
) -> dict[str, datetime | None]:
    """Record the drain and take the nodes out of routing now (their heartbeats keep them out);
    returns each node's last heartbeat as of the drain (None: not registered)."""
    for n in node_ids:
        session.merge(NodeDrain(node_id=n, node_group_id=group_id, requested_at=now))
    marked = session.execute(
        update(Node)
        .where(Node.node_id.in_(list(node_ids)), Node.status.in_([NodeStatus.READY.value, NodeStatus.STARTING.value]))
        .values(status=NodeStatus.DRAINING.value)
        .execution_options(synchronize_session=False)
    )
    if marked.rowcount:
        bump_version(session)
    # Read after the update: on Postgres the nodes it marked stay row-locked (their heartbeats wait) until commit.
    rows = session.execute(select(Node.node_id, Node.last_heartbeat).where(Node.node_id.in_(list(node_ids))))
    seen = {node_id: at for node_id, at in rows}
    return {n: seen.get(n) for n in node_ids}


def _bind(fn: Callable[[GroupSpec, str], Awaitable[T]], spec: GroupSpec, node: str) -> Callable[[], Awaitable[T]]:
    return lambda: fn(spec, node)


# --- drivers ------------------------------------------------------------------------------


def default_drivers(
    onprem_inventory: Path | Inventory | None,
    settings: ProviderSettings | None = None,
    providers: ProviderRegistry | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> DriverRegistry:
    """The drivers of the enabled providers (`MERIDIAN_PROVIDER_ENABLED`, on-prem alone by
    default), waiting on `clock` (the control plane's); each cloud's SDK is imported only
    when its provider is enabled."""
    config = ProviderConfig(settings or ProviderSettings(), load_inventory(onprem_inventory), clock)
    registry = providers or PROVIDERS
    drivers = DriverRegistry()
    for name in config.settings.enabled:
        drivers.register_driver(registry.create(name, config).driver())
    return drivers
