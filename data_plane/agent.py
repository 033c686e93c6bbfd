"""The node agent: keeps this node registered with the control plane and reports its
status and load, without ever letting the control plane's absence stop serving."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import socket
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from urllib.parse import urlsplit

import httpx

from meridian.clock import SYSTEM_CLOCK, Clock, wait_at_most
from meridian.cluster_client import ClusterAPIError, ClusterClient, ClusterEndpoint
from meridian.contracts import (
    HEARTBEAT_RETRY_MAX_S,
    ColdStart,
    EngineKind,
    KVConnector,
    KVTransferInfo,
    NodeCapability,
    NodeHeartbeat,
    NodeLoad,
    NodeRegistration,
    NodeRole,
    NodeStatus,
)
from meridian.settings.node import NodeSettings

log = logging.getLogger(__name__)

# Used until the control plane's first answer says how often it wants heartbeats.
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0


def _package_version() -> str:
    try:
        return version("meridian")
    except PackageNotFoundError:
        return ""


def default_node_id(settings: NodeSettings) -> str:
    """settings.node_id, else "<hostname>-<port>" in the form node ids allow."""
    if settings.node_id:
        return settings.node_id
    host = re.sub(r"[^a-z0-9._-]+", "-", socket.gethostname().lower()).strip("-._") or "node"
    return f"{host[:50]}-{settings.port}"


def advertise_url(settings: NodeSettings) -> str:
    """URL routers reach this node at: settings.advertise_url, else http://host:port."""
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    host = settings.host
    if host in ("", "0.0.0.0", "::"):
        # A wildcard bind address is not reachable; the hostname is the best guess.
        host = socket.gethostname()
    return f"http://{host}:{settings.port}"


def advertised_endpoint(settings: NodeSettings) -> tuple[str, int]:
    """(host, port) of the advertised URL: where peers reach this node's HTTP listener."""
    url = urlsplit(advertise_url(settings))
    return url.hostname or settings.host, url.port or (443 if url.scheme == "https" else 80)


def torch_kv_transfer(settings: NodeSettings) -> KVTransferInfo | None:
    """The KV transfer a torch node advertises: Meridian's connector on its own listener,
    where decode nodes pull held KV (data_plane.server.kv_export); None for a co-located
    node without a connector."""
    if settings.role is NodeRole.BOTH and settings.kv_connector is None:
        return None
    host, port = advertised_endpoint(settings)
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return KVTransferInfo(connector=KVConnector.MERIDIAN, endpoint=endpoint, lease_s=settings.kv_lease_s)


# tcp://host:port as ZMQ writes it (an IPv6 host in brackets).
_TCP_ENDPOINT = re.compile(r"^tcp://(\[[^\]]*\]|[^:/]+):([0-9]+|\*)$")
# Hosts that mean "every interface": a bind address, not one a router can connect to.
_WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]")


def _routable_endpoint(endpoint: str, settings: NodeSettings, *, bound_only: bool) -> str | None:
    """The endpoint a router connects to for a socket this node opens on `endpoint`, or None.

    `bound_only`: the socket binds only on a wildcard host (the KV event PUB socket follows
    vLLM's convention: a concrete host:port connects out to a collector, which routers
    cannot subscribe to); otherwise (the replay socket) it always binds.
    """
    if endpoint.startswith("ipc://"):
        return endpoint  # a local socket file: routers on this machine reach it as it is
    m = _TCP_ENDPOINT.match(endpoint)
    if m is None:
        return None
    host, port = m.groups()
    if port == "*":
        return None  # the port is picked at bind time; only kv_events_*_advertise can name it
    if host == "0.0.0.0" and bound_only:
        return None  # the publisher connects to 0.0.0.0 (vLLM's rule): nothing to subscribe to
    if host not in _WILDCARD_HOSTS:
        return None if bound_only else endpoint
    advertised = urlsplit(advertise_url(settings)).hostname or settings.host
    if ":" in advertised:
        advertised = f"[{advertised}]"
    return f"tcp://{advertised}:{port}"


