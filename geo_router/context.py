"""One inference request as the router's stages see it: built once at ingress, read by each.

Ingress (geo_router.app's `_route`) authenticates the tenant, reads and parses the body and
then holds in a RequestContext what every later stage needs: selection (candidates, policy,
affinity), forwarding (geo_router.forwarding.forwarder's Exchange is made from it) and accounting. Stages
take the context instead of having its values passed down one by one, and nothing re-derives
what it holds. `location` is filled by selection when it locates the client.
"""

from __future__ import annotations

from dataclasses import dataclass

from meridian.contracts import TenantEntry
from meridian.geo import Point

from .ingress.request import InferenceRequest
from .ingress.responses import StoredResponse
from .observability.tracing import RequestTrace
from .state.table import LoadedTable


@dataclass(slots=True)
class RequestContext:
    """An admitted request: who sent what, against which routing table, since when."""

    route: str
    request_id: str
    loaded: LoadedTable
    tenant: TenantEntry
    inference: InferenceRequest
    # time.perf_counter() when the body had been read: router overhead counts from here.
    received_at: float
    trace: RequestTrace | None
    # A Responses follow-up's stored response (its replica is preferred).
    stored: StoredResponse | None = None
    location: Point | None = None
    # Tokens the request is estimated to cost (prompt + completion budget): its work in flow control.
    work: int = 0
