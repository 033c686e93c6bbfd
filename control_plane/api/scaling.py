"""Fleet-loop state for operators: who leads, node groups, reconcile steps, autoscaler decisions,
and where each loop stands: the reconciler's desired against actual nodes and its errors, the
autoscaler's counts per deployment with its last decision."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel
from sqlalchemy import select
from sqlalchemy.orm import Session

from control_plane import autoscaler, leader
from control_plane.api.pagination import PageParams, list_page, page_params, paginate, set_next_link
from control_plane.auth import Ctx, require_scopes
from control_plane.db.models import AutoscalerDecision, Deployment, NodeDrain, NodeGroup, ReconcileStep
from control_plane.reconcile_state import read_snapshot, reconciler_status
from control_plane.scopes import FLEET_READERS
from meridian.admin_api import AutoscalerDecisionView, AutoscalerStatus, ReconcilerStatus
from meridian.contracts import NodeRole

router = APIRouter(prefix="/v1", dependencies=[Depends(require_scopes(FLEET_READERS))], tags=["scaling"])
Page = Annotated[PageParams, Depends(page_params)]
ModelQuery = Annotated[str | None, Query(min_length=1, max_length=200, description="only this deployment's")]


class LeaderView(BaseModel):
    """Who leads the reconciler and autoscaler, and how this replica sees it."""

    name: str
    backend: str
    # The leadership as last recorded in the database (None before any replica led).
    holder: str | None
    epoch: int
    acquired_at: datetime | None
    renewed_at: datetime | None
    expires_at: datetime | None
    # The replica that answered, and whether it leads now.
    replica: str | None
    is_leader: bool
    leader_since: datetime | None


class NodeGroupView(BaseModel):
    id: str
    model: str
    provider: str
    region: str
    instance_type: str
    sku: str
    spot: bool
    # The nodes' prefill/decode role ("both": co-located).
    role: NodeRole = NodeRole.BOTH
    gpus_per_node: int
    desired_size: int
    current_size: int
    nodes: list[str]
    draining: list[str]
    state: str
    failures: int
    retry_at: datetime | None
    last_error: str | None
    resource_version: int
    created_at: datetime
    updated_at: datetime


class ReconcileStepView(BaseModel):
    id: int
    at: datetime
    node_group_id: str
    model: str
    action: str
    target: int
    outcome: str
    attempt: int
    detail: str | None
    error: str | None
    next_attempt_at: datetime | None
    epoch: int


@router.get("/leader")
def get_leader(ctx: Ctx, request: Request) -> LeaderView:
    """The fleet loops' leader; on Postgres the recorded holder may trail a takeover by one check."""
    elector: leader.LeaderElector | None = getattr(request.app.state, "elector", None)
    with ctx.read() as session:
        row = leader.leadership(session)
        backend = "postgres-advisory-lock" if ctx.engine.dialect.name == "postgresql" else "sqlite-lease"
        return LeaderView(
            name=leader.FLEET,
            backend=backend,
            holder=row.holder if row else None,
            epoch=row.epoch if row else 0,
            acquired_at=row.acquired_at if row else None,
            renewed_at=row.renewed_at if row else None,
            expires_at=row.expires_at if row else None,
            replica=elector.holder if elector else None,
            is_leader=bool(elector and elector.is_leader),
            leader_since=elector.since if elector else None,
        )


@router.get("/node-groups")
def list_node_groups(
    ctx: Ctx, request: Request, response: Response, page: Page, model: ModelQuery = None
) -> list[NodeGroupView]:
    """Node groups the reconciler runs, by deployment."""
    query = select(NodeGroup)
    if model is not None:
        query = query.where(NodeGroup.model == model)
    with ctx.read() as session:
        rows, next_cursor = paginate(session, query, [NodeGroup.model, NodeGroup.id], page)
        drains: dict[str, list[str]] = {}
        ids = [g.id for g in rows]
        for d in session.scalars(select(NodeDrain).where(NodeDrain.node_group_id.in_(ids))) if ids else ():
            drains.setdefault(d.node_group_id, []).append(d.node_id)
        views = [
            NodeGroupView(
                id=g.id, model=g.model, provider=g.provider, region=g.region, instance_type=g.instance_type,
                sku=g.sku, spot=g.spot, role=NodeRole(g.role), gpus_per_node=g.gpus_per_node, desired_size=g.desired_size,
                current_size=g.current_size, nodes=list(g.nodes or ()),
                draining=sorted(n for n in drains.get(g.id, []) if n in (g.nodes or ())),
                state=g.state, failures=g.failures, retry_at=g.retry_at, last_error=g.last_error,
                resource_version=g.resource_version, created_at=g.created_at, updated_at=g.updated_at,
            )
            for g in rows
        ]
    set_next_link(request, response, next_cursor)
    return views


