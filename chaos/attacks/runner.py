"""Run one attack against a fresh fabric while a neighbour is timed and the target's memory
is watched; the suite is every attack in turn.

Contract: `run_attack(attack, form, work_dir)` starts a control plane and a router
(chaos.attacks.target), starts the neighbour (chaos.attacks.neighbour) on the attacked
process, times it alone for `form.idle_s` (its idle p50/p99), reads the idle RSS and resets
the process's peak, runs the attack, and measures the neighbour over the attack's whole
window (`attack.seconds(form)`, even when cut off sooner: a server still working off what it
took is still under attack) and the RSS peak (VmHWM, and samples every RSS_EVERY_S where the
peak cannot be reset), then, with the attack's connections closed, waits `form.settle_s` and
reads the RSS "after". Everything runs on loopback, one attack at a time.

The neighbour asks the router for `/health` and, with its own key, `/v1/models` (a keyed
request through the tenant table, the cheapest one without a node); the control plane for
`/health`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from chaos.attacks.form import Attack, Form
from chaos.attacks.neighbour import Neighbour, Probe, window
from chaos.attacks.result import AttackResult, Bounds
from chaos.attacks.target import AttackFabric, attack_fabric, reset_peak, rss_mib

RSS_EVERY_S = 0.05


def probes(fabric: AttackFabric, target: str) -> list[Probe]:
    if target == fabric.router.name:
        return [Probe("/health"), Probe("/v1/models", (("authorization", f"Bearer {fabric.tenant_key}"),))]
    return [Probe("/health")]


@contextlib.asynccontextmanager
async def _peak_watch(pid: int) -> AsyncIterator[list[float]]:
    """Samples the process's RSS while inside; yields [highest so far]."""
    peak = [rss_mib(pid)]

    async def sample() -> None:
        while True:
            with contextlib.suppress(OSError, LookupError):
                peak[0] = max(peak[0], rss_mib(pid))
            await asyncio.sleep(RSS_EVERY_S)

    task = asyncio.create_task(sample())
    try:
        yield peak
    finally:
        task.cancel()


async def run_attack(attack: Attack, form: Form, work_dir: Path) -> AttackResult:
    with attack_fabric(work_dir, attack.router_env) as fabric:
        listener = fabric.listener(attack.target)
        with Neighbour(listener, probes(fabric, attack.target)) as neighbour:
            idle_from = time.monotonic()
            await asyncio.sleep(form.idle_s)
            rss_idle = rss_mib(listener.pid)
            hwm_reset = reset_peak(listener.pid)
            start = time.monotonic()
            async with _peak_watch(listener.pid) as sampled:
                outcome = await attack.run(fabric, form)
                await asyncio.sleep(max(0.0, start + attack.seconds(form) - time.monotonic()))
                end = time.monotonic()
                peak = max(sampled[0], rss_mib(listener.pid, "VmHWM") if hwm_reset else 0.0)
            await asyncio.sleep(form.settle_s)
            rss_after = rss_mib(listener.pid)
        idle, during = window(neighbour.samples, idle_from, start), window(neighbour.samples, start, end)
    return AttackResult(
        attack=attack.name, target=attack.target, form=form.name, outcome=outcome,
        bounds=Bounds(cut_off_s=attack.cut_off_bound_s),
        idle_p50_ms=idle.p50_ms, idle_p99_ms=idle.p99_ms,
        neighbour_p50_ms=during.p50_ms, neighbour_p99_ms=during.p99_ms,
        neighbour_requests=during.requests, neighbour_failed=during.failed,
        rss_idle_mib=rss_idle, rss_peak_mib=peak, rss_after_mib=rss_after,
    )


async def run_suite(attacks: Sequence[Attack], form: Form, work_dir: Path) -> list[AttackResult]:
    """Each attack in turn, each against a fabric of its own (under work_dir/<attack>-<target>)."""
    return [await run_attack(a, form, work_dir / f"{a.name}-{a.target}") for a in attacks]
