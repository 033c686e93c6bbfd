"""Model specs: operators declare each model's architecture; model fit sizes it on every GPU SKU."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Depends, Header, Path, Query, Request, Response
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from control_plane import audit, model_store
from control_plane.api.etags import check_if_match, check_put_preconditions, set_etag
from control_plane.api.pagination import PageParams, list_page, page_params
from control_plane.audit import Actor
from control_plane.auth import Ctx, require_actor, require_scopes
from control_plane.db.models import ModelRecord
from control_plane.errors import Conflict
from control_plane.placement.fit import ModelFit, fit_model
from control_plane.scopes import FLEET_READERS, Scope
from meridian.admin_api import ModelFitView, ModelUpsert, ModelView, OfferingCost, SkuFitView
from meridian.contracts import PRINTABLE_PATTERN
from providers.catalog import Catalog

router = APIRouter(prefix="/v1", tags=["models"])
OperatorActor = Annotated[Actor, Depends(require_actor([Scope.ADMIN, Scope.OPERATOR]))]
fleet_readers = [Depends(require_scopes(FLEET_READERS))]
# Model names may contain '/' ("org/name"), so the path parameter takes the rest of the path.
ModelNameParam = Annotated[
    str, Path(min_length=1, max_length=200, pattern=PRINTABLE_PATTERN, examples=["meta-llama/Llama-3.1-8B"])
]

def model_view(row: ModelRecord) -> ModelView:
    return ModelView.model_validate(model_store.as_dict(row))


def _cheapest(fit: ModelFit, catalog: Catalog, sku: str, spot: bool) -> OfferingCost | None:
    best: OfferingCost | None = None
    for offering in catalog.offerings:
        if offering.sku != sku:
            continue
        cost = fit.cost_per_million_tokens(offering, spot=spot)
        price = offering.spot_price_per_hour if spot else offering.price_per_hour
        if cost is None or price is None or (best is not None and cost >= best.usd_per_million_tokens):
            continue
        best = OfferingCost(
            provider=offering.provider,
            region=offering.region,
            instance_type=offering.instance_type,
            gpu_count=offering.gpu_count,
            replicas_per_instance=fit.replicas_per_instance(offering),
            price_per_hour=price,
            spot=spot,
            usd_per_million_tokens=cost,
        )
    return best


def _fit_view(row: ModelRecord, catalog: Catalog, spot: bool) -> ModelFitView:
    fit = fit_model(model_store.spec_of(row), catalog.skus)
    fits = [
        SkuFitView(
            sku=name,
            tensor_parallel=f.tp,
            weights_gib_per_gpu=f.weights_gib_per_gpu,
            kv_cache_gib_per_gpu=f.kv_gib_per_gpu,
            overhead_gib_per_gpu=f.overhead_gib_per_gpu,
            used_gib_per_gpu=f.used_gib_per_gpu,
            usable_gib_per_gpu=f.usable_gib_per_gpu,
            decode_tokens_per_s=f.decode_tokens_per_s,
            prefill_tokens_per_s=f.prefill_tokens_per_s,
            cheapest=_cheapest(fit, catalog, name, spot),
        )
        for name, f in fit.per_sku.items()
    ]
    # Unpriced SKUs last, then by cost; the name breaks ties so the order is stable.
    fits.sort(key=lambda v: (v.cheapest is None, v.cheapest.usd_per_million_tokens if v.cheapest else 0.0, v.sku))
    return ModelFitView(
        model=row.name,
        resource_version=row.resource_version,
        fits=fits,
        does_not_fit=sorted(set(catalog.skus) - set(fit.per_sku)),
    )


# Declared before the catch-all {name:path} routes so that ".../fit" is not part of a model name.
@router.get("/models/{name:path}/fit", dependencies=fleet_readers)
def get_model_fit(
    ctx: Ctx,
    name: ModelNameParam,
    spot: Annotated[bool, Query(description="price offerings at their spot price")] = False,
) -> ModelFitView:
    """Per-SKU fit of the model: TP degree, memory per GPU, throughput and the cheapest offering."""
    with ctx.read() as session:
        row = model_store.get(session, name)
    return _fit_view(row, ctx.catalog, spot)


@router.put("/models/{name:path}")
def put_model(
    ctx: Ctx,
    actor: OperatorActor,
    name: ModelNameParam,
    body: ModelUpsert,
    response: Response,
    if_match: Annotated[str | None, Header()] = None,
    if_none_match: Annotated[str | None, Header()] = None,
) -> ModelView:
    """Create or replace a model. If-Match: its ETag (412 if it changed meanwhile);
    If-None-Match: * creates only (412 if it exists)."""
    now = ctx.clock.now()
    try:
        with ctx.write() as session:
            existing = model_store.find(session, name, for_update=True)
            check_put_preconditions(
                if_match, if_none_match, existing.resource_version if existing else None, f"model {name!r}"
            )
            saved = put_audited(session, actor, name, body, now, existing)
            view = model_view(saved.row)
    except IntegrityError as e:
        raise Conflict(f"model {name!r} was created concurrently; retry") from e
    response.status_code = 201 if saved.created else 200
    set_etag(response, saved.row.resource_version)
    return view


def put_audited(session: Session, actor: Actor, name: str, body: ModelUpsert, now: datetime,
                existing: ModelRecord | None) -> model_store.Saved:
    """Create or replace the model and record the change, in the caller's transaction
    (`existing`: the current row, locked, or None)."""
    before = model_store.as_dict(existing) if existing else None
    saved = model_store.put(session, name, body.model_dump(), now, existing)
    if saved.changed:
        audit.record(session, actor, action="create" if saved.created else "update", resource_type="model",
                     resource_id=name, before=before, after=model_store.as_dict(saved.row), now=now)
    return saved


@router.get("/models", dependencies=fleet_readers)
def list_models(
    ctx: Ctx, request: Request, response: Response, page: Annotated[PageParams, Depends(page_params)]
) -> list[ModelView]:
    return list_page(ctx, request, response, page, select(ModelRecord), [ModelRecord.name], model_view)


@router.get("/models/{name:path}", dependencies=fleet_readers)
def get_model(ctx: Ctx, name: ModelNameParam, response: Response) -> ModelView:
    with ctx.read() as session:
        view = model_view(model_store.get(session, name))
    set_etag(response, view.resource_version)
    return view


@router.delete("/models/{name:path}", status_code=204)
def delete_model(
    ctx: Ctx, actor: OperatorActor, name: ModelNameParam, if_match: Annotated[str | None, Header()] = None
) -> Response:
    """Delete a model; 409 while a deployment of it exists."""
    now = ctx.clock.now()
    with ctx.write() as session:
        row = model_store.get(session, name, for_update=True)
        check_if_match(if_match, row.resource_version)
        before = model_store.as_dict(row)
        model_store.delete(session, row)
        audit.record(session, actor, action="delete", resource_type="model", resource_id=name,
                     before=before, after=None, now=now)
    return Response(status_code=204)