@router.get("/reconciler/status")
def get_reconciler_status(ctx: Ctx) -> ReconcilerStatus:
    """The placement in force against what the providers hold: in force, reconciling or failing
    (with the error), and per node group the nodes desired and actual."""
    with ctx.read() as session:
        return reconciler_status(read_snapshot(session))


@router.get("/reconciler/steps")
def list_reconcile_steps(
    ctx: Ctx,
    request: Request,
    response: Response,
    page: Page,
    model: ModelQuery = None,
    node_group_id: Annotated[str | None, Query(max_length=36)] = None,
) -> list[ReconcileStepView]:
    """Steps the reconciler took, newest first."""
    query = select(ReconcileStep)
    if model is not None:
        query = query.where(ReconcileStep.model == model)
    if node_group_id is not None:
        query = query.where(ReconcileStep.node_group_id == node_group_id)
    return list_page(ctx, request, response, page, query, [ReconcileStep.id], _step_view, descending=True)


def _step_view(s: ReconcileStep) -> ReconcileStepView:
    return ReconcileStepView(
        id=s.id, at=s.at, node_group_id=s.node_group_id, model=s.model, action=s.action, target=s.target,
        outcome=s.outcome, attempt=s.attempt, detail=s.detail, error=s.error,
        next_attempt_at=s.next_attempt_at, epoch=s.epoch,
    )


@router.get("/autoscaler/decisions")
def list_autoscaler_decisions(
    ctx: Ctx, request: Request, response: Response, page: Page, model: ModelQuery = None
) -> list[AutoscalerDecisionView]:
    """The autoscaler's decisions with their inputs and reasons, newest first."""
    query = select(AutoscalerDecision)
    if model is not None:
        query = query.where(AutoscalerDecision.model == model)
    return list_page(ctx, request, response, page, query, [AutoscalerDecision.id], _decision_view, descending=True)


def _decision_view(d: AutoscalerDecision) -> AutoscalerDecisionView:
    return AutoscalerDecisionView(
        id=d.id, model=d.model, at=d.at, mode=d.mode, current=d.current, desired=d.desired,
        reason=d.reason, inputs=dict(d.inputs or {}), epoch=d.epoch,
    )


# A pool's last decision is looked for among this many of its deployment's latest ones.
_DECISIONS_SCANNED = 200


@router.get("/autoscaler/status")
def list_autoscaler_status(
    ctx: Ctx, request: Request, response: Response, page: Page, model: ModelQuery = None
) -> list[AutoscalerStatus]:
    """Per deployment (per pool when disaggregated): replica bounds, ready and desired replicas,
    and the autoscaler's last recorded decision with its reason."""
    query = select(Deployment)
    if model is not None:
        query = query.where(Deployment.model == model)
    with ctx.read() as session:
        rows, next_cursor = paginate(session, query, [Deployment.model], page)
        views = []
        for obs in autoscaler.observe_rows(session, rows, ctx.regions, ctx.settings.router_backlog_ttl_s):
            last = _last_decisions(session, obs.model)
            views.extend(
                AutoscalerStatus(model=obs.model, pool=p.pool, min_replicas=p.min_replicas, max_replicas=p.max_replicas,
                                 ready=p.ready, desired=p.desired, last_decision=last.get(p.pool))
                for p in autoscaler.pools_of(obs)
            )
    set_next_link(request, response, next_cursor)
    return views


def _last_decisions(session: Session, model: str) -> dict[NodeRole, AutoscalerDecisionView]:
    """The latest recorded decision of each of a deployment's pools."""
    query = (select(AutoscalerDecision).where(AutoscalerDecision.model == model)
             .order_by(AutoscalerDecision.id.desc()).limit(_DECISIONS_SCANNED))
    last: dict[NodeRole, AutoscalerDecisionView] = {}
    for d in session.scalars(query):
        pool = autoscaler.decision_pool(d.inputs)
        if pool not in last:
            last[pool] = _decision_view(d)
    return last
