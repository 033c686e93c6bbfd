"""Forwarding a request to a replica, failing over to the next one before the first byte.

Once anything has been sent to the client the choice of replica is final: a streamed
answer whose upstream breaks ends with one `data: {"error": ...}` SSE event instead.
For streams, the first complete SSE event is read from the node before the client gets
its status line, so a node that accepts the request and dies during prefill is still
failed over. Events are forwarded whole (geo_router.sse), so a break never leaves half an
event behind. Nodes are reached through geo_router.node_call (pooled HTTP/1.1, bounded slots).

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

import msgspec
from fastapi.responses import Response

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import (
    HEADER_NODE,
    HEADER_OVERHEAD_MS,
    HEADER_REGION,
    HEADER_REQUEST_ID,
)
from meridian.request_journal import RequestJournal
from meridian.settings import RouterSettings

from .disagg.bodies import prefill_body
from .disagg.flow import PDRequest, Served
from .disagg.handoff import Prefiller
from .disagg.pools import PDPlan
from .errors import RouterError, UpstreamLost, UpstreamTimeout
from .health import Ejection, FailureKind, FleetState
from .metrics import RouterMetrics
from .migration.budget import MigrationBudget
from .migration.decide import BreakReason, Refusal
from .migration.plan import CHAT_ROUTE, MigrationPlan, plan_for
from .migration.responses import RESPONSES_ROUTE, AsChat, as_chat_request, for_engine
from .migration.responses_stream import ResponsesStream
from .migration.silence import SilenceWatch
from .migration.stream import MigratingStream, MigrationContext, Piece, PieceFailed
from .node_call import NodeCaller
from .outlier import RetryBudget
from .request import InferenceRequest
from .selection import Candidate
from .sse import SSEFramer
from .streaming import CommittedStream, PassThroughStream, UpstreamStreamingResponse
from .tokens import estimate_prompt_tokens
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
    """A traced request (geo_router.tracing): the header lines that continue its trace at
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


@dataclass(slots=True, eq=False)  # identity-hashed: a set member
class _Waiter:
    """An attempt waiting for a node's answer, which an ejection by health checks abandons."""

    task: asyncio.Task[Any]
    abandoned: bool = False
    # The request went out to the node (before that, an ejection may retry it elsewhere).
    sent: bool = False

    def mark_sent(self) -> None:
        self.sent = True



