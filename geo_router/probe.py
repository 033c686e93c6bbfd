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
  while the probes keep failing it is ejected again each time an ejection ends;
- `probe_healthy_threshold` successes in a row while the node is ejected, whatever ejected
  it, end the ejection early (Envoy's successful_active_health_check_uneject_host);
- probes never clear the passive detector's counts: answering /metrics is not answering
  requests.

The prober follows the routing table (`on_table`): a node that leaves it, or is no longer
READY, is no longer probed and its load is forgotten. Each node has a task of its own and a
semaphore bounds the probes in flight. Load and round trips older than three intervals are
not reported. The round trip is measured to the response headers, so it includes the node's
rendering of /metrics: an upper bound on the network RTT, smoothed per region.

Intervals and the age of what was learnt are on the router's `Clock` (tests move them with a
ManualClock); the probe timeout and the round trip are real network time.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from enum import StrEnum

import httpx

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import NodeStatus, RoutingNode
from meridian.settings import RouterSettings

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


class ProbeResult(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"
    INCONCLUSIVE = "inconclusive"  # the node answered, but not with its metrics


@dataclass(slots=True)
class _Target:
    node: RoutingNode
    task: asyncio.Task[None] | None = None
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
            keepalive_expiry=max(5.0, _STALE_INTERVALS * settings.probe_interval_s),
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
    ) -> None:
        self._settings = settings
        self._fleet = fleet
        self._headers = {"authorization": f"Bearer {settings.cluster_token.get_secret_value()}"}
        self._owns_client = client is None
        self._client = client if client is not None else make_probe_client(settings)
        self._clock = clock
        self._stale_s = _STALE_INTERVALS * settings.probe_interval_s
        self._semaphore = asyncio.Semaphore(settings.probe_concurrency)
        self._targets: dict[str, _Target] = {}
        self._rtt: dict[str, _RegionRtt] = {}
        self._leaving: set[asyncio.Task[None]] = set()
        self._running = False

    # --- what selection reads ---------------------------------------------------------------

    def load(self, node_id: str) -> NodeLoad | None:
        """The node's last reported load; None when unknown or older than three intervals."""
        t = self._targets.get(node_id)
        if t is None or t.load is None or self._clock.monotonic() - t.load.observed_at > self._stale_s:
            return None
        return t.load

    def loads(self) -> dict[str, NodeLoad]:
        """Every node's last reported load that is not stale."""
        return {node_id: load for node_id in self._targets if (load := self.load(node_id)) is not None}

    def rtt_ms(self, region: str) -> float | None:
        """Smoothed probe round trip to the region's nodes; None when not measured lately."""
        r = self._rtt.get(region)
        if r is None or self._clock.monotonic() - r.at > self._stale_s:
            return None
        return r.ms

    # --- following the routing table ------------------------------------------------------

    def on_table(self, loaded: LoadedTable) -> None:
        """Probe the table's READY nodes from now on (a TableSource listener; never blocks).

        Also tells the FleetState which nodes the max ejected percent is a share of.
        """
        ready = {n.node_id: n for n in loaded.table.nodes if n.status == NodeStatus.READY}
        self._fleet.set_known_nodes({
            node_id: region.zones if (region := loaded.regions.get(n.region)) is not None else ()
            for node_id, n in ready.items()
        })
        for node_id in self._targets.keys() - ready.keys():
            self._forget(node_id)
        for node_id, node in ready.items():
            target = self._targets.get(node_id)
            if target is None:
                target = self._targets[node_id] = _Target(node)
                if self._running:
                    self._spawn(node_id, target)
            else:
                target.node = node  # its URL may have changed
        regions = {n.region for n in ready.values()}
        for region in self._rtt.keys() - regions:
            del self._rtt[region]

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Start probing the nodes of the tables seen so far and of those to come."""
        if self._running:
            return
        self._running = True
        if not self._settings.probe_enabled:
            log.info("active health probes are off (probe_enabled=false)")
            return
        for node_id, target in self._targets.items():
            self._spawn(node_id, target)

    async def stop(self) -> None:
        """Stop probing at once (probes in flight are cancelled) and close the client."""
        self._running = False
        tasks = [t.task for t in self._targets.values() if t.task is not None] + list(self._leaving)
        for target in self._targets.values():
            target.task = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._owns_client:
            await self._client.aclose()

    # --- probing -----------------------------------------------------------------------

    async def probe(self, node_id: str) -> ProbeResult | None:
        """Probe the node once now and apply the outcome; None when the node is not known."""
        target = self._targets.get(node_id)
        if target is None:
            return None
        async with self._semaphore:
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

    async def _run(self, node_id: str) -> None:
        interval = self._settings.probe_interval_s
        await self._clock.sleep(random.uniform(0, interval))
        while True:
            started = self._clock.monotonic()
            try:
                await self.probe(node_id)
            except Exception:  # noqa: BLE001 - a probe's bug must not end the node's probing
                log.exception("probing node %s failed unexpectedly", node_id)
            delay = interval * random.uniform(1 - _JITTER, 1 + _JITTER)
            await self._clock.sleep(started + delay - self._clock.monotonic())

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
        target.load = load
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
        # While the node is ejected this is a no-op; once the ejection ends it ejects again.
        ejected_s = self._fleet.record_failure(node_id, FailureKind.PROBE)
        if ejected_s > 0:
            log.warning("node %s failed %d health probes in a row (%s); ejected for %.1fs",
                        node_id, target.failures, detail, ejected_s)

    def _note_rtt(self, region: str, rtt_s: float) -> None:
        ms = rtt_s * 1000
        r = self._rtt.get(region)
        self._rtt[region] = _RegionRtt(ms if r is None else r.ms + _RTT_ALPHA * (ms - r.ms), self._clock.monotonic())

    def _spawn(self, node_id: str, target: _Target) -> None:
        if self._settings.probe_enabled:
            target.task = asyncio.create_task(self._run(node_id), name=f"probe:{node_id}")

    def _forget(self, node_id: str) -> None:
        target = self._targets.pop(node_id)
        if target.task is not None:
            target.task.cancel()
            # stop() still awaits it, so that no task outlives the prober.
            self._leaving.add(target.task)
            target.task.add_done_callback(self._leaving.discard)

