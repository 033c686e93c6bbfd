"""Active health checks: every READY node's GET /metrics, which also reports its load.

Envoy's active health checking, with these semantics:

- every READY node of the routing table is probed every `probe_interval_s` (plus or minus
  10%, the first probe at a random point of the first interval, so that probes of many nodes
  and routers do not come in step), with the cluster token as Bearer and `probe_timeout_s`
  on the whole exchange;
- a 2xx is a success, and the node's load (`NodeLoad`) is read from the page; a connect
  error, a timeout or a 5xx is a failure; any other answer (a 4xx: no /metrics there, the
  token refused) says nothing about the node's health and counts as neither;
- `probe_unhealthy_threshold` failures in a row eject the node through the FleetState (so,
  like any ejection, it is shared through Redis and bounded by the max ejected percent);
  each probe that fails while it is ejected keeps it out for `ejection_base_s` more, so a
  node whose probes keep failing never comes back between an ejection's end and the next
  probe (the FleetState's docstring), as long as a node is probed more often than that;
- `probe_healthy_threshold` successes in a row while the node is ejected, whatever ejected
  it, end the ejection early (Envoy's successful_active_health_check_uneject_host);
- probes never clear the passive detector's counts: answering /metrics is not answering
  requests.

Scale: one router probes at most `probe_max_per_s` nodes a second, so a node is probed every
max(probe_interval_s, READY nodes / probe_max_per_s) seconds, the effective interval (jittered
as above). A fleet of up to probe_max_per_s x probe_interval_s nodes (100 by default) is probed
exactly as configured; a larger one less often, so that probing stays a small share of the
router's CPU and of the nodes' (50 routers x 10,000 nodes at 1 s would be 500,000 probes a
second). Health does not wait for probes: the passive detector (outlier.py) ejects a node at
the first refused connection a request meets. One scheduler task walks a heap of due times
and starts each probe when a slot of `probe_concurrency` is free, so an idle node costs a heap
entry, not a task (10,000 sleeping tasks hold ~10 MiB, the heap ~1.2 MiB: bench/probes.py).

Several workers of one router (geo_router.workers) probe as one: given a `ProbeShare`, a
prober probes only while its share says it leads (one worker at a time), tells the share each
load and round trip it learns, and reads what the leading sibling told before it answers
`load` or `rtt_ms`. Ejections need nothing of the share: they go through the FleetState,
which the workers share already.

The prober follows the routing table (`on_table`): a node that leaves it, or is no longer
READY, is no longer probed and its load is forgotten. A table a delta led to names the nodes
it changed, and the prober then looks only at those (O(changed nodes) per install); a table
built whole is followed over every node. Load and round trips older than three effective
intervals are not reported. Routing reads an unknown load as an idle node (policies, through
affinity.annotate), so staleness follows the effective interval: a large fleet keeps routing
by its nodes' last load rather than by none. The round trip is measured to the response
headers, so it includes the node's rendering of /metrics: an upper bound on the network RTT,
smoothed per region.

Intervals and the age of what was learnt are on the router's `Clock` (tests move them with a
ManualClock); the probe timeout and the round trip are real network time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import httpx

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import NodeStatus, RoutingNode
from meridian.http_server import CLIENT_KEEPALIVE_S
from meridian.settings.router import RouterSettings

from .health import FailureKind, FleetState
from .node_load import NodeLoad, parse_node_metrics
from .table import LoadedTable

log = logging.getLogger(__name__)

METRICS_PATH = "/metrics"
# Each interval is the configured one times a random factor within 1 +- this.
_JITTER = 0.1
# Load and round trips older than this many intervals are too old to route by.
_STALE_INTERVALS = 3
# Weight of the newest round trip in a region's moving average.
_RTT_ALPHA = 0.2
# Idle connections kept, one per node: a new connection per probe would double the round trip.
_MAX_KEEPALIVE = 1024


class ProbeShare(Protocol):
    """What one router's probers share (geo_router.workers.host_probes)."""

    def leads(self) -> bool:
        """Whether this prober probes now (one of the router's does)."""

    def tell_load(self, node_id: str, load: NodeLoad) -> None: ...

    def tell_rtt(self, region: str, ms: float, at: float) -> None: ...

    def news(self) -> tuple[list[tuple[str, NodeLoad]], list[tuple[str, float, float]]]:
        """The loads (node, load) and round trips (region, ms, at) the leader told since the
        last call; nothing, at the cost of one memory read, when it told nothing."""

    def release(self) -> None:
        """This prober stops: a sibling may lead."""


