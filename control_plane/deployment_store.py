"""Deployments at rest: create/update, scale-up requests, and their place in the routing table."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import Deployment
from control_plane.errors import NotFound
from control_plane.routing_table import bump_version
from meridian.contracts import (
    AutoscalingSpec,
    DeploymentView,
    DisaggregationSpec,
    PlacementSpec,
    RegionInfo,
    ScaleUpRequest,
)


def _routing_fields(row: Deployment) -> tuple[object, ...]:
    """What routers see of a deployment; a change here is a new routing version."""
    return (row.model, row.zone, row.min_replicas, row.max_replicas)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


def _spec_fields(row: Deployment) -> tuple[object, ...]:
    return (row.zone, row.min_replicas, row.max_replicas, row.placement, row.autoscaling, row.disaggregation)


def disaggregation_of(row: Deployment) -> DisaggregationSpec | None:
    """The deployment's prefill/decode topology; None: co-located."""
    return DisaggregationSpec.model_validate(row.disaggregation) if row.disaggregation is not None else None


def _desired_prefill(row: Deployment, spec: DisaggregationSpec | None) -> int | None:
    """The prefill pool's count: kept (clamped into the new bounds) across updates, started at
    its minimum, None while co-located."""
    if spec is None:
        return None
    current = row.desired_prefill_replicas
    start = spec.min_prefill_replicas if current is None else current
    return _clamp(start, spec.min_prefill_replicas, spec.max_prefill_replicas)


def find(session: Session, model: str, *, for_update: bool = False) -> Deployment | None:
    query = select(Deployment).where(Deployment.model == model)
    if for_update:
        query = query.with_for_update()
    return session.scalars(query).one_or_none()


def upsert(
    session: Session,
    model: str,
    *,
    zone: str,
    min_replicas: int,
    max_replicas: int,
    now: datetime,
    placement: PlacementSpec | None = None,
    autoscaling: AutoscalingSpec | None = None,
    disaggregation: DisaggregationSpec | None = None,
    row: Deployment | None = None,
) -> tuple[Deployment, bool, bool]:
    """Create or update the deployment of `model`; returns it, whether it was created, and
    whether its spec changed (a new version: created, or any field a client sets).

    A new deployment starts at `min_replicas`; an update keeps the desired count that
    scale-ups reached, clamped into the new bounds. Pass `row` when the caller already
    holds it locked.
    """
    if row is None:
        row = find(session, model, for_update=True)
    created = row is None
    before_routing = None if row is None else _routing_fields(row)
    before_spec = None if row is None else _spec_fields(row)
    if row is None:
        row = Deployment(
            id=str(uuid.uuid4()), model=model, desired_replicas=min_replicas, created_at=now, resource_version=1
        )
        session.add(row)
    row.zone = zone
    row.min_replicas = min_replicas
    row.max_replicas = max_replicas
    row.placement = (placement or PlacementSpec()).model_dump(mode="json")
    row.autoscaling = (autoscaling or AutoscalingSpec()).model_dump(mode="json")
    row.disaggregation = disaggregation.model_dump(mode="json") if disaggregation is not None else None
    row.desired_replicas = _clamp(row.desired_replicas, min_replicas, max_replicas)
    row.desired_prefill_replicas = _desired_prefill(row, disaggregation)
    changed = created or _spec_fields(row) != before_spec
    if changed and not created:
        row.resource_version += 1
    row.updated_at = now
    session.flush()
    if _routing_fields(row) != before_routing:
        bump_version(session)
    return row, created, changed


def get(session: Session, model: str, *, for_update: bool = False) -> Deployment:
    """The deployment of `model`; NotFound when there is none."""
    row = find(session, model, for_update=for_update)
    if row is None:
        raise NotFound(f"no deployment of model {model!r}")
    return row


def delete(session: Session, row: Deployment) -> None:
    """Remove a deployment."""
    session.delete(row)
    session.flush()
    bump_version(session)


def request_scale_up(
    session: Session, model: str, req: ScaleUpRequest, regions: dict[str, RegionInfo], now: datetime
) -> Deployment:
    """Ask for at least one replica (at least min_replicas, at most max_replicas); idempotent.

    Repeating the request never adds replicas beyond that: routers re-ask while requests
    wait, and several routers ask for the same deployment at once.
    """
    row = get(session, model, for_update=True)
    wanted = _clamp(max(1, row.min_replicas), 1, row.max_replicas)
    row.desired_replicas = max(row.desired_replicas, wanted)
    spec = disaggregation_of(row)
    if spec is not None and row.desired_prefill_replicas is not None:
        # A decode worker without a prefill worker serves nothing: ask for one of each.
        prefill = _clamp(max(1, spec.min_prefill_replicas), 1, spec.max_prefill_replicas)
        row.desired_prefill_replicas = max(row.desired_prefill_replicas, prefill)
    row.last_scale_request_at = now
    row.last_scale_reason = f"{req.reason} ({req.queued_requests} queued)"[:200]
    # A hint only: a region this control plane does not know is not recorded.
    row.last_scale_region = req.client_region if req.client_region in regions else None
    row.updated_at = now
    session.flush()
    return row


def view(row: Deployment) -> DeploymentView:
    return DeploymentView(
        model=row.model,
        zone=row.zone,
        min_replicas=row.min_replicas,
        max_replicas=row.max_replicas,
        desired_replicas=row.desired_replicas,
        placement=PlacementSpec.model_validate(row.placement or {}),
        autoscaling=AutoscalingSpec.model_validate(row.autoscaling or {}),
        disaggregation=disaggregation_of(row),
        desired_prefill_replicas=row.desired_prefill_replicas,
        resource_version=row.resource_version,
        last_scale_request_at=row.last_scale_request_at,
        last_scale_reason=row.last_scale_reason,
        last_scale_region=row.last_scale_region,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )



def as_dict(row: Deployment) -> dict[str, Any]:
    """The deployment as the audit log records it."""
    return view(row).model_dump(mode="json")
