"""Starts and stops the fleet loops of a control plane: leader election, reconciler, autoscaler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from control_plane.autoscaler import Autoscaler, run_autoscaler
from control_plane.context import AppContext
from control_plane.leader import LeaderElector, make_elector
from control_plane.reconciler import Reconciler, default_drivers, run_reconciler

log = logging.getLogger(__name__)

# The elector may need a database round trip to release leadership on the way out.
_STOP_TIMEOUT_S = 10.0


@asynccontextmanager
async def fleet_loops(ctx: AppContext) -> AsyncIterator[LeaderElector | None]:
    """Run the elector and the enabled loops for the duration of the block; yields the elector
    (None when both the reconciler and the autoscaler are disabled)."""
    settings = ctx.settings
    if not (settings.reconciler_enabled or settings.autoscaler_enabled):
        yield None
        return
    elector = make_elector(ctx)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(elector.run(stop), name="meridian-leader")]
    if settings.reconciler_enabled:
        drivers = await asyncio.to_thread(default_drivers, settings.onprem_inventory)
        reconciler = Reconciler(ctx, drivers)
        tasks.append(asyncio.create_task(run_reconciler(ctx, elector, reconciler, stop), name="meridian-reconciler"))
    if settings.autoscaler_enabled:
        tasks.append(asyncio.create_task(run_autoscaler(ctx, elector, Autoscaler(ctx), stop), name="meridian-autoscaler"))
    try:
        yield elector
    finally:
        stop.set()
        done, pending = await asyncio.wait(tasks, timeout=_STOP_TIMEOUT_S)
        for task in pending:
            log.warning("%s did not stop in %.0fs; cancelling it", task.get_name(), _STOP_TIMEOUT_S)
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s failed", task.get_name(), exc_info=task.exception())
