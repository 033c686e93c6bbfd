"""The timeline every drill run follows, wherever the fabric runs (started locally or a
deployment): drive the load, inject and heal the fault on time, watch the abort conditions;
then check the joined history and write the report."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from chaos.checker import check
from chaos.drill import Drill, Fault
from chaos.faults.injector import Injector
from chaos.heap import frozen_heap
from chaos.history import History
from chaos.load import LoadGenerator, LoadStats
from chaos.report import ReportFiles, RunReport, write_report
from chaos.timeline import FaultEvent, Timeline

_MONITOR_INTERVAL_S = 0.25

log = logging.getLogger(__name__)


class InjectionFailed(RuntimeError):
    """The fault could not be injected or healed; the run aborts with this reason."""


@dataclass
class FaultState:
    """What happened to the fault during a run."""

    injector: Injector | None = None
    injected_at: float | None = None
    healed_at: float | None = None
    aborted: str | None = None
    not_checked: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunOutcome:
    """A finished run: its report and the files written."""

    report: RunReport
    files: ReportFiles

    @property
    def passed(self) -> bool:
        return self.report.passed


TickCallback = Callable[[float, float, LoadStats], None]  # (now_s, duration_s, stats)
EventCallback = Callable[[FaultEvent], None]


async def drive(
    drill: Drill,
    generator: LoadGenerator,
    env: Timeline,
    state: FaultState,
    create_injector: Callable[[Fault], Injector],
    *,
    injection_errors: tuple[type[BaseException], ...],
    on_tick: TickCallback | None = None,
) -> None:
    """Run the load with the fault on its schedule; `state` records what happened.

    An error of `injection_errors` from the injector, or an abort condition, stops the load
    early; whatever happened, the fault is healed before this returns.
    """
    # The harness must not pause while the load runs (chaos.heap): the heap that exists
    # now, the whole test session's when pytest runs drills, is left out of collections.
    with frozen_heap():
        env.clock_start = time.monotonic()
        load = asyncio.create_task(generator.run(env.clock_start), name="chaos-load")
        fault = asyncio.create_task(_fault(drill.fault, env, state, create_injector, injection_errors),
                                    name="chaos-fault")
        duration = drill.load.duration_s
        try:
            while not load.done():
                await asyncio.sleep(_MONITOR_INTERVAL_S)
                now = env.now_s()
                if on_tick is not None:
                    on_tick(now, duration, generator.stats)
                reason = abort_reason(drill, generator.stats, now) if state.aborted is None else None
                if reason is not None:
                    state.aborted = reason
                    env.event("abort", reason)
                    generator.stop()
                    fault.cancel()
                if fault.done() and not fault.cancelled() and fault.exception() is not None:
                    state.aborted = state.aborted or f"the fault injector failed: {fault.exception()}"
                    env.event("abort", state.aborted)
                    generator.stop()
            await load
        finally:
            if not fault.done():
                fault.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await fault
            # Whatever happened, leave the fabric healed before it is observed and stopped.
            if state.injector is not None and state.injected_at is not None and state.healed_at is None:
                state.healed_at = env.now_s()
                with contextlib.suppress(Exception):
                    await state.injector.heal()


async def _fault(
    f: Fault,
    env: Timeline,
    state: FaultState,
    create_injector: Callable[[Fault], Injector],
    injection_errors: tuple[type[BaseException], ...],
) -> None:
    await _sleep_until(env, f.start_s)
    try:
        state.injector = create_injector(f)
        state.injected_at = env.now_s()
        env.event("inject", f"{f.kind} on {f.target.model_dump(exclude_none=True)}")
        await state.injector.inject()
    except injection_errors as exc:
        raise InjectionFailed(f"injecting {f.kind} failed: {exc}") from exc
    await _sleep_until(env, f.end_s)
    # The fault ends when healing starts; a restart's cold start is part of the recovery.
    state.healed_at = env.now_s()
    env.event("heal", f"healing {f.kind}")
    try:
        await state.injector.heal()
    except injection_errors as exc:
        raise InjectionFailed(f"healing {f.kind} failed: {exc}") from exc


def abort_reason(drill: Drill, stats: LoadStats, now_s: float) -> str | None:
    """Why the run must stop now (an abort condition holds), None while it may go on."""
    for cond in drill.abort:
        if now_s < cond.for_s:
            continue
        rate = stats.recent_error_rate(cond.for_s, now_s)
        if rate is not None and rate > cond.error_rate_above:
            return (f"error rate {rate:.0%} over the last {cond.for_s:g}s exceeded the abort "
                    f"threshold {cond.error_rate_above:.0%}")
    return None


def finish(
    drill: Drill,
    *,
    short: bool,
    started_at: datetime,
    history: History,
    region_zones: Mapping[str, list[str]],
    env: Timeline,
    state: FaultState,
    invariants: Mapping[str, bool],
    out_dir: Path,
) -> RunOutcome:
    """Check the history against the drill's pass criteria and write the report."""
    fault_start = state.injected_at if state.injected_at is not None else drill.fault.start_s
    fault_end = state.healed_at if state.healed_at is not None else drill.fault.end_s
    result = check(history, drill, region_zones, fault_start_s=fault_start, fault_end_s=fault_end)
    # An aborted run never passes (RunReport.passed), however its partial history looks.
    verdict = result.verdict(drill, invariants)
    report = RunReport(
        drill=drill, short=short, started_at=started_at,
        duration_s=drill.load.duration_s, fault_start_s=fault_start, fault_end_s=fault_end,
        events=tuple(env.events), result=result, verdict=verdict, invariants=dict(invariants),
        aborted=state.aborted, not_checked=tuple(state.not_checked),
    )
    return RunOutcome(report=report, files=write_report(report, history, out_dir))


async def _sleep_until(env: Timeline, at_s: float) -> None:
    delay = at_s - env.now_s()
    if delay > 0:
        await asyncio.sleep(delay)