def _migratable(route: str, request: InferenceRequest
                ) -> tuple[str, InferenceRequest, AsChat | None, MigrationPlan | None]:
    """How a streamed request is forwarded so that it can migrate (a plain Responses request
    becomes the chat completion that serves it: geo_router.migration.responses), and its
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
        self._clock = clock
        self.prefiller = Prefiller(settings, self._calls, self, metrics, clock)
        self.read_timeout_s = settings.read_timeout_s
        # Attempts still waiting for their node's answer, by node.
        self._waiting: dict[str, set[_Waiter]] = {}
        # Stream migration (geo_router.migration): what MigratingStream asks of its host.
        self.inter_token_timeout_s = settings.inter_token_timeout_s
        self.max_migrations = settings.migration_max_per_request
        self.silence = SilenceWatch(settings.inter_token_timeout_s)
        self.budget = MigrationBudget(
            clock, percent=settings.migration_budget_percent, min_concurrency=settings.min_migration_concurrency,
            tokens_per_s=settings.migration_budget_tokens_per_s, burst_tokens=settings.migration_budget_burst_tokens,
            queue_timeout_s=settings.migration_queue_timeout_s)

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

    def note_failure(self, candidate: Candidate, reason: FailureReason) -> None:
        node = candidate.node.node_id
        # Nothing listening ejects at once; a 5xx, timeout or broken stream only after
        # several in a row (health.py), since one may be the request's own doing.
        kind = FailureKind.UNREACHABLE if reason is FailureReason.CONNECT else FailureKind.ERROR
        ejected_s = self._fleet.record_failure(node, kind)
        self._metrics.upstream_failures.labels(candidate.region.name, node, reason).inc()
        if ejected_s > 0:
            log.info("node %s ejected for %.1fs after a %s failure", node, ejected_s, reason)

    def finish(self, candidate: Candidate, elapsed_s: float) -> None:
        self._fleet.end(candidate.node.node_id)
        self._metrics.child("latency", candidate.region.name).observe(elapsed_s)

    def end_request(self) -> None:
        """A client request's answer is complete (or failed): it leaves the retry budget."""
        if self._retry_budget is not None:
            self._retry_budget.end_request()

    def release(self, conn: UpstreamConnection) -> None:
        """An exchange is over: its connection goes back to the pool (or is closed)."""
        self._calls.release(conn)

    async def forward(
        self,
        route: str,
        request: InferenceRequest,
        candidates: Sequence[Candidate],
        request_id: str,
        received_at: float,
        exhausted: RouterError,
        queued_s: float = 0.0,
        *,
        method: str = "POST",
        rewrite: Rewrite | None = None,
        trace: AttemptTrace | None = None,
        pd: PDPlan | None = None,
    ) -> Response:
        """Answer `request` from the first candidate that works; `exhausted` when none does.

        `received_at` is `time.perf_counter()` when the request body had been read;
        `queued_s` is how long it then waited for a replica (scale-from-zero), which is
        not router overhead. `rewrite(node_id, bytes)`, when given, is applied to the
        answer: to a whole body, and to a stream's events one whole event at a time. `pd`,
        when a region's replicas are prefill/decode-disaggregated, has `candidates` as its
        decode order and each decode attempt is preceded by a prefill hop (geo_router.disagg).
        """
        budget = self._retry_budget
        if budget is not None:
            budget.begin_request()
        streaming = False
        try:
            response = await self._forward(
                route, request, candidates, request_id, received_at, exhausted, queued_s, method, rewrite, trace, pd
            )
            streaming = isinstance(response, UpstreamStreamingResponse)
            return response
        finally:
            if not streaming:  # a stream leaves the budget when it closes
                self.end_request()

    async def _forward(
        self,
        route: str,
        request: InferenceRequest,
        candidates: Sequence[Candidate],
        request_id: str,
        received_at: float,
        exhausted: RouterError,
        queued_s: float,
        method: str,
        rewrite: Rewrite | None,
        trace: AttemptTrace | None = None,
        pd_plan: PDPlan | None = None,
    ) -> Response:
        s = self._settings
        deadline = asyncio.get_running_loop().time() + s.request_timeout_s
        plan, as_chat = None, None
        if s.migration_enabled and request.stream:
            route, request, as_chat, plan = _migratable(route, request)
        migration = None
        if plan is not None:
            request = InferenceRequest(plan.upstream_body, request.model, request.stream, request.payload)
            migration = MigrationContext(plan, candidates, request_id, trace.headers if trace is not None else "",
                                         responses_echo=as_chat.echo if as_chat is not None else None)
            if as_chat is not None:
                rewrite = None  # the chat stream holds no vLLM response ids to wrap
        pd = self._disaggregation(pd_plan, route, request, request_id, trace, as_chat is not None)
        served = False
        try:
            response = await self._attempts(route, request, candidates, request_id, received_at, exhausted,
                                            queued_s, method, rewrite, trace, migration, deadline, pd)
            served = True
            return response
        finally:
            if pd is not None:
                pd.ended(served)

    def _disaggregation(self, plan: PDPlan | None, route: str, request: InferenceRequest, request_id: str,
                        trace: AttemptTrace | None, as_chat: bool) -> PDRequest | None:
        """The request's prefill hops, when its replicas are disaggregated and it can be."""
        if plan is None or not self._settings.pd_enabled or not plan.disaggregated:
            return None
        if estimate_prompt_tokens(request.payload) < self._settings.pd_min_prompt_tokens:
            self._metrics.pd_requests.labels(plan.decode[0].region.name, Served.SHORT_PROMPT).inc()
            return None
        body = prefill_body(route, request.payload)
        if body is None:
            return None
        return PDRequest(plan, self.prefiller, self._metrics, self._clock, route, body, request_id,
                         trace.headers if trace is not None else "", responses_as_chat=as_chat)

    async def _attempts(
        self,
        route: str,
        request: InferenceRequest,
        candidates: Sequence[Candidate],
        request_id: str,
        received_at: float,
        exhausted: RouterError,
        queued_s: float,
        method: str,
        rewrite: Rewrite | None,
        trace: AttemptTrace | None,
        migration: MigrationContext | None,
        deadline: float,
        pd: PDRequest | None,
    ) -> Response:
        """Each candidate in turn until one answers (see forward)."""
        s = self._settings
        budget = self._retry_budget
        upstream_wait = queued_s
        previous: Candidate | None = None
        previous_gone = False
        for attempt, candidate in enumerate(list(candidates)[: s.max_attempts], start=1):
            retrying = False
            if previous is not None:
                if budget is not None and not previous_gone:
                    if not budget.try_acquire():
                        log.warning("request %s: retry budget exhausted; not failing over", request_id)
                        break
                    retrying = True
                self._metrics.failovers.labels(previous.region.name, candidate.region.name).inc()
            previous = candidate
            node = candidate.node.node_id
            sent_at = time.perf_counter()
            overhead_s = max(0.0, sent_at - received_at - upstream_wait)
            # Set at construction: adding headers to a built response rescans them each time.
            reply_headers = {
                HEADER_REGION: candidate.region.name,
                HEADER_NODE: node,
                HEADER_REQUEST_ID: request_id,
                HEADER_OVERHEAD_MS: f"{overhead_s * 1000:.3f}",
            }
            self._fleet.begin(node)
            self._journal.routed(request_id, node, candidate.region.name, attempt)
            if trace is not None:
                trace.attempt(attempt, node, candidate.region.name)
            try:
                attempt_request = request
                if pd is not None:
                    body = await pd.body_for(candidate, request.body, deadline)
                    if isinstance(body, Response):  # the prefill worker refused the request itself
                        self._fleet.end(node)
                        body.headers.update({HEADER_REQUEST_ID: request_id})
                        return body
                    attempt_request = InferenceRequest(body, request.model, request.stream, request.payload)
                response = await self._attempt(
                    route, attempt_request, candidate, request_id, deadline, received_at, reply_headers,
                    method, rewrite, trace.headers if trace is not None else "", migration,
                )
            except _NodeFailed as exc:
                self._fleet.end(node)
                if pd is not None:
                    pd.attempt_failed(candidate, exc.reason)
                upstream_wait += time.perf_counter() - sent_at
                log.warning("request %s: node %s failed (%s); trying the next replica",
                            request_id, node, exc)
                self.note_failure(candidate, exc.reason)
                previous_gone = exc.reason.node_gone
                continue
            except TimeoutError:
                self._fleet.end(node)
                self.note_failure(candidate, FailureReason.TIMEOUT)
                raise UpstreamTimeout(s.request_timeout_s) from None
            except BaseException:
                self._fleet.end(node)
                raise
            finally:
                if retrying:
                    assert budget is not None
                    budget.release()
            if not isinstance(response, UpstreamStreamingResponse):
                self.finish(candidate, time.perf_counter() - received_at)
            self._metrics.overhead.observe(overhead_s)
            self._metrics.child("requests", candidate.region.name, node, str(response.status_code), "").inc()
            return response
        raise exhausted

    # --- the host of prefill hops (geo_router.disagg.handoff.PrefillHost) ---

    def prefill_began(self, candidate: Candidate) -> None:
        self._fleet.begin(candidate.node.node_id)

    def prefill_ended(self, candidate: Candidate, ok: bool) -> None:
        self._fleet.end(candidate.node.node_id)
        if ok:
            self._fleet.record_success(candidate.node.node_id)

    # --- the host of migrating streams (geo_router.migration.stream.MigrationHost) ---

    def is_ejected(self, node_id: str) -> bool:
        return self._fleet.is_ejected(node_id)

    def end_piece(self, candidate: Candidate) -> None:
        self._fleet.end(candidate.node.node_id)
        self.silence.ended(candidate.node.node_id)

    def migrated(self, reason: BreakReason, source: Candidate, target: Candidate, tokens: int,
                 resume_s: float) -> None:
        self._metrics.migrations.labels(reason, source.region.name, target.region.name).inc()
        self._metrics.reprefill_tokens.inc(tokens)
        self._metrics.resume_latency.observe(resume_s)

    def refused(self, why: Refusal) -> None:
        self._metrics.migrations_refused.labels(why).inc()

    async def open_piece(self, candidate: Candidate, route: str, body: bytes, request_id: str, deadline: float,
                         trace_headers: str, migration: int, resume_tokens: int) -> Piece:
        """Start a continuation on `candidate` and read its first event (PieceFailed if not)."""
        node = candidate.node.node_id
        try:
            origin = self._calls.client.origin(candidate.node.url)
        except ValueError as exc:
            raise PieceFailed(FailureReason.PROTOCOL, str(exc)) from None
        head = self._calls.request_head("POST", origin, route, InferenceRequest(body, "", True, {}), request_id,
                                  trace_headers)
        await self._calls.take_slot()
        self._fleet.begin(node)
        self._journal.routed(request_id, node, candidate.region.name, 1, migration=migration,
                             resume_tokens=resume_tokens)
        conn: UpstreamConnection | None = None
        started = False
        try:
            async with asyncio.timeout_at(deadline):
                conn = await self._calls.exchange(origin, head, body, True, self.inter_token_timeout_s)
                status, _ = await conn.status()
                if status >= 300:
                    detail = (await conn.read_all())[:300].decode("utf-8", "replace")
                    raise PieceFailed(FailureReason.SERVER_ERROR if status >= 500 else None, f"HTTP {status}: {detail}")
                framer = SSEFramer(True)
                # A frozen replica must not hold a resumed stream longer than it held the first.
                first, ended = await self._calls.first_event(conn, framer, self.inter_token_timeout_s)
                started = True
        except UpstreamError as exc:
            raise PieceFailed(exc.reason, str(exc)) from None
        except TimeoutError:
            raise PieceFailed(FailureReason.TIMEOUT, "the request's deadline passed") from None
        finally:
            if not started:
                self._calls.release(conn)
                self._fleet.end(node)
        self._fleet.record_success(node)
        self.silence.started(node)
        return Piece(candidate, conn, framer, first, ended)

    async def detokenize(self, candidate: Candidate, model: str, tokens: list[int]) -> str | None:
        """The text `tokens` make on `candidate` (POST /detokenize); None when it answers but
        cannot say; PieceFailed when it does not answer (the stream should go elsewhere)."""
        body = msgspec.json.encode({"model": model, "tokens": tokens})
        # A healthy node answers in milliseconds; a frozen one must not hold the stream long.
        timeout_s = min(self.inter_token_timeout_s, self._settings.connect_timeout_s + 1.0)
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            status, _, answer = await self._calls.whole(candidate.node.url, "POST", "/detokenize", body, deadline)
        except ValueError as exc:  # the node's URL
            raise PieceFailed(FailureReason.PROTOCOL, str(exc)) from None
        except UpstreamError as exc:
            raise PieceFailed(exc.reason, f"detokenize: {exc}") from None
        except TimeoutError:
            raise PieceFailed(FailureReason.TIMEOUT, f"detokenize: no answer within {timeout_s:g}s") from None
        try:
            text = msgspec.json.decode(answer).get("prompt") if status == 200 else None
        except (msgspec.DecodeError, AttributeError):
            text = None
        if not isinstance(text, str):
            log.warning("detokenize on %s answered %s without text", candidate.node.node_id, status)
            return None
        return text

    async def _attempt(
        self,
        route: str,
        request: InferenceRequest,
        candidate: Candidate,
        request_id: str,
        deadline: float,
        received_at: float,
        reply_headers: dict[str, str],
        method: str = "POST",
        rewrite: Rewrite | None = None,
        trace_headers: str = "",
        migration: MigrationContext | None = None,
    ) -> Response:
        """One try on one node: a Response to commit to, or _NodeFailed."""
        try:
            origin = self._calls.client.origin(candidate.node.url)
        except ValueError as exc:
            raise _NodeFailed(FailureReason.PROTOCOL, str(exc)) from None
        if migration is not None and migration.responses_echo is not None:
            body = for_engine(request.body, candidate.node.engine)
            request = InferenceRequest(body, request.model, request.stream, request.payload)
        head = self._calls.request_head(method, origin, route, request, request_id, trace_headers)
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
            stream = MigratingStream(self, migration, piece, deadline, received_at)
            if migration.responses_echo is not None:  # a Responses request served as chat
                stream = ResponsesStream(stream, migration.responses_echo)
        else:
            stream = PassThroughStream(self, candidate, conn, framer, first, ended, deadline, received_at)
        headers.setdefault("cache-control", "no-cache")
        headers["x-accel-buffering"] = "no"  # proxies in front must not buffer the stream
        headers.update(reply_headers)
        return UpstreamStreamingResponse(stream, status, headers)
