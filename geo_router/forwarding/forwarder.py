"""Forwarding a request to a replica, failing over to the next one before the first byte.

Once anything has been sent to the client the choice of replica is final: a streamed
answer whose upstream breaks ends with one `data: {"error": ...}` SSE event instead.
For streams, the first complete SSE event is read from the node before the client gets
its status line, so a node that accepts the request and dies during prefill is still
failed over. Events are forwarded whole (geo_router.sse), so a break never leaves
half an event behind. Nodes are reached through geo_router.forwarding.node_call (pooled
HTTP/1.1, bounded slots). This module is the failover loop only: stream migration and
prefill/decode hops are strategies it calls (MigratingStream, PDRequest), and what they and
the committed streams ask of the router is geo_router.forwarding.host's.

`x-meridian-overhead-ms` is the time spent in the router itself between having received
the request body and sending the request to the node that served it, minus the time
spent waiting on replicas that failed: what this router adds, not what failover costs
(failovers show in `meridian_router_failovers` and the latency histogram).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from fastapi.responses import Response

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import (
    HEADER_NODE,
    HEADER_OVERHEAD_MS,
    HEADER_REGION,
    HEADER_REQUEST_ID,
)
from meridian.request_journal import RequestJournal
from meridian.settings.router import RouterSettings

from ..admission.tokens import estimate_prompt_tokens
from ..errors import RouterError, UpstreamLost, UpstreamTimeout
from ..ingress.request import InferenceRequest
from ..observability.metrics import RouterMetrics
from ..selection.candidates import Candidate
from ..sse import SSEFramer
from ..state.health import Ejection, FailureKind, FleetState
from .disagg.bodies import prefill_body
from .disagg.flow import PDRequest, Served
from .disagg.handoff import Prefiller
from .disagg.pools import PDPlan
from .host import ForwardingHost
from .migration.plan import CHAT_ROUTE, MigrationPlan, plan_for
from .migration.responses import RESPONSES_ROUTE, AsChat, as_chat_request, for_node
from .migration.responses_stream import ResponsesStream
from .migration.stream import MigratingStream, MigrationContext, Piece
from .node_call import NodeCaller
from .outlier import RetryBudget
from .streaming import CommittedStream, PassThroughStream, UpstreamStreamingResponse
from .upstream import (
    FailureReason,
    UpstreamConnection,
    UpstreamError,
    UpstreamPool,
    make_upstream_client,
)

log = logging.getLogger(__name__)

# rewrite(node_id, bytes) -> bytes: a change made to an answer on its way to the client.
Rewrite = Callable[[str, bytes], bytes]


class AttemptTrace(Protocol):
    """A traced request (geo_router.observability.tracing): the header lines that continue its trace at
    the node, and what each attempt tried."""

    headers: str

    def attempt(self, attempt: int, node: str, region: str) -> None: ...


# Upstream headers worth keeping; hop-by-hop and length/encoding headers are the router's.
_PASSTHROUGH_HEADERS = {b"content-type": "content-type", b"retry-after": "retry-after",
                        b"cache-control": "cache-control"}


class _NodeFailed(Exception):
    """The attempt failed because of the node; the next candidate may be tried."""

    def __init__(self, reason: FailureReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _PrefillRefused(Exception):  # noqa: N818 - a refusal to pass on, not an error
    """The prefill worker refused the request itself (a 4xx): that is the client's answer."""

    def __init__(self, response: Response) -> None:
        super().__init__("refused by the prefill worker")
        self.response = response


@dataclass(slots=True, eq=False)  # identity-hashed: a set member
class _Waiter:
    """An attempt waiting for a node's answer, which an ejection by health checks abandons."""

    task: asyncio.Task[Any]
    abandoned: bool = False
    # The request went out to the node (before that, an ejection may retry it elsewhere).
    sent: bool = False

    def mark_sent(self) -> None:
        self.sent = True


@dataclass(slots=True)
class Exchange:
    """One client request as the forwarder sees it: what each attempt of the failover loop
    shares. `received_at` is `time.perf_counter()` when the request body had been read;
    `queued_s` how long it then waited for a replica (scale-from-zero), which is not router
    overhead. `rewrite(node_id, bytes)`, when given, is applied to the answer: to a whole
    body, and to a stream's events one whole event at a time. `pd`, when a region's
    replicas are prefill/decode-disaggregated, has `candidates` as its decode order and each
    decode attempt is preceded by a prefill hop (geo_router.forwarding.disagg)."""

    route: str
    request: InferenceRequest
    candidates: Sequence[Candidate]
    request_id: str
    received_at: float
    exhausted: RouterError
    queued_s: float = 0.0
    method: str = "POST"
    rewrite: Rewrite | None = None
    trace: AttemptTrace | None = None
    pd: PDPlan | None = None

    @property
    def trace_headers(self) -> str:
        return self.trace.headers if self.trace is not None else ""


