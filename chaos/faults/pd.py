"""Prefill/decode workers killed in turn: a region's busiest prefill worker (SIGKILL) as the
fault starts, its busiest decode worker `decode_after_s` later; both restart at the end.

What must hold (the drill's pass criteria and `pd_served_disaggregated`):
- a prefill worker lost mid-prefill costs nothing: the router prefills on another worker of
  the pool, or lets the decode worker prefill (co-located) when the pool is empty;
- a decode worker lost before its first token is replaced by another with a fresh prefill,
  and a stream it was answering resumes on another replica (stream migration);
- the region goes on serving disaggregated with one worker of each pool down (the routers'
  `meridian_router_pd_requests` counted `disaggregated` before the first kill, and more by
  the end of the fault window).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Mapping

from chaos.drill import Fault, Target
from chaos.environment import DrillEnvironment, InjectionError
from chaos.history import History
from chaos.observe import busiest
from localfabric import Proc
from meridian.contracts import NodeRole

_DISAGGREGATED = "meridian_router_pd_requests"


class PDWorkerCrash:
    """See the module doc."""

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        self._fault, self._env = fault, env
        self._victims: list[Proc] = []
        self._second: asyncio.Task[None] | None = None
        self._before = 0.0
        self._at_heal: float | None = None

    async def inject(self) -> None:
        self._before = await self._disaggregated()
        if self._before <= 0:
            raise InjectionError("no request was served disaggregated before the fault: is the "
                                 "target region's topology prefill/decode?")
        await self._kill(NodeRole.PREFILL, "meridian_router_pd_prefills")
        after = self._fault.params.get("decode_after_s")
        delay = float(after) if isinstance(after, int | float) else (self._fault.end_s - self._fault.start_s) / 2
        self._second = asyncio.create_task(self._later(delay))

    async def _later(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        await self._kill(NodeRole.DECODE, "meridian_router_requests")

    async def _kill(self, role: NodeRole, served_metric: str) -> None:
        found = await self._env.nodes(Target(**{**self._fault.target.model_dump(), "role": role, "node": None}))
        counts = await self._env.routers.by_node(served_metric)
        victim = busiest(found, lambda p: p.node_id or "", counts, self._env.seed)
        self._env.event("pd", f"killing {role.value} worker {victim.name}")
        await self._env.signal([victim], signal.SIGKILL, reap=True)
        self._victims.append(victim)

    async def heal(self) -> None:
        self._at_heal = await self._disaggregated()
        if self._second is not None:
            self._second.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._second
        victims, self._victims = self._victims, []
        if victims:
            await self._env.restart(victims)

    async def observe(self, history: History) -> Mapping[str, bool]:
        during = self._at_heal is not None and self._at_heal > self._before
        return {"pd_served_disaggregated": self._before > 0 and during}

    async def _disaggregated(self) -> float:
        return await self._env.routers.metric(_DISAGGREGATED, how="disaggregated")
