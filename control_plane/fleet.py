"""Starts and stops the fleet loops of a control plane: leader election, reconciler, autoscaler."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from control_plane.autoscaler import Autoscaler
from control_plane.context import AppContext
from control_plane.leader import Deposed, Fence, LeaderElector, make_elector
from control_plane.metrics import ControlPlaneMetrics
from control_plane.reconciler import Reconciler, default_drivers
from meridian.backoff import Backoff
from meridian.clock import Clock, event_or_timeout
from providers.provider import PROVIDERS

log = logging.getLogger(__name__)

# The elector may need a database round trip to release leadership on the way out.
_STOP_TIMEOUT_S = 10.0


async def run_while_leading(
    name: str,
    interval_s: float,
    elector: LeaderElector,
    tick: Callable[[Fence], Awaitable[Any]],
    stop: asyncio.Event,
    clock: Clock,
) -> None:
    """Call `tick` every interval_s of `clock` while this replica leads, until `stop`.

    A failing pass is logged and retried with backoff; the loop never dies of it.
    """
    backoff = Backoff(base_s=interval_s, max_s=max(interval_s, 60.0))
    failures = 0
    while not stop.is_set():
        delay = interval_s if failures == 0 else backoff.delay(failures)
        if await event_or_timeout(clock, stop, delay):
            return
        fence = elector.fence()
        if fence is None:
            continue
        try:
            await tick(fence)
            failures = 0
        except Deposed as e:
            log.info("%s stopped acting: %s", name, e)
        except Exception:
            failures += 1
            log.exception("%s pass failed; retrying", name)


@asynccontextmanager
async def fleet_loops(ctx: AppContext, metrics: ControlPlaneMetrics | None = None) -> AsyncIterator[LeaderElector | None]:
    """Run the elector and the enabled loops for the duration of the block; yields the elector
    (None when both the reconciler and the autoscaler are disabled). With `metrics`, the
    loops' passes are counted in it."""
    metrics = metrics or ControlPlaneMetrics()
    settings = ctx.settings
    if not (settings.reconciler_enabled or settings.autoscaler_enabled):
        yield None
        return
    elector = make_elector(ctx)
    stop = asyncio.Event()
    tasks = [asyncio.create_task(elector.run(stop), name="meridian-leader")]
    if settings.reconciler_enabled:
        # The process-wide registry, so that a provider registered in this process has its driver.
        drivers = await asyncio.to_thread(
            default_drivers, settings.onprem_inventory, ctx.provider_settings, providers=PROVIDERS, clock=ctx.clock
        )
        loop = run_while_leading(
            "reconciler", settings.reconcile_interval_s, elector,
            metrics.observe_reconciler(Reconciler(ctx, drivers).tick), stop, ctx.clock,
        )
        tasks.append(asyncio.create_task(loop, name="meridian-reconciler"))
    if settings.autoscaler_enabled:
        loop = run_while_leading(
            "autoscaler", settings.autoscale_interval_s, elector,
            metrics.observe_autoscaler(Autoscaler(ctx).tick), stop, ctx.clock,
        )
        tasks.append(asyncio.create_task(loop, name="meridian-autoscaler"))
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
