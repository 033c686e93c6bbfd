"""What one node process runs, and the order it starts, drains and stops in:
engine, serving phase and (when a control plane is configured) the agent."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from data_plane.agent import NodeAgent, default_node_id, torch_kv_transfer
from data_plane.engine.base import CapableEngine, Engine, KVTransferEngine, PassthroughEngine
from data_plane.kv_events import ZmqEventPublisher, create_publisher
from data_plane.lifecycle import NodeLifecycle
from data_plane.weights.node_weights import NodeWeights
from meridian.clock import SYSTEM_CLOCK, Clock, wait_at_most
from meridian.contracts import ColdStart, KVTransferInfo, NodeLoad
from meridian.settings.node import NodeSettings

log = logging.getLogger(__name__)


class NodeRuntime:
    """Engine + lifecycle + agent of one node.

    `on_fatal` is called if the model fails to load in the background, so that the
    process hosting the app can exit instead of idling as "failed".
    """

    def __init__(
        self, settings: NodeSettings, engine: Engine, agent: NodeAgent | None = None,
        *, clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.settings = settings
        # The node's one clock: the cold-start timeline, the drain timeout, the agent's waits.
        self.clock = clock
        self.engine = engine
        self.lifecycle = NodeLifecycle()
        self.on_fatal: Callable[[BaseException], None] | None = None
        # Requests completed and their summed latency, reported with the load (the server's
        # metrics set it; None: not measured here).
        self.request_totals: Callable[[], tuple[int, float] | None] = lambda: None
        self.load_error: BaseException | None = None
        self._loading: asyncio.Task[None] | None = None
        # With model_uri, the model is pulled into the weight cache before the engine loads.
        self.weights = (
            NodeWeights(settings, node_id=default_node_id(settings), clock=clock) if settings.model_uri else None
        )
        # Seconds from start() to each step: the node's cold-start timeline.
        self.cold_start = ColdStart()
        self._started_at: float | None = None
        if agent is None and settings.control_plane_url:
            agent = NodeAgent(
                settings,
                models=engine.models(),
                status=lambda: self.lifecycle.node_status,
                load=self.load,
                weights=(lambda: list(self.weights.digests)) if self.weights is not None else None,
                cold_start=lambda: self.cold_start,
                # Routers resume a broken tool-call stream only where they can replay its parser.
                tool_call_parser=engine.tool_call_parser() if isinstance(engine, PassthroughEngine) else None,
                # Where a prefill/decode node's KV is pulled from: vLLM's NIXL side channel, or
                # the torch node's own listener.
                kv_transfer=_kv_transfer(engine, settings),
                # What routers shape their requests to this node by (never its engine's name).
                capabilities=engine.capabilities() if isinstance(engine, CapableEngine) else (),
                max_num_seqs=engine.max_num_seqs() if isinstance(engine, CapableEngine) else None,
                clock=clock,
            )
        self.agent = agent
        self._drain: asyncio.Task[None] | None = None
        # Created with the engine's load (binding is a side effect the app's constructor
        # should not have), closed after the engine stops so its last events go out.
        self.kv_events: ZmqEventPublisher | None = None

    def load(self) -> NodeLoad:
        s = self.engine.stats()
        totals = self.request_totals()
        return NodeLoad(
            running=s.running, waiting=s.waiting, kv_cache_usage=min(1.0, max(0.0, s.kv_cache_usage)),
            lora_adapters=list(s.loaded_loras),
            waiting_prompt_tokens=s.waiting_prompt_tokens,
            requests_completed=totals[0] if totals else None,
            latency_s_sum=totals[1] if totals else None,
        )

    async def start(self) -> None:
        """Register as starting and begin loading the model in the background.

        The HTTP server is up meanwhile, answering /health with 503 "loading", so
        orchestrators and routers can tell a loading node from a dead one.
        """
        if self._started_at is None:
            self._started_at = self.clock.monotonic()
        if self.weights is not None:
            await self.weights.scan()
        if self.agent is not None:
            await self.agent.start()
        if self._loading is None:
            self._loading = asyncio.ensure_future(self._load())

    async def wait_ready(self) -> None:
        """Wait for the background load; raises its error if it failed."""
        if self._loading is not None:
            await asyncio.shield(self._loading)
        if self.load_error is not None:
            raise self.load_error

    def _step(self, **update: object) -> None:
        now = self.clock.monotonic()
        since = now - (self._started_at or now)
        self.cold_start = self.cold_start.model_copy(update={k: since if v is None else v for k, v in update.items()})

    async def _load(self) -> None:
        try:
            if self.weights is not None:
                if self.agent is not None:
                    # Peers are found through the control plane, which answers only
                    # registered nodes; without it the pull goes to the origin.
                    await self.agent.wait_registered(self.settings.control_plane_timeout_s)
                report = await self.weights.prepare()
                self._step(weights_cached_s=None, weights_source=report.source, fetched_bytes=report.fetched_bytes)
                if self.agent is not None:
                    self.agent.notify()  # peers may fetch from this node now
            if self.settings.kv_events_endpoint and self.kv_events is None:
                self.kv_events = await asyncio.to_thread(create_publisher, self.settings, clock=self.clock)
                self.engine.set_kv_event_sink(self.kv_events)
            await self.engine.start()
            self._step(loaded_s=None)
        except Exception as exc:
            log.exception("the model failed to load")
            self.load_error = exc
            self.lifecycle.mark_failed()
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        if hasattr(self.engine, "on_fatal"):
            # Engines that supervise a child (vLLM) report when it cannot be kept alive.
            self.engine.on_fatal = self._engine_failed
        self.lifecycle.mark_ready()
        self._step(ready_s=None)
        if self.agent is not None:
            self.agent.notify()
        log.info("node ready in %.2fs, serving %s", self.cold_start.ready_s or 0.0, ", ".join(self.engine.models()))

    def _engine_failed(self, exc: BaseException) -> None:
        log.error("the engine failed for good: %s", exc)
        self.load_error = exc
        self.lifecycle.mark_failed()
        if self.on_fatal is not None:
            self.on_fatal(exc)

    async def drain(self) -> None:
        """Refuse new requests, report draining, let in-flight requests finish (up to
        drain_timeout_s), then leave the control plane. Safe to call more than once."""
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._do_drain())
        await asyncio.shield(self._drain)

    @property
    def draining(self) -> bool:
        return self._drain is not None

    async def _do_drain(self) -> None:
        self.lifecycle.begin_drain()
        if self.agent is not None:
            await self.agent.report_now()
        in_flight = self.lifecycle.in_flight
        if in_flight:
            log.info("draining: waiting for %d in-flight requests", in_flight)
        if not await wait_at_most(self.clock, self.settings.drain_timeout_s, self.lifecycle.wait_idle()):
            log.warning(
                "drain timeout (%.0fs): %d requests still in flight will be aborted",
                self.settings.drain_timeout_s, self.lifecycle.in_flight,
            )
        if self.agent is not None:
            await self.agent.leave()

    async def shutdown(self) -> None:
        loading, self._loading = self._loading, None
        if loading is not None and not loading.done():
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loading
        await self.drain()
        if self.agent is not None:
            await self.agent.close()
        await self.engine.stop()
        kv_events, self.kv_events = self.kv_events, None
        if kv_events is not None:
            await asyncio.to_thread(kv_events.close)
        if self.weights is not None:
            await self.weights.aclose()
        self.lifecycle.mark_stopped()


def _kv_transfer(engine: Engine, settings: NodeSettings) -> KVTransferInfo | None:
    if isinstance(engine, KVTransferEngine):
        return engine.kv_transfer()
    return None if isinstance(engine, PassthroughEngine) else torch_kv_transfer(settings)
