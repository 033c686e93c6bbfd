"""Requests with no ready replica: held while one can come in time, else answered at once.

A request for a deployed model with no ready replica its tenant may use has an `Outlook`:

- the deployment scales to zero (min_replicas 0): the request waits in a bounded per-model
  queue instead of being refused. The first waiter opens a wait episode: the router asks the
  control plane to scale the deployment up, and asks again every `scale_from_zero_reask_s`
  while requests still wait (the call is idempotent). A passed `scale_from_zero_timeout_s` is
  answered 503 `model_scaling_from_zero`;
- the deployment keeps replicas (min_replicas >= 1) and one is starting in the tenant's zone:
  the request waits for it in the same queue, at most `replica_start_wait_s`, then gets 503
  `no_replica_in_zone` (`no_healthy_replica` for a global tenant);
- it keeps replicas but none is ready or starting in the zone (the zone lost its last one): that
  503 at once, with nothing held. Waiting could not help, and a client held without a byte
  gives up on its own timeout, counted as its hang-up rather than as the fabric's failure.

Every routing table the router installs wakes the waiters, which look again for a ready
replica they may use and are then forwarded as usual. A full queue is answered 503 at once;
every 503 here carries Retry-After and comes before any byte, streams included. A client that
hangs up leaves the queue. Nothing is dropped without an answer. The deadlines and the
re-asking are timed on the router's `Clock`, so tests move them with a ManualClock.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from http import HTTPStatus

import httpx

from meridian.clock import SYSTEM_CLOCK, Clock, event_or_timeout, first_or_timeout
from meridian.cluster_client import ClusterAPIError, ClusterClient
from meridian.contracts import (
    DeploymentEntry,
    NodeStatus,
    RegionInfo,
    ScaleUpRequest,
    TenantEntry,
)
from meridian.geo import Point, region_rtt_ms
from meridian.settings.router import RouterSettings

from ..errors import ClientClosedRequest, RouterError, ScaleFromZeroQueueFull, ScaleFromZeroTimeout
from ..observability.metrics import RouterMetrics
from ..state.table import LoadedTable, TableSource, cluster_endpoint
from .candidates import Candidate, exhausted_error, tenant_may_use

log = logging.getLogger(__name__)

SCALE_UP_REASON = "scale-from-zero"


def deployment_may_use(deployment: DeploymentEntry, region: RegionInfo) -> bool:
    """Residency of a deployment: may its replicas run in `region`?"""
    return region.admits(deployment.zone)


def placeable_regions(table: LoadedTable, tenant: TenantEntry, deployment: DeploymentEntry) -> list[RegionInfo]:
    """Regions where the deployment may get a replica that this tenant may also use."""
    return [
        r for r in table.regions.values() if tenant_may_use(tenant, r) and deployment_may_use(deployment, r)
    ]


class Outlook(StrEnum):
    """What a request whose tenant may use no ready replica of its model can expect."""

    # Not the business of this module: no deployment could serve the tenant (the model is not
    # deployed, or not in a region its zone admits), or a ready replica exists but is ejected
    # or refused by its breaker (a failure, not a cold start). The selection's error stands.
    AS_IS = "as_is"
    # The deployment scales to zero: held while it scales up (scale_from_zero_timeout_s).
    SCALING_FROM_ZERO = "scaling_from_zero"
    # It keeps replicas and one is starting in the zone: held for it (replica_start_wait_s).
    STARTING = "starting"
    # It keeps replicas but the zone has none ready or starting: 503 at once.
    NONE_COMING = "none_coming"


def outlook(table: LoadedTable, tenant: TenantEntry, model: str) -> Outlook:
    """Whether and how long a request of `tenant` for `model` may wait for a replica (the
    module's doc), from the routing table alone."""
    if not tenant.may_use(model):
        return Outlook.AS_IS
    deployment = table.deployments.get(model)
    if deployment is None or not placeable_regions(table, tenant, deployment):
        return Outlook.AS_IS
    statuses: set[NodeStatus] = set()
    for node in table.nodes_by_model.get(model, ()):
        region = table.regions.get(node.region)
        if region is not None and tenant_may_use(tenant, region):
            statuses.add(node.status)
    if NodeStatus.READY in statuses:
        return Outlook.AS_IS
    if deployment.min_replicas == 0:
        return Outlook.SCALING_FROM_ZERO
    return Outlook.STARTING if NodeStatus.STARTING in statuses else Outlook.NONE_COMING


def deployed_models(table: LoadedTable, tenant: TenantEntry) -> list[str]:
    """Deployed models the tenant may use, whether or not a replica runs now."""
    return sorted(
        d.model
        for d in table.deployments.values()
        if tenant.may_use(d.model) and placeable_regions(table, tenant, d)
    )


class ScaleUpClient:
    """Asks the control plane to scale a deployment up; failures are logged, never raised."""

    def __init__(
        self,
        settings: RouterSettings,
        metrics: RouterMetrics,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._metrics = metrics
        self._cluster = ClusterClient(cluster_endpoint(settings, settings.scale_up_timeout_s),
                                      transport=transport)

    async def aclose(self) -> None:
        await self._cluster.aclose()

    async def request(self, model: str, body: ScaleUpRequest) -> bool:
        """POST the scale-up request; True when the control plane accepted it."""
        try:
            await self._cluster.scale_up(model, body)
        except ClusterAPIError as exc:
            outcome = "not_found" if exc.status == HTTPStatus.NOT_FOUND else "error"
            self._metrics.scale_up_requests.labels(model, outcome).inc()
            log.warning("scale-up of %s failed (%s); asking again later", model, exc)
            return False
        self._metrics.scale_up_requests.labels(model, "ok").inc()
        log.info("asked the control plane to scale %s up (%d queued)", model, body.queued_requests)
        return True


@dataclass(eq=False)
class _Episode:
    """The requests waiting for one model, from the first to arrive until none is left."""

    model: str
    hint: ScaleUpRequest
    waiting: int = 0
    # Waiting requests per tenant: a tenant may hold only its share of the queue.
    by_tenant: dict[str, int] = field(default_factory=dict)
    # Replaced after each set(), so a waiter always waits for the next table.
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    # Whether the control plane is being asked to scale up (only for a scale-from-zero wait:
    # a deployment that keeps replicas already wants at least one).
    asking: bool = False


class ScaleFromZero:
    """The per-model holding queues of one router and the scale-up requests they cause."""

    def __init__(
        self,
        settings: RouterSettings,
        source: TableSource,
        metrics: RouterMetrics,
        client: ScaleUpClient,
        *,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._source = source
        self._metrics = metrics
        self._client = client
        self._episodes: dict[str, _Episode] = {}
        self._askers: set[asyncio.Task[None]] = set()
        source.add_listener(self._on_table)

    async def aclose(self) -> None:
        """Stop asking for scale-ups and close the control-plane client."""
        for task in list(self._askers):
            task.cancel()
        await asyncio.gather(*self._askers, return_exceptions=True)
        await self._client.aclose()

    def queued(self, model: str) -> int:
        """Requests waiting for `model` now."""
        episode = self._episodes.get(model)
        return episode.waiting if episode is not None else 0

    def _on_table(self, _loaded: LoadedTable) -> None:
        for episode in self._episodes.values():
            episode.changed.set()
            episode.changed = asyncio.Event()

    async def hold(
        self,
        tenant: TenantEntry,
        model: str,
        client_location: Point | None,
        select: Callable[[LoadedTable], list[Candidate]],
        departed: Callable[[], Awaitable[None]],
        seen: Outlook,
    ) -> list[Candidate]:
        """Wait until `select` finds replicas in a newer table, as long as the `seen` outlook
        allows; typed 503s when it cannot.

        `select` raises a RouterError when no replica can serve; that error is answered
        as is once waiting no longer makes sense (the deployment went away, say).
        """
        s = self._settings
        if seen is Outlook.NONE_COMING:
            raise exhausted_error(tenant, model, s.no_replica_retry_after_s)
        episode = self._join(tenant, model, client_location, seen)
        started = self._clock.monotonic()
        from_zero = seen is Outlook.SCALING_FROM_ZERO
        wait_s = s.scale_from_zero_timeout_s if from_zero else s.replica_start_wait_s
        deadline = started + wait_s
        disconnected = asyncio.ensure_future(departed())
        try:
            while True:
                changed = episode.changed
                candidates = self._ready(tenant, model, select)
                if candidates:
                    self._metrics.scale_wait.observe(self._clock.monotonic() - started)
                    return candidates
                remaining = deadline - self._clock.monotonic()
                if remaining <= 0:
                    log.warning("no replica of %s turned ready for zone %s within %gs", model, tenant.zone, wait_s)
                    if not from_zero:
                        raise exhausted_error(tenant, model, s.no_replica_retry_after_s)
                    self._metrics.scale_timeouts.labels(model).inc()
                    raise ScaleFromZeroTimeout(model, wait_s, s.scale_from_zero_retry_after_s)
                woken = asyncio.ensure_future(changed.wait())
                try:
                    done = await first_or_timeout(self._clock, remaining, woken, disconnected)
                finally:
                    woken.cancel()
                if disconnected in done:
                    raise ClientClosedRequest()
        finally:
            disconnected.cancel()
            self._leave(episode, tenant.tenant)

    def _join(self, tenant: TenantEntry, model: str, client_location: Point | None, seen: Outlook) -> _Episode:
        """Queue the request in its model's episode (a full queue, or the tenant's full share of
        it, is answered 503 at once); a scale-from-zero wait has the control plane asked."""
        s = self._settings
        episode = self._episodes.get(model)
        if episode is not None and episode.waiting >= s.scale_from_zero_queue_size:
            self._metrics.scale_rejected.labels(model).inc()
            raise ScaleFromZeroQueueFull(model, s.scale_from_zero_queue_size, s.scale_from_zero_retry_after_s)
        tenant_limit = max(1, int(s.scale_from_zero_queue_size * s.scale_from_zero_tenant_share))
        if episode is not None and episode.by_tenant.get(tenant.tenant, 0) >= tenant_limit:
            self._metrics.scale_rejected.labels(model).inc()
            raise ScaleFromZeroQueueFull(model, tenant_limit, s.scale_from_zero_retry_after_s, yours=True)
        if episode is None:
            episode = _Episode(model, self._hint(tenant, model, client_location))
            self._episodes[model] = episode
        if seen is Outlook.SCALING_FROM_ZERO and not episode.asking:
            self._start_asking(episode)
        episode.waiting += 1
        episode.by_tenant[tenant.tenant] = episode.by_tenant.get(tenant.tenant, 0) + 1
        self._metrics.scale_queued.labels(model).set(episode.waiting)
        return episode

    def _ready(
        self, tenant: TenantEntry, model: str, select: Callable[[LoadedTable], list[Candidate]]
    ) -> list[Candidate] | None:
        loaded = self._source.current()
        if loaded is None:
            return None
        try:
            return select(loaded)
        except RouterError:
            seen = outlook(loaded, tenant, model)
            if seen is Outlook.AS_IS:
                raise
            if seen is Outlook.NONE_COMING:  # the replica that was starting went away
                raise exhausted_error(tenant, model, self._settings.no_replica_retry_after_s) from None
            return None

    def _hint(self, tenant: TenantEntry, model: str, client_location: Point | None) -> ScaleUpRequest:
        """Where a replica would serve the first waiter best: the nearest region it may use."""
        loaded = self._source.current()
        deployment = loaded.deployments.get(model) if loaded is not None else None
        region: str | None = None
        if loaded is not None and deployment is not None:
            regions = placeable_regions(loaded, tenant, deployment)
            if regions:
                region = min(regions, key=lambda r: (region_rtt_ms(client_location, r), r.name)).name
        return ScaleUpRequest(reason=SCALE_UP_REASON, client_region=region, zone=tenant.zone)

    def _start_asking(self, episode: _Episode) -> None:
        episode.asking = True
        task = asyncio.create_task(self._ask(episode), name=f"scale-up:{episode.model}")
        self._askers.add(task)
        task.add_done_callback(self._askers.discard)

    async def _ask(self, episode: _Episode) -> None:
        # An in-flight request is not cut short when the episode ends: the deployment
        # should still scale up for the clients that will retry.
        while not episode.ended.is_set():
            body = episode.hint.model_copy(update={"queued_requests": episode.waiting})
            await self._client.request(episode.model, body)
            await event_or_timeout(self._clock, episode.ended, self._settings.scale_from_zero_reask_s)

    def _leave(self, episode: _Episode, tenant: str) -> None:
        episode.waiting -= 1
        episode.by_tenant[tenant] -= 1
        if not episode.by_tenant[tenant]:
            del episode.by_tenant[tenant]
        self._metrics.scale_queued.labels(episode.model).set(episode.waiting)
        if episode.waiting == 0:
            episode.ended.set()
            if self._episodes.get(episode.model) is episode:
                del self._episodes[episode.model]
