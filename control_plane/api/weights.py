"""Peer sharing of model weights between the nodes of a region (cluster token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Response

from control_plane import weight_registry
from control_plane.auth import Ctx, require_cluster_token
from meridian.contracts import NODE_ID_PATTERN, WeightSources, WeightSourcesRequest

router = APIRouter(prefix="/v1/weights", dependencies=[Depends(require_cluster_token)], tags=["weights"])
Digest = Annotated[str, Path(pattern=r"^[0-9a-f]{64}$")]
NodeIdParam = Annotated[str, Path(pattern=NODE_ID_PATTERN)]


@router.post("/{digest}/sources")
def weight_sources(ctx: Ctx, digest: Digest, body: WeightSourcesRequest) -> WeightSources:
    """Same-region peers to fetch a model from; the asking node is recorded as fetching it."""
    with ctx.write() as session:
        return weight_registry.sources(session, digest, body, ctx.regions, ctx.clock.now())


@router.delete("/{digest}/nodes/{node_id}", status_code=204)
def withdraw_weights(ctx: Ctx, digest: Digest, node_id: NodeIdParam) -> Response:
    """The node evicted the model or gave up fetching it."""
    with ctx.write() as session:
        weight_registry.withdraw(session, digest, node_id)
    return Response(status_code=204)