def advertise_kv_events(settings: NodeSettings) -> tuple[str | None, str | None]:
    """(KV events, replay) endpoints routers connect to: the *_advertise settings, else derived
    from the endpoints the node binds; None where the node publishes nothing routers can reach."""
    if not settings.kv_events_endpoint:
        return None, None
    events = settings.kv_events_advertise or _routable_endpoint(
        settings.kv_events_endpoint, settings, bound_only=True
    )
    if events is None:
        log.warning(
            "KV events on %s cannot be advertised to routers (not a wildcard-host bind address); "
            "set kv_events_advertise", settings.kv_events_endpoint,
        )
        return None, None
    replay = settings.kv_events_replay_advertise
    if replay is None and settings.kv_events_replay_endpoint:
        replay = _routable_endpoint(settings.kv_events_replay_endpoint, settings, bound_only=False)
    return events, replay


def cluster_endpoint(settings: NodeSettings) -> ClusterEndpoint:
    """The control plane as this node's agent and weight peers reach it (cluster token)."""
    if not settings.control_plane_url:
        raise ValueError("settings.control_plane_url is not set")
    return ClusterEndpoint(settings.control_plane_url, settings.cluster_token, settings.control_plane_timeout_s)


class NodeAgent:
    """Registers, heartbeats (re-registering when forgotten) and deregisters a node."""

    def __init__(
        self,
        settings: NodeSettings,
        *,
        models: list[str],
        status: Callable[[], NodeStatus],
        load: Callable[[], NodeLoad],
        weights: Callable[[], list[str]] | None = None,
        cold_start: Callable[[], ColdStart] | None = None,
        tool_call_parser: str | None = None,
        kv_transfer: KVTransferInfo | None = None,
        capabilities: Sequence[NodeCapability] = (),
        max_num_seqs: int | None = None,
        retry_base_s: float = 0.5,
        retry_max_s: float = HEARTBEAT_RETRY_MAX_S,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not settings.control_plane_url:
            raise ValueError("the node agent needs settings.control_plane_url")
        if not settings.region:
            raise ValueError("settings.region is required to register with the control plane")
        self._settings = settings
        self._models = list(models)
        self._status = status
        self._load = load
        self._weights = weights
        self._cold_start = cold_start
        self._retry_base_s = retry_base_s
        self._retry_max_s = retry_max_s
        self._transport = transport
        # Heartbeat intervals, retry backoffs and the wait for the first registration.
        self._clock = clock
        kv_events, kv_events_replay = advertise_kv_events(settings)
        # Validated now so a misconfigured node fails at start-up, not in the loop.
        self._registration = NodeRegistration(
            node_id=default_node_id(settings),
            region=settings.region,
            url=advertise_url(settings),
            models=self._models,
            engine=EngineKind.VLLM if settings.engine == "vllm" else EngineKind.TORCH,
            capabilities=list(capabilities),
            max_num_seqs=max_num_seqs,
            version=_package_version()[:64],
            kv_events=kv_events,
            kv_events_replay=kv_events_replay,
            tool_call_parser=tool_call_parser,
            # A prefill or decode node without a KV transfer fails here, at start-up.
            role=settings.role,
            kv_transfer=kv_transfer,
        )
        self.node_id = self._registration.node_id
        self.heartbeat_interval_s = DEFAULT_HEARTBEAT_INTERVAL_S
        self.registered = False
        self.heartbeats_sent = 0
        self._failures = 0
        self._retry_after_s: float | None = None  # what the last refusal said, if it did
        self._client: ClusterClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._first_registration = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._rng = random.Random()

    async def start(self) -> None:
        """Start the background loop; the first registration happens right away."""
        if self._task is not None:
            return
        self._client = ClusterClient(cluster_endpoint(self._settings), transport=self._transport)
        self._task = asyncio.create_task(self._run(), name=f"node-agent-{self.node_id}")

    async def wait_registered(self, timeout_s: float) -> bool:
        """Wait (at most timeout_s) until the control plane has taken this node's
        registration once; False if it has not (the node goes on without it)."""
        return await wait_at_most(self._clock, timeout_s, self._first_registration.wait())

    def notify(self) -> None:
        """Report now instead of at the next interval (the status changed)."""
        self._wake.set()

    async def report_now(self) -> bool:
        """Send one registration or heartbeat immediately; True if the control plane took it."""
        return await self._report()

    async def leave(self) -> bool:
        """Stop reporting and deregister (the node has drained); True if acknowledged."""
        await self._stop_loop()
        if self._client is None:
            return False
        try:
            await self._client.deregister(self.node_id)
        except ClusterAPIError as exc:
            log.warning("could not deregister from the control plane: %s", exc)
            return False
        self.registered = False
        log.info("deregistered node %s", self.node_id)
        return True

    async def close(self) -> None:
        await self._stop_loop()
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _stop_loop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        at_once = False
        while True:
            was_registered = self.registered
            ok = await self._report()
            # A registration is followed by a heartbeat at once, not after the registration's
            # interval: its ack tells the interval a large fleet is paced at (and the first
            # heartbeat takes the full path anyway, to sync the weights). Without it 10,000
            # nodes registering heartbeat every 2 s until their first ack (issue 34). Once
            # only: a node the control plane keeps forgetting does not spin.
            at_once = ok and not was_registered and not at_once
            if at_once:
                delay = 0.0
            elif ok:
                delay = self.heartbeat_interval_s
            elif self._retry_after_s is not None:
                # The control plane said when: a turn it gave this node (admission control,
                # control_plane.registration_gate). Not before it, which would be refused again
                # and queue behind the rest; a little after, so that the nodes given the same
                # second do not arrive in the same millisecond.
                delay = self._retry_after_s * self._rng.uniform(1.0, 1.2)
            else:
                backoff = min(self._retry_max_s, self._retry_base_s * 2 ** (self._failures - 1))
                # Jitter keeps a fleet of nodes from retrying in lockstep after an outage.
                delay = backoff * self._rng.uniform(0.5, 1.0)
            self._wake.clear()
            await wait_at_most(self._clock, delay, self._wake.wait())

    async def _report(self) -> bool:
        async with self._send_lock:
            try:
                if not self.registered:
                    await self._register()
                elif not await self._heartbeat():
                    log.info("control plane does not know node %s; re-registering", self.node_id)
                    self.registered = False
                    await self._register()
            except ClusterAPIError as exc:
                self._failures += 1
                self._retry_after_s = exc.retry_after_s
                if self._retry_after_s is not None:
                    log.info("control plane busy, reporting again in about %.0f s: %s", self._retry_after_s, exc)
                elif self._failures == 1:
                    log.warning("control plane unreachable, still serving: %s", exc)
                else:
                    log.debug("control plane still unreachable (%d): %s", self._failures, exc)
                return False
            if self._failures:
                log.info("control plane reachable again after %d failures", self._failures)
            self._failures = 0
            return True

    async def _register(self) -> None:
        assert self._client is not None
        body = self._registration.model_copy(update={"status": self._status()})
        ack = await self._client.register(body)
        self.heartbeat_interval_s = ack.heartbeat_interval_s
        self.registered = True
        self._first_registration.set()
        log.info("registered node %s as %s", self.node_id, body.status)

    async def _heartbeat(self) -> bool:
        """Send one heartbeat; False when the control plane no longer knows this node."""
        assert self._client is not None
        beat = NodeHeartbeat(
            status=self._status(), load=self._load(), models=self._models,
            weights=self._weights() if self._weights is not None else None,
            cold_start=self._cold_start() if self._cold_start is not None else None,
        )
        ack = await self._client.heartbeat(self.node_id, beat)
        if ack is None:
            return False
        if ack.heartbeat_interval_s is not None:
            # The control plane paces a large fleet by lengthening the interval; its reaper
            # holds this node to the TTL of the interval it last told it.
            self.heartbeat_interval_s = ack.heartbeat_interval_s
        self.heartbeats_sent += 1
        return True
