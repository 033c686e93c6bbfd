"""Faults that strike long streams mid-generation: SIGKILL (`mid_stream_crash`) or SIGSTOP
(`mid_stream_hang`, a gray failure) the nodes serving them.

The victims are every live node the target matches (a region: e.g. the one nearest to the
load, where most streams run) plus, with `also_region`, the node of that region serving
the most long streams still in flight (the client's x-meridian-node), so that streams of
a zone with replicas to spare have somewhere to go and streams of a zone without have not.
The signal is sent once every long stream of the burst is under way (`min_events` events
received, or ended) or after `wait_s`: a stream killed before its first byte is a plain
failover, one killed after its end is no test at all. Healing restarts (crash) or SIGCONTs
(hang) the victims at the fault's end.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping

from chaos.drill import Fault
from chaos.environment import DrillEnvironment, InjectionError
from chaos.history import History
from localfabric import Proc

DEFAULT_MIN_EVENTS = 10
DEFAULT_WAIT_S = 30.0


def pick_victims(region_nodes: list[Proc], also_region: str | None, live: list[Proc],
                 streams_by_node: Mapping[str, int]) -> list[Proc]:
    """The target's nodes plus the busiest (by long streams in flight, then name) other live
    node of `also_region`; InjectionError when that region has none left."""
    victims = list(region_nodes)
    if also_region is not None:
        taken = {p.node_id for p in victims}
        others = [p for p in live if p.region == also_region and p.node_id not in taken]
        if not others:
            raise InjectionError(f"no other live node in {also_region} to stop besides the target's")
        victims.append(max(others, key=lambda p: (streams_by_node.get(p.node_id or "", 0), p.name)))
    return victims


class _MidStream:
    _SIGNAL: signal.Signals

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        if env.streams is None:
            raise InjectionError(f"{fault.kind} needs the load's long_streams (nothing to strike mid-stream)")
        self._fault, self._env = fault, env
        also = fault.params.get("also_region")
        self._also = str(also) if also is not None else None
        self._min_events = int(fault.params.get("min_events", DEFAULT_MIN_EVENTS))
        self._wait_s = float(fault.params.get("wait_s", DEFAULT_WAIT_S))
        self._victims: list[Proc] = []

    async def inject(self) -> None:
        tracker = self._env.streams
        assert tracker is not None
        if not await tracker.wait_under_way(self._min_events, self._wait_s):
            self._env.event("late", f"not every long stream had {self._min_events} events after {self._wait_s:g}s")
        by_node = tracker.in_flight_by_node()
        self._victims = pick_victims(await self._env.nodes(self._fault.target), self._also,
                                     self._env.live_nodes(), by_node)
        serving = ", ".join(f"{p.name}: {by_node.get(p.node_id or '', 0)}" for p in self._victims)
        self._env.event("streams", f"long streams in flight by victim: {serving}")
        await self._env.signal(self._victims, self._SIGNAL, reap=self._SIGNAL is signal.SIGKILL)

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {}


class MidStreamCrash(_MidStream):
    """SIGKILL the nodes serving long streams mid-generation; restart them at the end."""

    _SIGNAL = signal.SIGKILL

    async def heal(self) -> None:
        victims, self._victims = self._victims, []
        if victims:
            await self._env.restart(victims)


class MidStreamHang(_MidStream):
    """SIGSTOP the nodes serving long streams mid-generation (they keep their sockets open
    and send nothing: only the router's inter-token timeout reveals them); SIGCONT at the end."""

    _SIGNAL = signal.SIGSTOP

    async def heal(self) -> None:
        victims, self._victims = self._victims, []
        if victims:
            await self._env.signal(victims, signal.SIGCONT, reap=False)
