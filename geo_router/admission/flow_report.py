"""Flow control's backlog, told to the control plane (`PUT /v1/routers/{id}/backlog`).

Flow control holds the backlog at the router so that nodes' queues stay short; the nodes'
heartbeats, which the autoscaler scales on, then show a saturated deployment as exactly
full. So while requests wait, every `flow_backlog_report_s` the router reports what it holds
per (zone, model) pool, and once more when nothing waits any more (the control plane's view
empties then, not a TTL later). The control plane counts a report for
`router_backlog_ttl_s`: a router that stops (killed, cut off) stops counting on its own.

A report is one small PUT with the cluster API's timeout; a failure is counted and logged
(once per run of failures) and the next report goes at the next interval: the report is a
level, not a delta, so a lost one costs one interval of staleness and nothing else. Each
worker of a router is a router here (its own flow control, its own name).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
from collections.abc import Callable

from meridian.clock import Clock
from meridian.cluster_client import ClusterAPIError, ClusterClient
from meridian.contracts import MAX_BACKLOG_POOLS, PoolBacklog, RouterBacklog
from meridian.settings.router import RouterSettings

from .flow_control import FlowControl, PoolKey

log = logging.getLogger(__name__)

def default_router_id(settings: RouterSettings) -> str:
    """`settings.router_id`, else "<hostname>:<port>:<pid>": unique per worker process, and a
    restarted router is a new one (the old name's report lapses with its TTL)."""
    if settings.router_id:
        return settings.router_id
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).strip("-._") or "router"
    return f"{host[:100]}:{settings.port}:{os.getpid()}"


def backlog_report(held: dict[PoolKey, int]) -> RouterBacklog:
    """The report of `held` (requests waiting per pool), the largest pools first when there
    are more than a report holds."""
    biggest = sorted(held.items(), key=lambda item: -item[1])[:MAX_BACKLOG_POOLS]
    return RouterBacklog(pools=[PoolBacklog(zone=zone, model=model, waiting=n) for (zone, model), n in biggest])


class BacklogReporter:
    """Reports `flow.held()` every interval while it is not empty, and once when it empties;
    between backlogs it waits on flow control, not on a timer."""

    def __init__(self, settings: RouterSettings, cluster: ClusterClient, flow: FlowControl,
                 count: Callable[[str], None], clock: Clock) -> None:
        """`count` is told each report's outcome ("ok" or "error")."""
        self._interval_s = settings.flow_backlog_report_s
        self._router_id = default_router_id(settings)
        self._cluster = cluster
        self._flow = flow
        self._count = count
        self._clock = clock
        self._told_empty = True  # the control plane knows nothing of this router yet
        self._failing = False
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._interval_s > 0 and self._flow.enabled:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="flow-backlog-report")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self._cluster.aclose()

    async def report_once(self) -> bool:
        """Send the backlog if there is one, or if the last report sent was not empty; True
        when a report went and was taken."""
        held = self._flow.held()
        if not held and self._told_empty:
            return False
        try:
            await self._cluster.router_backlog(self._router_id, backlog_report(held))
        except ClusterAPIError as exc:
            self._count("error")
            if not self._failing:
                log.warning("the control plane did not take this router's backlog report (%s); "
                            "reporting again every %.1f s", exc, self._interval_s)
            self._failing = True
            return False
        self._count("ok")
        self._failing = False
        self._told_empty = not held
        return True

    async def _run(self) -> None:
        while True:
            if self._told_empty:
                await self._flow.backlogged()  # an idle router wakes for nothing
            await self._clock.sleep(self._interval_s)
            await self.report_once()
