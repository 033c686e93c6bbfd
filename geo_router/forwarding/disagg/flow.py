"""One request's hand-offs across the forwarder's decode attempts.

The forwarder asks, before each decode attempt, what body to send (`body_for`). A decode
worker whose region has a prefill pool gets the client's request with a hand-off: the
region's hand-off from an earlier attempt when it is still good, else a new prefill. A
co-located candidate, or a decode worker whose prefill pool failed, gets the request as
it is and prefills it itself.

A hand-off is reused only when the decode worker it went to never took the request (the
connection was refused): one that took it may have pulled the blocks, and NIXL frees (and
reuses) pulled blocks, so a second decode worker reading them could read another
request's KV. Any other failure, or a lease that has passed, means a new prefill. When the
request ends without a decode worker having taken a hand-off, it is released.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from fastapi.responses import Response

from meridian.clock import Clock

from ...observability.metrics import RouterMetrics
from ...selection.candidates import Candidate
from ..migration.responses import for_node
from ..upstream import FailureReason
from .bodies import decode_body
from .handoff import Handoff, Prefiller, Refused
from .pools import PDPlan


class Served(StrEnum):
    """How one decode attempt was served (the `how` label of meridian_router_pd_requests)."""

    DISAGGREGATED = "disaggregated"
    PREFILL_FAILED = "prefill_failed"  # no prefill worker answered: the decode worker prefilled
    NO_PREFILL_POOL = "no_prefill_pool"  # a decode worker with no prefill worker in its region
    SHORT_PROMPT = "short_prompt"  # below pd_min_prompt_tokens: the decode worker prefills it


@dataclass(slots=True)
class PDRequest:
    """The disaggregation of one request (see the module doc)."""

    plan: PDPlan
    prefiller: Prefiller
    metrics: RouterMetrics
    clock: Clock
    route: str
    prefill_body: bytes
    request_id: str
    trace_headers: str = ""
    # A Responses request served as a chat completion (geo_router.forwarding.migration.responses): its
    # prefill is tokenized as the decode worker's request will be (`for_node`).
    responses_as_chat: bool = False
    _handoffs: dict[str, Handoff] = field(default_factory=dict)
    _sent: Handoff | None = None

    async def body_for(self, candidate: Candidate, body: bytes, deadline: float) -> bytes | Response:
        """What to send `candidate` (`body` being the request as the forwarder would send it),
        or the prefill worker's refusal as the client's answer."""
        self._sent = None
        pool = self.plan.prefill_pool(candidate)
        region = candidate.region.name
        if not pool:
            if candidate.node.kv_transfer is not None and self.plan.prefill:
                self.metrics.pd_requests.labels(region, Served.NO_PREFILL_POOL).inc()
            return body
        handoff = self._handoffs.pop(region, None)
        if handoff is not None and handoff.expired(self.clock.monotonic()):
            handoff = None  # the prefill worker has let the blocks go
        if handoff is None:
            prefill = self.prefill_body
            if self.responses_as_chat:
                prefill = for_node(prefill, pool[0].node)  # a pool is one connector, one engine
            got = await self.prefiller.prefill(self.route, prefill, pool, self.request_id, deadline,
                                               self.trace_headers)
            if isinstance(got, Refused):
                return Response(got.body, status_code=got.status, headers=got.headers)
            if got is None:
                self.metrics.pd_requests.labels(region, Served.PREFILL_FAILED).inc()
                return body
            handoff = got
        self._sent = handoff
        self.metrics.pd_requests.labels(region, Served.DISAGGREGATED).inc()
        return decode_body(body, handoff.params)

    def attempt_failed(self, candidate: Candidate, reason: FailureReason | None) -> None:
        """The decode attempt on `candidate` failed before its first byte."""
        handoff, self._sent = self._sent, None
        if handoff is None:
            return
        if reason is FailureReason.CONNECT:
            self._handoffs[candidate.region.name] = handoff  # never taken: good for the next worker
        else:
            self.prefiller.release(handoff)

    def ended(self, served: bool) -> None:
        """The request is over: release what no decode worker took (all of it, unless served)."""
        leftover = list(self._handoffs.values())
        if not served and self._sent is not None:
            leftover.append(self._sent)
        self._handoffs.clear()
        self._sent = None
        for handoff in leftover:
            self.prefiller.release(handoff)