class ProbeResult(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"
    INCONCLUSIVE = "inconclusive"  # the node answered, but not with its metrics


@dataclass(slots=True)
class _Target:
    node: RoutingNode
    # The heap entry of its next probe (its sequence number); None while a probe runs or
    # before the prober starts. Entries of a target no longer held, or of an older sequence
    # number, are skipped when they come due.
    due_seq: int | None = None
    failures: int = 0  # probe failures in a row
    successes: int = 0  # probe successes in a row while the node is ejected
    load: NodeLoad | None = None
    warned_inconclusive: bool = False


@dataclass(frozen=True, slots=True)
class _Outcome:
    result: ProbeResult
    detail: str
    rtt_s: float | None = None  # to the response headers, when the node answered
    load: NodeLoad | None = None


@dataclass(slots=True)
class _RegionRtt:
    ms: float
    at: float


def make_probe_client(settings: RouterSettings) -> httpx.AsyncClient:
    """The pooled client probes use; the prober's semaphore bounds its concurrency."""
    return httpx.AsyncClient(
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=_MAX_KEEPALIVE,
            # Across a few probe intervals, and never as long as a node keeps one idle.
            keepalive_expiry=min(max(5.0, _STALE_INTERVALS * settings.probe_interval_s), CLIENT_KEEPALIVE_S),
        ),
        timeout=httpx.Timeout(settings.probe_timeout_s),
        follow_redirects=False,
        # Node traffic is cluster-internal: an HTTP(S)_PROXY in the environment must not capture it.
        trust_env=False,
    )


