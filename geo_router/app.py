"""The geo router's HTTP app: one global OpenAI-compatible endpoint in front of every node.

A request goes: authenticate the tenant (its key fixes the residency zone) → rate limits →
locate the client → candidates (residency, health, circuit breakers) → annotate them
(load, KV-prefix overlap, LoRA) → order them (the routing policy) → forward, failing over
before the first byte. The parts live in their own modules; this one builds them from the
settings, starts and stops their background work, and strings them together.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

from fastapi import FastAPI, Request, WebSocket
from fastapi.responses import JSONResponse, Response
from starlette.requests import HTTPConnection

from meridian import __version__ as meridian_version
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.cluster_client import ClusterClient
from meridian.contracts import (
    GENERATION_ROUTES,
    HEADER_QUEUE_WAIT_MS,
    HEADER_REQUEST_ID,
    HEADER_SCALE_WAIT_MS,
    MODEL_ROUTES,
    ModelCard,
    ModelList,
    RoutingNode,
    TenantEntry,
)
from meridian.geo import Point
from meridian.logs import flush_logs
from meridian.request_journal import HEADER_IDEMPOTENCY_KEY, RequestJournal
from meridian.settings.router import RouterSettings
from meridian.tracing import Tracing

from .admission.flow_capacity import pool_capacity
from .admission.flow_control import FlowControl, FlowRequest, Ticket, unheld
from .admission.flow_counters import SharedWorkCounters
from .admission.flow_headers import band_of, ttl_of
from .admission.flow_peers import SharedFlowPeers
from .admission.flow_report import BacklogReporter
from .admission.ratelimit import Admission, RateLimiter, create_rate_limiter
from .admission.tokens import estimate_tokens, usage_split
from .context import RequestContext
from .errors import (
    ModelNotFound,
    NoHealthyReplica,
    NoReplicaInZone,
    RateLimited,
    RouterError,
    RoutingTableUnavailable,
    error_response,
    install_error_handlers,
)
from .forwarding.disagg.bodies import refuse_client_params
from .forwarding.disagg.pools import plan as pd_plan
from .forwarding.forwarder import Exchange, UpstreamForwarder
from .forwarding.outlier import CircuitBreaker, RetryBudget
from .forwarding.streaming import when_stream_ends
from .forwarding.upstream import make_upstream_client
from .ingress.arrival import Arrival, HttpArrival
from .ingress.auth import authenticate, key_digest
from .ingress.http import RouterApp
from .ingress.isolation import salted
from .ingress.kserve.server import GrpcListener
from .ingress.kserve.service import COMPLETIONS, InferenceService
from .ingress.request import (
    MAX_MODEL_NAME_CHARS,
    InferenceRequest,
    parse_inference_request,
    request_id_for,
)
from .ingress.responses import ResponseIds, ResponseNotFound, StoredResponse, follow_up
from .ingress.websocket import RESPONSES_PATH, ResponsesSocket
from .observability.access_log import AccessRecord
from .observability.accounting import account, answer_usage, count_request, model_label, stream_tokens
from .observability.admin_listener import metrics_page, own_page, scraper_tokens
from .observability.metrics import RouterMetrics
from .observability.tracing import begin as begin_trace
from .selection.affinity import Affinity, every_node
from .selection.candidates import (
    Candidate,
    FleetView,
    RoutingContext,
    exhausted_error,
    models_for,
    named_candidates,
    select_candidates,
    split_adapter,
    zone_ready_replicas,
)
from .selection.locate import ClientLocator, RttEstimator
from .selection.pinned import pinned
from .selection.policies import AffinityPolicy, RoutingPolicy, create_policy
from .selection.prefix import PrefixKeyBuilder
from .selection.scale_from_zero import Outlook, ScaleFromZero, ScaleUpClient, deployed_models, outlook
from .sse import StreamTally
from .state.health import Ejection, FleetState, InProcessFleetState
from .state.kv_index import KVIndex
from .state.kv_scope import KVScope
from .state.kv_subscriber import KVEventSubscriber
from .state.prefix_history import InProcessPrefixHistory, PrefixHistory, RedisPrefixHistory
from .state.probe import NodeProber
from .state.redis_fleet import RedisFleetState
from .state.table import LoadedTable, RoutingTableClient, TableSource, cluster_endpoint
from .workers import WorkerSlot
from .workers.host_buckets import worker_rate_limiter
from .workers.host_fleet import HostFleetState
from .workers.host_history import HostPrefixHistory
from .workers.host_probes import HostProbeShare
from .workers.metrics_pages import PageServer

log = logging.getLogger(__name__)

@dataclass(slots=True)
class RouterState:
    """Everything one router app owns (reachable as `app.state.router`)."""

    settings: RouterSettings
    clock: Clock
    table_source: TableSource
    fleet: FleetState
    policy: RoutingPolicy
    metrics: RouterMetrics
    forwarder: UpstreamForwarder
    scale_from_zero: ScaleFromZero
    prober: NodeProber
    kv_index: KVIndex
    kv_events: KVEventSubscriber
    history: PrefixHistory
    prefixes: PrefixKeyBuilder
    affinity: Affinity
    breaker: CircuitBreaker
    rate_limiter: RateLimiter
    locator: ClientLocator
    rtt: RttEstimator
    response_ids: ResponseIds
    tracing: Tracing
    flow: FlowControl
    # Tells the control plane what flow control holds (for the autoscaler and the console).
    backlog: BacklogReporter
    flow_counters: SharedWorkCounters | None = None
    # The other routers' requests per pool, through Redis (flow control's room).
    flow_peers: SharedFlowPeers | None = None
    # The gRPC listener (geo_router.ingress.kserve), when settings.grpc_port is set.
    grpc: GrpcListener | None = None
    # Selection's view of the fleet: health, the circuit breaker, RTT estimates.
    fleet_view: FleetView = field(init=False)

    def __post_init__(self) -> None:
        self.fleet_view = FleetView(self.fleet, self.rtt.rtt_ms, self.breaker.allows)

    def table(self) -> LoadedTable:
        loaded = self.table_source.current()
        if loaded is None:
            raise RoutingTableUnavailable()
        return loaded

    def region_of(self, node_id: str) -> str:
        """The region of a node in the current table ("" when it is not there)."""
        loaded = self.table_source.current()
        if loaded is None:
            return ""
        node = loaded.nodes_by_id.get(node_id)
        return node.region if node is not None else ""

    def select(self, table: LoadedTable, tenant: TenantEntry, model: str, location: Point | None,
               also: Collection[str] = ()) -> list[Candidate]:
        """Candidates for the request: residency, health and circuit breakers applied, at most
        max_candidates of them plus the usable ones of `also` (a stored response's node)."""
        return select_candidates(table, tenant, model, self.fleet_view, location,
                                 limit=self.settings.max_candidates, also=also)

    def more(self, table: LoadedTable, tenant: TenantEntry, model: str,
             location: Point | None) -> Callable[[Sequence[str]], list[Candidate]]:
        """Named nodes as candidates, with select's checks (prefix holders a bounded set left out)."""
        return lambda node_ids: named_candidates(table, tenant, model, self.fleet_view, location, node_ids)


def create_app(
    settings: RouterSettings,
    table_source: TableSource | None = None,
    *,
    fleet: FleetState | None = None,
    clock: Clock = SYSTEM_CLOCK,
    worker: WorkerSlot | None = None,
) -> FastAPI:
    """Build the router app; its lifespan starts the routing-table source and background work.

    Without `fleet`, node health is shared through Redis when `settings.redis_url` is set
    (the app then starts and stops that sync), else kept in this process. The same goes for
    the approximate prefix index and the rate-limit counters. `clock` is the one clock of
    every part of the app that keeps time (tests pass a ManualClock). `worker`: this app is
    one of several worker processes of one router (geo_router.workers); without Redis it
    shares node health, the prefix index, rate limits and /metrics with its siblings on the host.
    """
    source: TableSource = table_source if table_source is not None else RoutingTableClient(settings, clock=clock)
    state, shared_fleet = _build_state(settings, source, fleet, clock, worker)
    pages = None if worker is None else PageServer(worker, lambda: own_page(state.metrics, state.prober))
    app = RouterApp(title="Meridian geo router", lifespan=_lifespan(state, shared_fleet, pages),
                    docs_url=None, redoc_url=None)
    app.state.router = state
    install_error_handlers(app)
    for route in MODEL_ROUTES:
        _add_model_route(app, state, route)
    # The same handlers again, served ahead of FastAPI's stack (geo_router.ingress.http);
    # the FastAPI routes stay for what reads the app's route list (405s, the schema).
    app.serve_inference({route: functools.partial(_route, state, route=route) for route in MODEL_ROUTES})
    _add_other_routes(app, state, worker)
    return app


def _build_state(
    settings: RouterSettings, source: TableSource, fleet: FleetState | None, clock: Clock,
    worker: WorkerSlot | None,
) -> tuple[RouterState, RedisFleetState | None]:
    """Every part of one router app, wired together; the Redis fleet state when one is made
    here (its sync is then the app's to start and stop)."""
    shared_fleet: RedisFleetState | None = None
    fleet_state: FleetState
    if fleet is not None:
        fleet_state = fleet
    elif settings.redis_url:
        fleet_state = shared_fleet = RedisFleetState.from_settings(settings, clock)
    elif worker is not None:
        fleet_state = HostFleetState.for_worker(settings, worker.fleet_path, worker.index, clock)
    else:
        fleet_state = InProcessFleetState.from_settings(settings, clock)
    history: PrefixHistory
    if settings.redis_url:
        history = RedisPrefixHistory.from_settings(settings, clock=clock)
    elif worker is not None:
        history = HostPrefixHistory.for_worker(settings, worker.history_path, worker.index, clock=clock)
    else:
        history = InProcessPrefixHistory.from_settings(settings, clock=clock)

    def table_version() -> float:
        loaded = source.current()
        return float(loaded.version) if loaded is not None else -1.0

    def table_age() -> float:
        refreshed = source.refreshed_at()
        if source.current() is None:
            return -1.0
        return 0.0 if refreshed is None else max(0.0, clock.monotonic() - refreshed)

    # Flow control's work counters: shared by every router through Redis when there is one.
    counters = SharedWorkCounters.from_settings(settings, clock) if settings.redis_url else None
    metrics = RouterMetrics(table_version, table_age)
    metrics.count_zone_replicas_of(lambda: zone_ready_replicas(t) if (t := source.current()) is not None else {})
    # One worker probes for all (geo_router.workers.host_probes).
    share = None if worker is None else HostProbeShare.for_worker(
        worker.probes_path, worker.probe_lease_path, worker.index, settings.probe_interval_s, clock)
    prober = NodeProber(settings, fleet_state, clock=clock, share=share)
    metrics.count_probes_of(lambda: prober.probes_started)
    kv_index = KVIndex(settings.kv_index_max_blocks_per_node)
    kv_scope = KVScope(settings)
    prefixes = PrefixKeyBuilder(settings)
    affinity = Affinity(
        loads=prober, kv_index=kv_index, history=history, prefixes=prefixes,
        default_service_ms=settings.default_service_ms,
        balance_half_life_s=settings.affinity_balance_half_life_s,
        exact=_exact_for(settings, kv_scope),
        clock=clock,
    )
    peers = SharedFlowPeers.from_settings(settings, clock) if settings.redis_url else None
    capacity = pool_capacity(settings, source.current, fleet_state, prober.load, clock,
                             peers.peers if peers is not None else None)
    flow = FlowControl(settings, capacity, clock, counters.for_pool if counters is not None else None)
    if peers is not None:
        peers.follow(flow.active_pools, flow.pump_all)
    state = RouterState(
        settings=settings,
        clock=clock,
        table_source=source,
        fleet=fleet_state,
        policy=create_policy(settings.routing_policy, settings),
        metrics=metrics,
        forwarder=UpstreamForwarder(
            settings, fleet_state, metrics, make_upstream_client(settings, clock),
            retry_budget=RetryBudget.from_settings(settings),
            journal=RequestJournal(settings.request_journal_path),
            on_first_byte=lambda node_id, s: _first_byte(state, node_id, s),
            clock=clock,
        ),
        scale_from_zero=ScaleFromZero(settings, source, metrics, ScaleUpClient(settings, metrics), clock=clock),
        prober=prober,
        kv_index=kv_index,
        kv_events=KVEventSubscriber(settings, kv_index, clock=clock, scope=kv_scope),
        history=history,
        prefixes=prefixes,
        affinity=affinity,
        breaker=CircuitBreaker.from_settings(settings, fleet_state),
        rate_limiter=worker_rate_limiter(settings, clock, worker) if worker else create_rate_limiter(settings, clock),
        locator=ClientLocator(settings),
        rtt=RttEstimator.from_settings(settings),
        response_ids=ResponseIds(settings.cluster_token.get_secret_value()),
        tracing=Tracing.create("meridian-router", settings.otlp_endpoint, settings.otlp_zone_endpoints),
        flow=flow,
        flow_counters=counters,
        flow_peers=peers,
        backlog=BacklogReporter(settings, ClusterClient(cluster_endpoint(settings, settings.scale_up_timeout_s)), flow,
                                lambda outcome: metrics.backlog_reports.labels(outcome).inc(), clock),
    )
    metrics.count_flow_queues_of(state.flow.gauges)
    fleet_state.add_ejection_listener(lambda e: _count_ejection(state, e))
    fleet_state.add_ejection_listener(state.forwarder.on_ejection)
    if isinstance(state.policy, AffinityPolicy):
        policy = state.policy
        metrics.count_fallbacks_of(lambda: policy.imbalance_fallbacks)
    source.add_listener(lambda loaded: _on_table(state, loaded))
    if settings.grpc_port is not None:
        state.grpc = _grpc_listener(state)
    return state, shared_fleet


def servable_models(loaded: LoadedTable, tenant: TenantEntry) -> set[str]:
    """The models `tenant` may ask for: served in its zone, or deployed there while scaled
    to zero (a request for one starts a replica)."""
    return set(models_for(loaded, tenant)) | set(deployed_models(loaded, tenant))


def _grpc_listener(state: RouterState) -> GrpcListener:
    """The KServe v2 gRPC endpoint of this app: its inferences go through `_route` as
    /v1/completions requests."""

    service = InferenceService(lambda arrival: _route(state, arrival, COMPLETIONS), state.table_source.current,
                               servable_models, meridian_version, state.settings.grpc_max_requests_per_stream)
    return GrpcListener(state.settings, service)


def _exact_for(settings: RouterSettings, kv_scope: KVScope) -> Callable[[RoutingNode], bool] | None:
    """The nodes affinity matches by the KV index: none without KV events, those in the
    index's scope when it has one, else every node that publishes events."""
    if not settings.kv_events_enabled:
        return None
    return kv_scope.covers if settings.kv_events_max_rtt_ms is not None else every_node


def _lifespan(
    state: RouterState, shared_fleet: RedisFleetState | None, pages: PageServer | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Starts the app's background parts in order, and stops them in reverse."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        source = state.table_source
        async with AsyncExitStack() as stack:
            # Last out: the access lines still batched (meridian.logs) reach the log.
            stack.callback(flush_logs)
            if shared_fleet is not None:
                await shared_fleet.start()
                stack.push_async_callback(shared_fleet.stop)
            for part in (state.history, state.rate_limiter, state.flow_counters, state.flow_peers, pages):
                if part is not None:
                    await part.start()
                    stack.push_async_callback(part.stop)
            stack.callback(state.locator.close)
            # Last out: exports the spans of the requests that ended while stopping.
            stack.push_async_callback(asyncio.to_thread, state.tracing.shutdown)
            await source.start()
            stack.push_async_callback(source.stop)
            stack.push_async_callback(state.scale_from_zero.aclose)
            stack.push_async_callback(state.forwarder.aclose)
            await state.prober.start()
            stack.push_async_callback(state.prober.stop)
            if state.settings.kv_events_enabled:
                await state.kv_events.start()
                stack.push_async_callback(state.kv_events.stop)
            # A static source never announces its first table; a polled one may have
            # installed it before the listeners could act on it.
            loaded = source.current()
            if loaded is not None:
                _on_table(state, loaded)
            refine = asyncio.create_task(_refine_rtt(state), name="rtt-refinement")
            stack.push_async_callback(_cancel, refine)
            stack.push_async_callback(state.flow.aclose)
            await state.backlog.start()
            stack.push_async_callback(state.backlog.stop)
            if state.grpc is not None:
                await state.grpc.start()
                stack.push_async_callback(state.grpc.stop)
                await state.grpc.serving(source.current() is not None)
            yield

    return lifespan


def _add_other_routes(app: FastAPI, state: RouterState, worker: WorkerSlot | None) -> None:
    """Stored responses, the model list, health and metrics."""
    settings, source = state.settings, state.table_source

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        return await _stored_response(state, request, response_id, "GET", "")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await _stored_response(state, request, response_id, "POST", "/cancel")

    def tenant_models(request: Request) -> list[str]:
        loaded = state.table()
        tenant = _tenant(loaded, request)
        return sorted(servable_models(loaded, tenant))

    @app.get("/v1/models")
    async def list_models(request: Request) -> JSONResponse:
        cards = [ModelCard(id=m) for m in tenant_models(request)]
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}")
    async def get_model(request: Request, model_id: str) -> JSONResponse:
        if model_id not in tenant_models(request):
            raise ModelNotFound(model_id[:MAX_MODEL_NAME_CHARS])
        return JSONResponse(ModelCard(id=model_id).model_dump())

    @app.websocket(RESPONSES_PATH)
    async def responses_socket(ws: WebSocket) -> None:
        # The key is checked on the upgrade (a bad one gets no socket: 401 with the error
        # JSON, as OpenAI answers), before every turn and while the socket idles.
        try:
            _tenant(state.table(), ws)
        except RouterError as exc:
            await ws.send_denial_response(error_response(exc))
            return
        digest = key_digest(ws.headers.get("authorization"), ws.headers.get("x-api-key"))

        def turn(arrival: Arrival, answer: Callable[[], Response] | None = None, /) -> Awaitable[Response]:
            return _route(state, arrival, RESPONSES_PATH, answer)

        def key_holds() -> bool:
            # No table (never, once one loaded) is not the key's fault: the turn answers 503.
            loaded = state.table_source.current()
            return loaded is None or digest in loaded.tenants

        await ResponsesSocket(ws, settings, state.clock, turn, key_holds).run()

    @app.get("/health")
    async def health() -> JSONResponse:
        loaded = source.current()
        if loaded is None:
            return JSONResponse({"status": "no_routing_table"}, status_code=503)
        return JSONResponse({"status": "ok", "routing_version": loaded.version})

    if settings.metrics_port is not None:
        return  # /metrics is served on the admin listener only (geo_router.observability.admin_listener)
    scrapers = scraper_tokens(settings.metrics_token, settings.cluster_token)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        return await metrics_page(request, state.metrics, state.prober, scrapers, worker)


def _add_model_route(app: FastAPI, state: RouterState, route: str) -> None:
    async def endpoint(request: Request) -> Response:
        return await _route(state, HttpArrival(request), route)

    app.add_api_route(route, endpoint, methods=["POST"], name=route)


def _tenant(loaded: LoadedTable, request: HTTPConnection | Arrival) -> TenantEntry:
    # Anthropic's clients send their key as x-api-key.
    return authenticate(loaded, request.headers.get("authorization"), request.headers.get("x-api-key"))


def _on_table(state: RouterState, loaded: LoadedTable) -> None:
    """A new routing table: follow its nodes (probes, KV event subscriptions), forget the gone."""
    state.prober.on_table(loaded)
    state.kv_events.on_table(loaded)
    if state.grpc is not None:
        state.grpc.table_loaded()
    present = loaded.nodes_by_id.keys()
    for node_id in state.kv_index.nodes():
        if node_id not in present:
            state.kv_index.remove_node(node_id)
    for node_id in state.affinity.known_nodes() - present:
        state.affinity.forget_node(node_id)
        state.history.forget_node(node_id)


def _first_byte(state: RouterState, node_id: str, seconds: float) -> None:
    """A node answered (status line): learn its service time and record the TTFB."""
    state.affinity.service_times.observe(node_id, seconds)
    region = state.region_of(node_id)
    state.metrics.child("ttft", region, node_id).observe(seconds)


def _count_ejection(state: RouterState, ejection: Ejection) -> None:
    reason = str(ejection.kind) if ejection.enforced else f"{ejection.kind}-capped"
    state.metrics.ejections.labels(state.region_of(ejection.node_id), ejection.node_id, reason).inc()


async def _refine_rtt(state: RouterState) -> None:
    """Feed the probes' measured round trips into the client-to-region RTT estimates."""
    while True:
        await state.clock.sleep(state.settings.probe_interval_s)
        loaded = state.table_source.current()
        if loaded is None:
            continue
        for region in loaded.regions.values():
            measured = state.prober.rtt_ms(region.name)
            if measured is not None:
                state.rtt.observe(region, measured, loaded.regions)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _route(state: RouterState, arrival: Arrival, route: str,
                 answer: Callable[[], Response] | None = None) -> Response:
    """The request through the pipeline; with `answer`, answered by the router itself once
    admitted (a WebSocket warm-up): key, size, rate limits, accounting, log and trace as
    any request, and no replica."""
    headers = arrival.headers
    # An idempotency key names the request end to end (journals, nodes, logs).
    request_id = request_id_for(headers.get(HEADER_IDEMPOTENCY_KEY) or headers.get(HEADER_REQUEST_ID))
    arrival.named(request_id)
    loaded: LoadedTable | None = None
    tenant: TenantEntry | None = None
    inference: InferenceRequest | None = None
    trace = begin_trace(state.tracing, headers, route, request_id)
    access = AccessRecord(request_id, route, state.settings.access_log)
    try:
        loaded = state.table()
        tenant = _tenant(loaded, arrival)
        access.tenant = tenant.tenant
        body = await arrival.body(state.settings.max_request_bytes)
        received_at = time.perf_counter()
        # Prefix caches are per tenant (or sharing group): no tenant can probe another's.
        inference = salted(parse_inference_request(body), tenant)
        refuse_client_params(inference.payload)
        access.model = inference.model
        if trace is not None:
            trace.tenant(tenant, inference.model)
        stored: StoredResponse | None = None
        if route == RESPONSES_PATH:
            inference, stored = follow_up(state.response_ids, inference, tenant)
        if answer is not None and not tenant.may_use(inference.model):
            # A forwarded request learns this from its candidates; a warm-up has none.
            raise ModelNotFound(inference.model[:MAX_MODEL_NAME_CHARS])
        admission = _admit(state, route, tenant, inference)
        ticket: Ticket | None = None
        if answer is not None:
            response = answer()
        else:
            ctx = RequestContext(route, request_id, loaded, tenant, inference, received_at, trace, stored)
            ctx.work = admission.tokens
            response, ticket = await _forwarded(state, ctx, arrival)
        response.headers.update(admission.headers)
        usage = answer_usage(response)
        if ticket is not None:
            _release_when_answered(ticket, response, usage, inference.payload)
        account(state.metrics, state.rate_limiter.settle, admission, model_label(loaded, inference.model),
                inference.payload, response, usage)
        if trace is not None:
            trace.finish(response)
        access.routed(response, usage)
        return response
    except RouterError as exc:
        state.metrics.requests.labels("", "", str(exc.status), exc.code or exc.type_).inc()
        if tenant is not None:
            count_request(state.metrics, tenant, model_label(loaded, inference and inference.model), exc.status)
        if trace is not None:
            trace.fail(exc.status, str(exc))
        access.failed(exc.status)
        raise
    except BaseException:
        if trace is not None:
            trace.fail(499, "the request ended without an answer")
        raise


async def _forwarded(state: RouterState, ctx: RequestContext, arrival: Arrival) -> tuple[Response, Ticket]:
    """An admitted request's answer from a replica, once flow control lets it go, and its
    ticket: the caller gives its place back when the answer ends (`_release_when_answered`)."""
    ticket = await _flow_ticket(state, ctx, arrival)
    try:
        response = await _from_replica(state, ctx, arrival)
    except BaseException:
        ticket.release(None)
        raise
    if ticket.waited_s:
        response.headers[HEADER_QUEUE_WAIT_MS] = f"{ticket.waited_s * 1000:.0f}"
    return response, ticket


async def _flow_ticket(state: RouterState, ctx: RequestContext, arrival: Arrival) -> Ticket:
    """Wait for room in the request's (zone, model) pool (geo_router.admission.flow_control)."""
    tenant, model = ctx.tenant, ctx.inference.model
    pool = (tenant.zone, model if model in ctx.loaded.nodes_by_model else split_adapter(model)[0])
    if not state.flow.enabled or ctx.route not in GENERATION_ROUTES:
        return unheld(pool)
    band = band_of(tenant, arrival.headers)
    request = FlowRequest(pool, tenant.tenant, band, tenant.weight, ctx.work, len(ctx.inference.body),
                          ttl_of(state.settings, arrival.headers))
    labels = (tenant.zone, str(band), tenant.tenant)
    ticket = state.flow.admit_now(request)
    if ticket is not None:
        return ticket  # the wait histogram is of the requests that waited
    watch = arrival.watch()  # only a request that may wait watches its client
    try:
        ticket = await state.flow.admit(request)
    except asyncio.CancelledError:
        if not watch.fired:
            raise
        raise watch.closed_request() from None
    except RouterError as exc:
        state.metrics.child("flow_refused", *labels, exc.code or "").inc()
        raise
    finally:
        watch.stop()
    state.metrics.child("flow_wait", *labels).observe(ticket.waited_s)
    return ticket


def _release_when_answered(ticket: Ticket, response: Response, usage: Mapping[str, Any] | None,
                           payload: Mapping[str, Any]) -> None:
    """Give the ticket back with the work the answer was (`usage`: a whole answer's, read
    once for the accounting too): a stream's when it ends."""
    if ticket.control is None:
        return

    def stream_ended(tally: StreamTally) -> None:
        ticket.release(sum(stream_tokens(tally, payload)))

    if when_stream_ends(response, stream_ended):
        return
    split = usage_split({"usage": usage}) if usage is not None else None
    ticket.release(sum(split) if split else None)


async def _from_replica(state: RouterState, ctx: RequestContext, arrival: Arrival) -> Response:
    """An admitted request's answer from a replica: located, ordered, forwarded."""
    loaded, tenant, inference, stored = ctx.loaded, ctx.tenant, ctx.inference, ctx.stored
    ctx.location = state.locator.locate(arrival.headers, arrival.peer, loaded.regions)
    also = (stored.node_id,) if stored is not None else ()
    candidates, queued_s = await _candidates(state, ctx, arrival, also)
    if stored is not None:
        candidates = pinned(loaded, candidates, stored, inference.model)
    ordered = _ordered(state, ctx, candidates)
    pd = pd_plan(ordered)
    # Until the answer starts, nothing else notices the client leaving: the node would
    # go on generating a whole non-streamed answer (or a stream's prefill) for nobody.
    watch = arrival.watch()
    try:
        response = await state.forwarder.forward(Exchange(
            ctx.route,
            inference,
            pd.decode,
            ctx.request_id,
            ctx.received_at,
            exhausted=exhausted_error(tenant, inference.model),
            queued_s=queued_s,
            rewrite=state.response_ids.rewriter(tenant) if ctx.route == RESPONSES_PATH else None,
            trace=ctx.trace,
            pd=pd if pd.prefill else None,
        ))
    except asyncio.CancelledError:
        if not watch.fired:
            raise
        raise watch.closed_request() from None
    finally:
        watch.stop()
    if queued_s:
        response.headers[HEADER_SCALE_WAIT_MS] = f"{queued_s * 1000:.0f}"
    return response


def _admit(state: RouterState, route: str, tenant: TenantEntry, inference: InferenceRequest) -> Admission:
    """The tenant's rate limits charged for this request (RateLimited, counted, if over)."""
    try:
        # Counting, tokenizing and embedding generate nothing: only the prompt is charged.
        budget = state.settings.rate_limit_default_completion_tokens if route in GENERATION_ROUTES else 0
        return state.rate_limiter.admit(tenant, estimate_tokens(inference.payload, budget))
    except RateLimited as exc:
        state.metrics.rate_limited.labels(tenant.tenant, exc.type_).inc()
        raise


async def _candidates(
    state: RouterState, ctx: RequestContext, arrival: Arrival, also: Collection[str] = ()
) -> tuple[list[Candidate], float]:
    """The replicas that may serve, and how long the request was held for one to scale up."""
    loaded, tenant, model, location = ctx.loaded, ctx.tenant, ctx.inference.model, ctx.location
    try:
        return state.select(loaded, tenant, model, location, also), 0.0
    except (ModelNotFound, NoHealthyReplica, NoReplicaInZone):
        seen = outlook(loaded, tenant, model)
        if seen is Outlook.AS_IS:
            raise
    # On the app's clock, as the hold's deadline is: the wait a test moves is the one reported.
    held_at = state.clock.monotonic()
    candidates = await state.scale_from_zero.hold(
        tenant,
        model,
        location,
        lambda table: state.select(table, tenant, model, location, also),
        arrival.departed,
        seen,
    )
    return candidates, state.clock.monotonic() - held_at


def _ordered(state: RouterState, ctx: RequestContext, candidates: list[Candidate]) -> list[Candidate]:
    """The candidates in the policy's order, counting the first choice's predicted cache hits."""
    loaded, tenant, inference, location = ctx.loaded, ctx.tenant, ctx.inference, ctx.location
    # A set at the bound may have left out the replica holding the prompt: affinity adds it.
    more = state.more(loaded, tenant, inference.model, location) if len(candidates) >= state.settings.max_candidates else None
    candidates, prefix = state.affinity.annotate(candidates, inference.model, inference.payload, more)
    ctx = RoutingContext(
        tenant=tenant,
        model=inference.model,
        stream=inference.stream,
        client_location=location,
        request_id=ctx.request_id,
        payload=inference.payload,
    )
    ordered = state.policy.order(candidates, ctx)
    choice = state.affinity.chosen(ordered[0], inference.model, prefix) if ordered else None
    if choice is not None:
        labels = (ordered[0].region.name, choice.node_id)
        state.metrics.child("prompt_tokens", *labels).inc(choice.prompt_tokens)
        state.metrics.child("predicted_cache_hits", *labels).inc(choice.predicted_hit_tokens)
    return ordered


async def _stored_response(state: RouterState, request: Request, response_id: str, method: str, suffix: str) -> Response:
    """GET or cancel a stored response, on the replica that holds it (no failover: no other
    replica has it)."""
    request_id = request_id_for(request.headers.get(HEADER_REQUEST_ID))
    request.state.request_id = request_id
    loaded = state.table()
    tenant = _tenant(loaded, request)
    stored = state.response_ids.resolve(response_id, tenant)
    node = loaded.nodes_by_id.get(stored.node_id)
    if node is None:
        raise ResponseNotFound(response_id)
    location = state.locator.locate(request.headers, request.client.host if request.client else None, loaded.regions)
    candidates: list[Candidate] = []
    for model in node.models:
        with contextlib.suppress(RouterError):
            candidates = pinned(loaded, state.select(loaded, tenant, model, location, (stored.node_id,)), stored, model)
            break
    if not candidates:
        raise NoHealthyReplica(node.models[0] if node.models else "", 5)
    # vLLM's GET takes `stream` and `starting_after` (resuming a background response).
    query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k in ("stream", "starting_after")])
    return await state.forwarder.forward(Exchange(
        f"/v1/responses/{stored.inner_id}{suffix}" + (f"?{query}" if query else ""),
        InferenceRequest(body=b"", model=candidates[0].node.models[0],
                         stream=request.query_params.get("stream") == "true", payload={}),
        candidates, request_id, time.perf_counter(),
        exhausted=NoHealthyReplica(candidates[0].node.models[0], 5),
        method=method, rewrite=state.response_ids.rewriter(tenant),
    ))