@dataclass(slots=True)
class _Forwarding:
    """What the forwarder derives from an Exchange once, before its first attempt: the
    request as nodes get it (migratable streams go as chat), its deadline, its migration
    and its prefill hops."""

    route: str
    request: InferenceRequest
    deadline: float
    rewrite: Rewrite | None
    migration: MigrationContext | None
    pd: PDRequest | None



def _migratable(route: str, request: InferenceRequest
                ) -> tuple[str, InferenceRequest, AsChat | None, MigrationPlan | None]:
    """How a streamed request is forwarded so that it can migrate (a plain Responses request
    becomes the chat completion that serves it: geo_router.forwarding.migration.responses), and its
    plan; the request as it is and None when it cannot migrate."""
    if route == RESPONSES_ROUTE:
        chat = as_chat_request(request.payload)
        plan = plan_for(CHAT_ROUTE, chat.payload, chat.body) if chat is not None else None
        if chat is None or plan is None:
            return route, request, None, None
        return CHAT_ROUTE, InferenceRequest(chat.body, request.model, True, chat.payload), chat, plan
    return route, request, None, plan_for(route, request.payload, request.body)


def _passthrough(headers: list[tuple[bytes, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        if (key := _PASSTHROUGH_HEADERS.get(name)) is not None:
            out[key] = value.decode("latin-1")
    return out


class UpstreamForwarder:
    """Sends requests to nodes in the order a policy chose, failing over before the first byte.

    With `retry_budget`, a failover attempt is made only while the budget allows it (the
    request is answered `exhausted` otherwise). Failing over from a node that is gone (the
    connection refused, or closed before any answer) does not draw on the budget: the
    budget guards overloaded replicas against retry storms, and a dead region's in-flight
    requests all failing over at once is exactly what failover is for. `on_first_byte(node_id, seconds)` is told how
    long each node took from the request going out to its answer's status line.
    """

    def __init__(
        self,
        settings: RouterSettings,
        fleet: FleetState,
        metrics: RouterMetrics,
        client: UpstreamPool | None = None,
        *,
        retry_budget: RetryBudget | None = None,
        journal: RequestJournal | None = None,
        on_first_byte: Callable[[str, float], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._settings = settings
        self._journal = journal or RequestJournal(None)
        self._retry_budget = retry_budget
        self._on_first_byte = on_first_byte
        self._fleet = fleet
        self._metrics = metrics
        self._calls = NodeCaller(settings, client or make_upstream_client(settings))
        # What the streams, migrations and prefill hops this loop starts ask of the router.
        self.host = ForwardingHost(settings, fleet, metrics, self._calls, journal=self._journal,
                                   retry_budget=retry_budget, clock=clock)
        self.prefiller = Prefiller(settings, self._calls, self.host, metrics, clock)
        # Attempts still waiting for their node's answer, by node.
        self._waiting: dict[str, set[_Waiter]] = {}

    def on_ejection(self, ejection: Ejection) -> None:
        """A node failed its active health checks: abandon the attempts still waiting for it.

        A partitioned or frozen node keeps its connections open and answers nothing, and a
        non-streamed answer has no read timeout short of the request's deadline (generation
        can be long), so without this they would hang for minutes. They end with a 504 and
        are not failed over: the node may have run them, and a retry could run one twice
        (Envoy's close_connections_on_host_health_failure, for the same reason).
        """
        if ejection.kind is not FailureKind.PROBE or not ejection.enforced:
            return
        for waiter in self._waiting.pop(ejection.node_id, ()):
            waiter.abandoned = True
            waiter.task.cancel()

    async def aclose(self) -> None:
        await self.prefiller.aclose()
        await self._calls.client.aclose()
        self._journal.close()

    async def forward(self, exchange: Exchange) -> Response:
        """Answer the exchange's request from the first candidate that works; its
        `exhausted` error when none does."""
        budget = self._retry_budget
        if budget is not None:
            budget.begin_request()
        streaming = False
        try:
            response = await self._forward(exchange)
            streaming = isinstance(response, UpstreamStreamingResponse)
            return response
        finally:
            if not streaming:  # a stream leaves the budget when it closes
                self.host.end_request()

    async def _forward(self, ex: Exchange) -> Response:
        s = self._settings
        deadline = asyncio.get_running_loop().time() + s.request_timeout_s
        route, request, rewrite = ex.route, ex.request, ex.rewrite
        plan, as_chat = None, None
        if s.migration_enabled and request.stream:
            route, request, as_chat, plan = _migratable(route, request)
        migration = None
        if plan is not None:
            request = InferenceRequest(plan.upstream_body, request.model, request.stream, request.payload)
            migration = MigrationContext(plan, ex.candidates, ex.request_id, ex.trace_headers,
                                         responses_echo=as_chat.echo if as_chat is not None else None)
            if as_chat is not None:
                rewrite = None  # the chat stream holds no vLLM response ids to wrap
        pd = self._disaggregation(ex, route, request, as_chat is not None)
        served = False
        try:
            response = await self._attempts(ex, _Forwarding(route, request, deadline, rewrite, migration, pd))
            served = True
            return response
        finally:
            if pd is not None:
                pd.ended(served)

    def _disaggregation(self, ex: Exchange, route: str, request: InferenceRequest, as_chat: bool) -> PDRequest | None:
        """The request's prefill hops, when its replicas are disaggregated and it can be."""
        plan = ex.pd
        if plan is None or not self._settings.pd_enabled or not plan.disaggregated:
            return None
        if estimate_prompt_tokens(request.payload) < self._settings.pd_min_prompt_tokens:
            self._metrics.pd_requests.labels(plan.decode[0].region.name, Served.SHORT_PROMPT).inc()
            return None
        body = prefill_body(route, request.payload)
        if body is None:
            return None
        return PDRequest(plan, self.prefiller, self._metrics, self.host.clock, route, body, ex.request_id,
                         ex.trace_headers, responses_as_chat=as_chat)

    async def _attempts(self, ex: Exchange, fwd: _Forwarding) -> Response:
        """Each candidate in turn until one answers (see forward)."""
        s = self._settings
        budget = self._retry_budget
        upstream_wait = ex.queued_s
        previous: Candidate | None = None
        previous_gone = False
        for attempt, candidate in enumerate(list(ex.candidates)[: s.max_attempts], start=1):
            retrying = False
            if previous is not None:
                if budget is not None and not previous_gone:
                    if not budget.try_acquire():
                        log.warning("request %s: retry budget exhausted; not failing over", ex.request_id)
                        break
                    retrying = True
                self._metrics.failovers.labels(previous.region.name, candidate.region.name).inc()
            previous = candidate
            node = candidate.node.node_id
            sent_at = time.perf_counter()
            overhead_s = max(0.0, sent_at - ex.received_at - upstream_wait)
            self._fleet.begin(node)
            self._journal.routed(ex.request_id, node, candidate.region.name, attempt)
            if ex.trace is not None:
                ex.trace.attempt(attempt, node, candidate.region.name)
            try:
                # Set at construction: adding headers to a built response rescans them each time.
                reply_headers = {
                    HEADER_REGION: candidate.region.name,
                    HEADER_NODE: node,
                    HEADER_REQUEST_ID: ex.request_id,
                    HEADER_OVERHEAD_MS: f"{overhead_s * 1000:.3f}",
                }
                request = fwd.request if fwd.pd is None else await self._prefilled(fwd, candidate)
                response = await self._attempt(ex, fwd, request, candidate, reply_headers)
            except _PrefillRefused as refused:
                self._fleet.end(node)
                refused.response.headers.update({HEADER_REQUEST_ID: ex.request_id})
                return refused.response
            except _NodeFailed as exc:
                self._fleet.end(node)
                if fwd.pd is not None:
                    fwd.pd.attempt_failed(candidate, exc.reason)
                upstream_wait += time.perf_counter() - sent_at
                log.warning("request %s: node %s failed (%s); trying the next replica",
                            ex.request_id, node, exc)
                self.host.note_failure(candidate, exc.reason)
                previous_gone = exc.reason.node_gone
                continue
            except TimeoutError:
                self._fleet.end(node)
                self.host.note_failure(candidate, FailureReason.TIMEOUT)
                raise UpstreamTimeout(s.request_timeout_s) from None
            except BaseException:
                self._fleet.end(node)
                raise
            finally:
                if retrying:
                    assert budget is not None
                    budget.release()
            if not isinstance(response, UpstreamStreamingResponse):
                self.host.finish(candidate, time.perf_counter() - ex.received_at)
            self._metrics.overhead.observe(overhead_s)
            self._metrics.child("requests", candidate.region.name, node, str(response.status_code), "").inc()
            return response
        raise ex.exhausted

    async def _prefilled(self, fwd: _Forwarding, candidate: Candidate) -> InferenceRequest:
        """The request for `candidate` once its prefill hop is done (_PrefillRefused when
        the prefill worker refused the request itself)."""
        assert fwd.pd is not None
        request = fwd.request
        body = await fwd.pd.body_for(candidate, request.body, fwd.deadline)
        if isinstance(body, Response):
            raise _PrefillRefused(body)
        return InferenceRequest(body, request.model, request.stream, request.payload)

    async def _attempt(self, ex: Exchange, fwd: _Forwarding, request: InferenceRequest, candidate: Candidate,
                       reply_headers: dict[str, str]) -> Response:
        """One try on one node: a Response to commit to, or _NodeFailed."""
        try:
            origin = self._calls.client.origin(candidate.node.url)
        except ValueError as exc:
            raise _NodeFailed(FailureReason.PROTOCOL, str(exc)) from None
        migration, rewrite, deadline = fwd.migration, fwd.rewrite, fwd.deadline
        if migration is not None and migration.responses_echo is not None:
            body = for_node(request.body, candidate.node)
            request = InferenceRequest(body, request.model, request.stream, request.payload)
        head = self._calls.request_head(ex.method, origin, fwd.route, request, ex.request_id, ex.trace_headers)
        await self._calls.take_slot()
        conn: UpstreamConnection | None = None
        committed = False
        node_id = candidate.node.node_id
        waiter = _Waiter(cast(asyncio.Task[Any], asyncio.current_task()))
        self._waiting.setdefault(node_id, set()).add(waiter)
        try:
            async with asyncio.timeout_at(deadline):
                sent_at = time.perf_counter()
                conn = await self._calls.exchange(origin, head, request.body, request.stream,
                                                  on_send=waiter.mark_sent)
                status, upstream_headers = await conn.status()
                if self._on_first_byte is not None:
                    self._on_first_byte(candidate.node.node_id, time.perf_counter() - sent_at)
                if status >= 500:
                    raise _NodeFailed(FailureReason.SERVER_ERROR, f"HTTP {status}")
                headers = _passthrough(upstream_headers)
                if not request.stream or status >= 300:
                    body = await conn.read_all()
                    if rewrite is not None:
                        body = rewrite(node_id, body)
                    # A 4xx is the client's fault: the node is healthy and it is not retried.
                    self._fleet.record_success(candidate.node.node_id)
                    headers.update(reply_headers)
                    return Response(body, status_code=status, headers=headers)
                framer = SSEFramer(headers.get("content-type", "").startswith("text/event-stream"))
                first, ended = await self._calls.first_event(conn, framer)
                committed = True
        except UpstreamError as exc:
            raise _NodeFailed(exc.reason, str(exc)) from None
        except asyncio.CancelledError:
            if not waiter.abandoned:
                raise
            waiter.task.uncancel()
            if not waiter.sent:
                # Still connecting when its node was ejected: nothing of it can have run there.
                raise _NodeFailed(FailureReason.CONNECT, "ejected by its health checks before the request went out") \
                    from None
            raise UpstreamLost(node_id) from None
        finally:
            waiting = self._waiting.get(node_id)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiting[node_id]
            if not committed:
                # A non-streamed answer has been read whole (its connection is reused); a
                # failed one is closed. A streamed one belongs to the response passing it on.
                self._calls.release(conn)
        self._fleet.record_success(candidate.node.node_id)
        if rewrite is not None:
            framer.rewrite = lambda events: rewrite(node_id, events)
            first = framer.rewrite(first)
        stream: CommittedStream
        if migration is not None:
            piece = Piece(candidate, conn, framer, first, ended)
            stream = MigratingStream(self.host, migration, piece, deadline, ex.received_at)
            if migration.responses_echo is not None:  # a Responses request served as chat
                stream = ResponsesStream(stream, migration.responses_echo)
        else:
            stream = PassThroughStream(self.host, candidate, conn, framer, first, ended, deadline, ex.received_at)
        headers.setdefault("cache-control", "no-cache")
        headers["x-accel-buffering"] = "no"  # proxies in front must not buffer the stream
        headers.update(reply_headers)
        return UpstreamStreamingResponse(stream, status, headers)
