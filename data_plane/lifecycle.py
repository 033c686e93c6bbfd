"""A node's serving phase and its count of in-flight requests, which drain waits on."""

from __future__ import annotations

import asyncio
from enum import StrEnum

from meridian.contracts import NodeStatus


class Phase(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


_STATUS = {
    Phase.LOADING: NodeStatus.STARTING,
    Phase.READY: NodeStatus.READY,
    Phase.DRAINING: NodeStatus.DRAINING,
    Phase.STOPPED: NodeStatus.DRAINING,
    # Never routable; the process exits and deregisters.
    Phase.FAILED: NodeStatus.STARTING,
}


class NodeLifecycle:
    """loading → ready → draining → stopped (or loading → failed); only a ready node
    accepts requests."""

    def __init__(self) -> None:
        self.phase = Phase.LOADING
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def accepting(self) -> bool:
        return self.phase is Phase.READY

    @property
    def node_status(self) -> NodeStatus:
        """The phase as the control plane's NodeStatus."""
        return _STATUS[self.phase]

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def mark_ready(self) -> None:
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY

    def begin_drain(self) -> None:
        if self.phase in (Phase.LOADING, Phase.READY):
            self.phase = Phase.DRAINING

    def mark_stopped(self) -> None:
        self.phase = Phase.STOPPED

    def mark_failed(self) -> None:
        self.phase = Phase.FAILED

    def request_started(self) -> None:
        self._in_flight += 1
        self._idle.clear()

    def request_finished(self) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        if self._in_flight == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no request is in flight."""
        await self._idle.wait()
