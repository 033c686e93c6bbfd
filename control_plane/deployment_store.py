"""Deployments at rest: create/update, scale-up requests, and their place in the routing table."""

from __future__ import annotations

import uuid
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane.db.models import Deployment
from control_plane.errors import NotFound
from control_plane.routing_table import bump_version
from meridian.contracts import DeploymentView, RegionInfo, ScaleUpRequest


def _routing_fields(row: Deployment) -> tuple[object, ...]:
    """What routers see of a deployment; a change here is a new routing version."""
    return (row.model, row.zone, row.min_replicas, row.max_replicas)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(value, high))


def upsert(
    session: Session, model: str, *, zone: str, min_replicas: int, max_replicas: int, now: datetime
) -> tuple[Deployment, bool]:
    """Create or update the deployment of `model`; returns it and whether it was created.

    A new deployment starts at `min_replicas`; an update keeps the desired count that
    scale-ups reached, clamped into the new bounds.
    """
    row = session.scalars(select(Deployment).where(Deployment.model == model).with_for_update()).one_or_none()
    created = row is None
    before = None if row is None else _routing_fields(row)
    if row is None:
        row = Deployment(id=str(uuid.uuid4()), model=model, desired_replicas=min_replicas, created_at=now)
        session.add(row)
    row.zone = zone
    row.min_replicas = min_replicas
    row.max_replicas = max_replicas
    row.desired_replicas = _clamp(row.desired_replicas, min_replicas, max_replicas)
    row.updated_at = now
    session.flush()
    if _routing_fields(row) != before:
        bump_version(session)
    return row, created


def get(session: Session, model: str, *, for_update: bool = False) -> Deployment:
    """The deployment of `model`; NotFound when there is none."""
    query = select(Deployment).where(Deployment.model == model)
    if for_update:
        query = query.with_for_update()
    row = session.scalars(query).one_or_none()
    if row is None:
        raise NotFound(f"no deployment of model {model!r}")
    return row


def list_deployments(session: Session) -> list[Deployment]:
    return list(session.scalars(select(Deployment).order_by(Deployment.model)).all())


def delete(session: Session, model: str) -> None:
    """Remove the deployment of `model`; NotFound when there is none."""
    session.delete(get(session, model, for_update=True))
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
        last_scale_request_at=row.last_scale_request_at,
        last_scale_reason=row.last_scale_reason,
        last_scale_region=row.last_scale_region,
        created_at=row.created_at,
        updated_at=row.updated_at,
    )

