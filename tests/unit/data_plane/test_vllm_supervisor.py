"""Supervising `vllm serve` (the stand-in in vllm_standin.py): readiness, restarts with
backoff, giving up, liveness, and stopping the whole process group.

The supervisor's backoffs, restart window, startup timeout and stop grace run on a
ManualClock that the tests move; the child and its probes run on real time."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_testkit import advance_until_done, eventually

from data_plane.engine.vllm.supervisor import ChildState, RestartPolicy, VllmFailedError, VllmSupervisor
from meridian.clock import ManualClock
from meridian.ports import free_port

STANDIN = Path(__file__).with_name("vllm_standin.py")
FAST_RESTARTS = RestartPolicy(max_restarts=3, window_s=60.0, backoff_s=0.05, backoff_max_s=0.2)


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def supervisor(state: Path, env: dict[str, str] | None = None, **options: Any) -> VllmSupervisor:
    """A supervisor of the stand-in, on a ManualClock unless `clock` is given."""
    port = free_port()
    argv = [sys.executable, str(STANDIN), "serve", str(state), "--served-model-name", "m",
            "--host", "127.0.0.1", "--port", str(port)]
    options.setdefault("policy", FAST_RESTARTS)
    options.setdefault("probe_interval_s", 0.05)
    options.setdefault("stop_grace_s", 5.0)
    options.setdefault("clock", ManualClock())
    return VllmSupervisor(
        argv, base_url=f"http://127.0.0.1:{port}", served_model_name="m",
        env={"MERIDIAN_STANDIN_STATE_DIR": str(state), **(env or {})}, **options,
    )


def longest_backoff(sup: VllmSupervisor) -> float:
    return sup.policy.backoff_max_s * (1 + sup.policy.jitter)


async def pass_backoff(clock: ManualClock, sup: VllmSupervisor, seconds: float | None = None) -> None:
    """Wait until the supervisor backs off before a restart, then move its clock past it
    (by `seconds` when given)."""
    await eventually(lambda: clock.sleepers > 0, within=10)
    assert sup.state is ChildState.BACKOFF
    clock.advance(longest_backoff(sup) if seconds is None else seconds)


def starts(state: Path) -> int:
    counter = state / "starts"
    return int(counter.read_text()) if counter.exists() else 0


def pid_of(state: Path, start: int) -> int:
    return int((state / f"pid-{start}").read_text())


async def test_start_returns_once_vllm_serves_the_model(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="data_plane.engine.vllm.child")
    gate = tmp_path / "loaded"
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_WAIT_FILE": str(gate)})
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: starts(tmp_path) == 1)
    # The process runs but is still "loading the model": not ready.
    assert not starting.done() and sup.state is ChildState.STARTING
    gate.touch()
    await starting
    assert sup.state is ChildState.READY and sup.pid == pid_of(tmp_path, 1)
    async with httpx.AsyncClient(base_url=sup.base_url) as client:
        assert (await client.get("/health")).status_code == 200
    # The child's output goes to our logger, line by line.
    assert any("stand-in vllm start 1" in r.getMessage() for r in caplog.records
               if r.name == "data_plane.engine.vllm.child")
    await sup.stop()
    assert sup.state is ChildState.STOPPED and not alive(pid_of(tmp_path, 1))


async def test_a_crashed_vllm_is_restarted(tmp_path: Path) -> None:
    clock = ManualClock()
    sup = supervisor(tmp_path, clock=clock)
    exits: list[tuple[int, int | None]] = []
    readies: list[int] = []
    sup.on_exit = lambda gen, rc: exits.append((gen, rc))
    sup.on_ready = readies.append
    await sup.start()
    first = sup.pid
    assert first is not None
    sup.kill()
    await pass_backoff(clock, sup)
    await eventually(lambda: sup.ready and sup.generation == 2)
    assert sup.restarts == 1
    assert exits == [(1, -9)] and readies == [1, 2]
    assert sup.pid != first and not alive(first)
    await sup.stop()
    assert exits[-1][0] == 2


async def test_failed_starts_are_retried_with_backoff(tmp_path: Path) -> None:
    clock = ManualClock()
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_FAIL_STARTS": "2"}, clock=clock)
    exits: list[int | None] = []
    sup.on_exit = lambda gen, rc: exits.append(rc)
    starting = asyncio.create_task(sup.start())
    # Each restart waits out its backoff on the clock, and only then starts again.
    assert await advance_until_done(clock, starting, longest_backoff(sup)) == 2
    await starting
    assert starts(tmp_path) == 3 and sup.restarts == 2 and exits == [1, 1]
    # Every attempt runs the same command.
    assert (tmp_path / "argv-1.json").read_text() == (tmp_path / "argv-3.json").read_text()
    await sup.stop()


async def test_gives_up_after_too_many_failures_in_the_window(tmp_path: Path) -> None:
    policy = RestartPolicy(max_restarts=2, window_s=60.0, backoff_s=0.05, backoff_max_s=0.1)
    clock = ManualClock()
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_FAIL_STARTS": "99"}, policy=policy, clock=clock)
    failures: list[BaseException] = []
    sup.on_failed = failures.append
    starting = asyncio.create_task(sup.start())
    assert await advance_until_done(clock, starting, longest_backoff(sup)) == 2
    with pytest.raises(VllmFailedError, match="failed 3 times") as raised:
        await starting
    # The error carries the child's last words.
    assert "fails on purpose" in str(raised.value)
    assert starts(tmp_path) == 3 and sup.state is ChildState.FAILED
    assert failures == [raised.value]


async def test_exits_further_apart_than_the_window_do_not_add_up(tmp_path: Path) -> None:
    policy = RestartPolicy(max_restarts=1, window_s=10.0, backoff_s=0.05, backoff_max_s=0.1)
    clock = ManualClock()
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_FAIL_STARTS": "99"}, policy=policy, clock=clock)
    starting = asyncio.create_task(sup.start())
    for _ in range(3):
        # Each exit has left the window before the next one comes.
        await pass_backoff(clock, sup, policy.window_s + 1)
    await eventually(lambda: starts(tmp_path) == 4)
    assert not starting.done() and sup.state is not ChildState.FAILED and sup.restarts == 3
    await sup.stop()
    with pytest.raises(VllmFailedError, match="stopped while starting"):
        await starting


async def test_a_vllm_that_never_gets_ready_is_killed(tmp_path: Path) -> None:
    never = tmp_path / "never"
    clock = ManualClock()
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_WAIT_FILE": str(never)}, startup_timeout_s=0.5,
                     policy=RestartPolicy(max_restarts=0), clock=clock)
    exits: list[int | None] = []
    sup.on_exit = lambda gen, rc: exits.append(rc)
    starting = asyncio.create_task(sup.start())
    await eventually(lambda: starts(tmp_path) == 1)
    assert not starting.done() and sup.state is ChildState.STARTING
    # The startup timeout passes on the supervisor's clock (moved until it has).
    await eventually(starting.done, clock=clock, step=0.5)
    with pytest.raises(VllmFailedError, match="not ready after"):
        await starting
    # Killed by the supervisor, not exited by itself.
    assert exits in ([-signal.SIGTERM], [-signal.SIGKILL])
    assert sup.pid is None


async def test_a_vllm_that_stops_answering_health_is_replaced(tmp_path: Path) -> None:
    hang = tmp_path / "hang"
    clock = ManualClock()
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_HANG_FILE": str(hang)}, probe_timeout_s=0.2,
                     liveness_failures=2, clock=clock)
    await sup.start()
    hang.touch()
    await pass_backoff(clock, sup)
    await eventually(lambda: sup.ready and sup.generation == 2, within=10)
    assert not alive(pid_of(tmp_path, 1))
    await sup.stop()


async def test_stop_ends_the_whole_process_group(tmp_path: Path) -> None:
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_SPAWN_WORKER": "1"})
    await sup.start()
    worker = int((tmp_path / "worker-1.pid").read_text())
    assert alive(worker)
    await sup.stop()
    # vLLM's engine-core and workers would otherwise keep the GPUs.
    await eventually(lambda: not alive(worker))


async def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = ManualClock()
    sup = supervisor(tmp_path, {"MERIDIAN_STANDIN_IGNORE_SIGTERM": "1"}, stop_grace_s=0.3, clock=clock)
    await sup.start()
    stopping = asyncio.create_task(sup.stop())
    # The grace period passes on the supervisor's clock, and only once.
    assert await advance_until_done(clock, stopping, 0.3) == 1
    await stopping
    assert not alive(pid_of(tmp_path, 1))
    assert any("after SIGTERM" in r.getMessage() for r in caplog.records)


async def test_a_missing_program_fails_at_once(tmp_path: Path) -> None:
    sup = VllmSupervisor([str(tmp_path / "no-such-vllm"), "serve", "x"], base_url="http://127.0.0.1:9",
                         served_model_name="m", policy=FAST_RESTARTS)
    with pytest.raises(VllmFailedError, match="cannot run"):
        await sup.start()
    assert sup.state is ChildState.FAILED and sup.restarts == 0