class NodeProber:
    """Probes every READY node of the routing table; knows their load and the regions' RTT."""

    def __init__(
        self,
        settings: RouterSettings,
        fleet: FleetState,
        client: httpx.AsyncClient | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        share: ProbeShare | None = None,
    ) -> None:
        self._settings = settings
        self._share = share
        self._fleet = fleet
        self._headers = {"authorization": f"Bearer {settings.cluster_token.get_secret_value()}"}
        self._owns_client = client is None
        self._client = client if client is not None else make_probe_client(settings)
        self._clock = clock
        self._interval_s = settings.probe_interval_s  # the effective interval
        self._stale_s = _STALE_INTERVALS * self._interval_s
        self._semaphore = asyncio.Semaphore(settings.probe_concurrency)
        self._targets: dict[str, _Target] = {}
        self._ready_in_region: Counter[str] = Counter()
        self._rtt: dict[str, _RegionRtt] = {}
        # The table followed last: a delta's changes apply on top of it only.
        self._version: int | None = None
        self._regions: object = None
        # Scheduling: (due, seq, node id) of each target's next probe, the scheduler task,
        # its sleep until the earliest due probe (cancelled by an earlier one) and the probes
        # running (each holds a slot of the semaphore).
        self._due: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._scheduler: asyncio.Task[None] | None = None
        self._nap: asyncio.Future[None] | None = None
        self._nap_until = math.inf
        self._probing: set[asyncio.Task[None]] = set()
        self._running = False
        self.probes_started = 0  # counted for tests and benchmarks

    # --- what selection reads ---------------------------------------------------------------

    def load(self, node_id: str) -> NodeLoad | None:
        """The node's last reported load; None when unknown or older than three intervals."""
        if self._share is not None:
            self._catch_up(self._share)
        t = self._targets.get(node_id)
        if t is None or t.load is None or self._clock.monotonic() - t.load.observed_at > self._stale_s:
            return None
        return t.load

    def loads(self) -> dict[str, NodeLoad]:
        """Every node's last reported load that is not stale."""
        return {node_id: load for node_id in self._targets if (load := self.load(node_id)) is not None}

    def rtt_ms(self, region: str) -> float | None:
        """Smoothed probe round trip to the region's nodes; None when not measured lately."""
        if self._share is not None:
            self._catch_up(self._share)
        r = self._rtt.get(region)
        if r is None or self._clock.monotonic() - r.at > self._stale_s:
            return None
        return r.ms

    @property
    def in_flight(self) -> int:
        """Background probes running now."""
        return len(self._probing)

    @property
    def interval_s(self) -> float:
        """The effective interval: max(probe_interval_s, READY nodes / probe_max_per_s)."""
        return self._interval_s

    # --- following the routing table ------------------------------------------------------

    def on_table(self, loaded: LoadedTable) -> None:
        """Probe the table's READY nodes from now on (a TableSource listener; never blocks).

        Also tells the FleetState which nodes the max ejected percent is a share of. O(changed
        nodes) for a table a delta led to from the one followed last, O(fleet) otherwise.
        """
        changed = loaded.changes_since(self._version)
        if changed is None or loaded.regions is not self._regions:
            self._follow_all(loaded)
        else:
            self._follow_changes(loaded, changed)
        self._version = loaded.version
        self._regions = loaded.regions
        self._interval_s = max(self._settings.probe_interval_s, len(self._targets) / self._settings.probe_max_per_s)
        self._stale_s = _STALE_INTERVALS * self._interval_s

    def _follow_all(self, loaded: LoadedTable) -> None:
        ready = {n.node_id: n for n in loaded.table.nodes if n.status == NodeStatus.READY}
        self._fleet.set_known_nodes({node_id: _zones(loaded, n) for node_id, n in ready.items()})
        for node_id in self._targets.keys() - ready.keys():
            self._forget(node_id)
        for node_id, node in ready.items():
            self._keep(node_id, node)

    def _follow_changes(self, loaded: LoadedTable, changed: frozenset[str]) -> None:
        upserted: dict[str, tuple[str, ...]] = {}
        removed: list[str] = []
        for node_id in changed:
            node = loaded.nodes_by_id.get(node_id)
            if node is not None and node.status == NodeStatus.READY:
                upserted[node_id] = _zones(loaded, node)
                self._keep(node_id, node)
            else:
                removed.append(node_id)
                if node_id in self._targets:
                    self._forget(node_id)
        self._fleet.update_known_nodes(upserted, removed)

    def _keep(self, node_id: str, node: RoutingNode) -> None:
        target = self._targets.get(node_id)
        if target is None:
            target = self._targets[node_id] = _Target(node)
            self._ready_in_region[node.region] += 1
            if self._scheduler is not None:
                self._schedule(node_id, target, self._clock.monotonic() + random.uniform(0, self._interval_s))
            return
        if target.node.region != node.region:
            self._left_region(target.node.region)
            self._ready_in_region[node.region] += 1
        target.node = node  # its URL may have changed

    def _forget(self, node_id: str) -> None:
        # Its heap entry stays until it comes due, and is skipped then.
        target = self._targets.pop(node_id)
        self._left_region(target.node.region)

    def _left_region(self, region: str) -> None:
        self._ready_in_region[region] -= 1
        if self._ready_in_region[region] <= 0:
            del self._ready_in_region[region]
            self._rtt.pop(region, None)

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start probing the nodes of the tables seen so far and of those to come."""
        if self._running:
            return
        self._running = True
        if not self._settings.probe_enabled:
            log.info("active health probes are off (probe_enabled=false)")
            return
        # The first probe of each node at a random point of the first interval.
        now = self._clock.monotonic()
        for node_id, target in self._targets.items():
            self._schedule(node_id, target, now + random.uniform(0, self._interval_s))
        self._scheduler = asyncio.create_task(self._run(), name="probe-scheduler")

    async def stop(self) -> None:
        """Stop probing at once (probes in flight are cancelled) and close the client."""
        self._running = False
        if self._share is not None:
            self._share.release()
        tasks = list(self._probing)
        if self._scheduler is not None:
            tasks.append(self._scheduler)
            self._scheduler = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._due.clear()
        for target in self._targets.values():
            target.due_seq = None
        if self._owns_client:
            await self._client.aclose()

    # --- scheduling --------------------------------------------------------------------

    def _schedule(self, node_id: str, target: _Target, at: float) -> None:
        seq = next(self._seq)
        target.due_seq = seq
        heapq.heappush(self._due, (at, seq, node_id))
        if at < self._nap_until and self._nap is not None:
            self._nap.cancel()  # the scheduler sleeps past this probe: wake it

    async def _run(self) -> None:
        """Start each probe when it is due and a slot is free; sleep until the next is due."""
        while True:
            now = self._clock.monotonic()
            while self._due and self._due[0][0] <= now:
                _, seq, node_id = heapq.heappop(self._due)
                target = self._targets.get(node_id)
                if target is None or target.due_seq != seq:
                    continue  # forgotten, or scheduled again since
                target.due_seq = None
                await self._semaphore.acquire()  # bounded: waits while probe_concurrency run
                if self._targets.get(node_id) is not target:
                    self._semaphore.release()  # forgotten while it waited
                    continue
                task = asyncio.create_task(self._probe_and_reschedule(node_id, target, now))
                self._probing.add(task)
                task.add_done_callback(self._probing.discard)
            await self._sleep_until(self._due[0][0] if self._due else math.inf)

    async def _sleep_until(self, at: float) -> None:
        if at == math.inf:
            nap: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        else:
            nap = asyncio.ensure_future(self._clock.sleep(at - self._clock.monotonic()))
        self._nap, self._nap_until = nap, at
        try:
            await asyncio.wait({nap})
        finally:
            nap.cancel()
            self._nap, self._nap_until = None, math.inf

    async def _probe_and_reschedule(self, node_id: str, target: _Target, started: float) -> None:
        try:
            # A sibling worker that leads probes for this one: it keeps its schedule, so that
            # it probes on time from the moment it takes the lead over.
            if self._share is None or self._share.leads():
                self.probes_started += 1
                await self._probe_target(node_id, target)
        except Exception:  # noqa: BLE001 - a probe's bug must not end the node's probing
            log.exception("probing node %s failed unexpectedly", node_id)
        finally:
            self._semaphore.release()
        if self._running and self._targets.get(node_id) is target:
            # As a loop per node would: the next probe an interval after this one's start.
            delay = self._interval_s * random.uniform(1 - _JITTER, 1 + _JITTER)
            self._schedule(node_id, target, started + delay)

    # --- probing -----------------------------------------------------------------------

    async def probe(self, node_id: str) -> ProbeResult | None:
        """Probe the node once now and apply the outcome; None when the node is not known."""
        target = self._targets.get(node_id)
        if target is None:
            return None
        async with self._semaphore:
            return await self._probe_target(node_id, target)

    async def _probe_target(self, node_id: str, target: _Target) -> ProbeResult:
        outcome = await self._fetch(target.node)
        if self._targets.get(node_id) is not target:
            return outcome.result  # forgotten while it was probed
        if outcome.rtt_s is not None:
            self._note_rtt(target.node.region, outcome.rtt_s)
        if outcome.result is ProbeResult.SUCCESS:
            self._succeeded(node_id, target, outcome.load)
        elif outcome.result is ProbeResult.FAILURE:
            self._failed(node_id, target, outcome.detail)
        elif not target.warned_inconclusive:
            target.warned_inconclusive = True
            log.warning("node %s answered its health probe with %s; its load is unknown",
                        node_id, outcome.detail)
        return outcome.result


    async def _fetch(self, node: RoutingNode) -> _Outcome:
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self._settings.probe_timeout_s):
                async with self._client.stream("GET", node.url + METRICS_PATH, headers=self._headers) as resp:
                    rtt_s = time.perf_counter() - started
                    status = resp.status_code
                    if status >= 500:
                        return _Outcome(ProbeResult.FAILURE, f"HTTP {status}", rtt_s)
                    if not 200 <= status < 300:
                        return _Outcome(ProbeResult.INCONCLUSIVE, f"HTTP {status}", rtt_s)
                    body = await resp.aread()
        except TimeoutError:
            return _Outcome(ProbeResult.FAILURE, f"no answer within {self._settings.probe_timeout_s:g}s")
        except (httpx.HTTPError, httpx.InvalidURL, OSError) as exc:
            return _Outcome(ProbeResult.FAILURE, f"{type(exc).__name__}: {exc}")
        load = parse_node_metrics(body.decode("utf-8", errors="replace"), observed_at=self._clock.monotonic())
        return _Outcome(ProbeResult.SUCCESS, "ok", rtt_s, load)

    def _succeeded(self, node_id: str, target: _Target, load: NodeLoad | None) -> None:
        if target.failures >= self._settings.probe_unhealthy_threshold:
            log.info("node %s answers its health probes again", node_id)
        target.failures = 0
        if load is not None:
            load = dataclasses.replace(load, own_in_flight=self._fleet.in_flight(node_id))
        target.load = load
        if load is not None and self._share is not None:
            self._share.tell_load(node_id, load)
        if not self._fleet.is_ejected(node_id):
            target.successes = 0
            return
        target.successes += 1
        if target.successes >= self._settings.probe_healthy_threshold:
            target.successes = 0
            if self._fleet.uneject(node_id):
                log.info("node %s back in service after %d good health probes",
                         node_id, self._settings.probe_healthy_threshold)

    def _failed(self, node_id: str, target: _Target, detail: str) -> None:
        target.successes = 0
        target.failures += 1
        if target.failures < self._settings.probe_unhealthy_threshold:
            log.debug("node %s failed a health probe (%s)", node_id, detail)
            return
        # While the node is ejected this keeps it out; once the ejection ends it ejects again.
        was_ejected = self._fleet.is_ejected(node_id)
        ejected_s = self._fleet.record_failure(node_id, FailureKind.PROBE)
        if ejected_s > 0 and not was_ejected:
            log.warning("node %s failed %d health probes in a row (%s); ejected for %.1fs",
                        node_id, target.failures, detail, ejected_s)

    def _note_rtt(self, region: str, rtt_s: float) -> None:
        ms = rtt_s * 1000
        r = self._rtt.get(region)
        r = self._rtt[region] = _RegionRtt(ms if r is None else r.ms + _RTT_ALPHA * (ms - r.ms), self._clock.monotonic())
        if self._share is not None:
            self._share.tell_rtt(region, r.ms, r.at)

    def _catch_up(self, share: ProbeShare) -> None:
        """What the leading sibling learnt, where it is newer than what this prober holds."""
        loads, rtts = share.news()
        for node_id, load in loads:
            t = self._targets.get(node_id)
            if t is not None and (t.load is None or t.load.observed_at <= load.observed_at):
                t.load = load
        for region, ms, at in rtts:
            r = self._rtt.get(region)
            if r is None or r.at <= at:
                self._rtt[region] = _RegionRtt(ms, at)


def _zones(loaded: LoadedTable, node: RoutingNode) -> tuple[str, ...]:
    """The residency zones a node serves: its region's."""
    region = loaded.regions.get(node.region)
    return tuple(region.zones) if region is not None else ()
