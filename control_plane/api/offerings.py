"""The GPU catalog as loaded at start-up: providers, their offerings, and the canonical SKUs."""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from pydantic import BaseModel

from control_plane.api.pagination import PageParams, page_params, paginate_items, set_next_link
from control_plane.auth import Ctx, require_scopes
from control_plane.context import AppContext
from control_plane.errors import BadRequest, NotFound
from control_plane.scopes import FLEET_READERS
from meridian.contracts import PRINTABLE_PATTERN, PROVIDER_PATTERN, REGION_PATTERN
from meridian.registry import UnknownName
from providers.offerings import Offering
from providers.skus import GpuSku, UnknownGpuError, normalise_gpu_name

router = APIRouter(prefix="/v1", dependencies=[Depends(require_scopes(FLEET_READERS))], tags=["offerings"])
ProviderParam = Annotated[str, Path(pattern=PROVIDER_PATTERN)]
# Any spelling of a GPU ("A100 80GB", "a100-80gb", "p4de.24xlarge") is looked up; the answer is canonical.
GpuSpelling = Annotated[str, Path(min_length=1, max_length=64, pattern=PRINTABLE_PATTERN)]
Page = Annotated[PageParams, Depends(page_params)]


class ProviderView(BaseModel):
    name: str
    regions: list[str]
    offering_count: int
    skus: list[str]


class OfferingView(BaseModel):
    """An instance type in a region: SKU × count, size and prices (USD/hour for the whole instance)."""

    provider: str
    region: str
    instance_type: str
    sku: str
    gpu_count: int
    vcpus: float
    memory_gib: float
    price_per_hour: float | None
    spot_price_per_hour: float | None
    availability_zones: list[str]
    max_instances: int | None = None  # finite (on-prem) sites: hosts of this class

    @classmethod
    def of(cls, o: Offering, max_instances: int | None) -> OfferingView:
        # Every field of the offering, under its own name.
        return cls(**asdict(o), max_instances=max_instances)


class SkuView(BaseModel):
    """A canonical GPU SKU: per-GPU memory, dense bf16 TFLOP/s, HBM bandwidth and interconnect."""

    name: str
    memory_gib: float
    bf16_tflops: float
    hbm_gbps: float
    interconnect: str
    interconnect_gbps: float
    providers: list[str]

    @classmethod
    def of(cls, sku: GpuSku, providers: list[str]) -> SkuView:
        # Every field of the SKU, under its own name.
        return cls(**asdict(sku), providers=providers)


def _provider_view(ctx: AppContext, name: str) -> ProviderView:
    offerings = [o for o in ctx.catalog.offerings if o.provider == name]
    return ProviderView(
        name=name,
        regions=sorted(r.name for r in ctx.regions.values() if r.provider == name),
        offering_count=len(offerings),
        skus=sorted({o.sku for o in offerings}),
    )


def _provider(ctx: AppContext, name: str) -> str:
    """A provider of the catalog the control plane loaded; 404 listing them when not."""
    if name not in ctx.catalog.providers:
        raise NotFound(str(UnknownName("provider", name, list(ctx.catalog.providers))))
    return name


def _canonical(spelling: str) -> str:
    """The canonical SKU of any spelling of a GPU; 400 when it names none."""
    try:
        return normalise_gpu_name(spelling).name
    except UnknownGpuError as e:
        raise BadRequest(str(e)) from e


@router.get("/providers")
def list_providers(ctx: Ctx, request: Request, response: Response, page: Page) -> list[ProviderView]:
    """Every provider: its regions, how many offerings it has, the SKUs they carry."""
    rows, next_cursor = paginate_items([_provider_view(ctx, p) for p in ctx.catalog.providers], lambda v: (v.name,), page)
    set_next_link(request, response, next_cursor)
    return rows


@router.get("/providers/{name}")
def get_provider(ctx: Ctx, name: ProviderParam) -> ProviderView:
    return _provider_view(ctx, _provider(ctx, name))


@router.get("/providers/{name}/offerings")
def list_offerings(
    ctx: Ctx,
    request: Request,
    response: Response,
    name: ProviderParam,
    page: Page,
    region: Annotated[str | None, Query(pattern=REGION_PATTERN)] = None,
    sku: Annotated[
        str | None, Query(min_length=1, max_length=64, pattern=PRINTABLE_PATTERN, description="any spelling of a GPU")
    ] = None,
) -> list[OfferingView]:
    """The provider's offerings, by region and instance type; optionally of one region or SKU."""
    _provider(ctx, name)
    canonical = _canonical(sku) if sku is not None else None
    catalog = ctx.catalog
    views = [
        OfferingView.of(o, catalog.host_limits.get((o.region, o.instance_type)))
        for o in catalog.offerings
        if o.provider == name and (region is None or o.region == region) and (canonical is None or o.sku == canonical)
    ]
    rows, next_cursor = paginate_items(
        views, lambda v: (v.region, v.instance_type, v.sku, v.gpu_count), page
    )
    set_next_link(request, response, next_cursor)
    return rows


def _offered_by(ctx: AppContext) -> dict[str, list[str]]:
    by_sku: dict[str, set[str]] = {}
    for o in ctx.catalog.offerings:
        by_sku.setdefault(o.sku, set()).add(o.provider)
    return {sku: sorted(providers) for sku, providers in by_sku.items()}


@router.get("/skus")
def list_skus(ctx: Ctx, request: Request, response: Response, page: Page) -> list[SkuView]:
    """The canonical GPU SKUs placement works in, with the providers that offer each."""
    offered = _offered_by(ctx)
    views = [SkuView.of(s, offered.get(name, [])) for name, s in ctx.catalog.skus.items()]
    rows, next_cursor = paginate_items(views, lambda v: (v.name,), page)
    set_next_link(request, response, next_cursor)
    return rows


@router.get("/skus/{name}")
def get_sku(ctx: Ctx, name: GpuSpelling) -> SkuView:
    """One SKU by any spelling of it ("A100 80GB" answers A100-80GB)."""
    sku = ctx.catalog.skus.get(name)
    if sku is None:
        try:
            sku = ctx.catalog.skus.get(normalise_gpu_name(name).name)
        except UnknownGpuError as e:
            raise NotFound(str(e)) from e
    if sku is None:
        raise NotFound(f"no SKU {name!r} in the catalog")
    return SkuView.of(sku, _offered_by(ctx).get(sku.name, []))
