"""What `meridian chaos run` shows while a drill runs: its steps, a progress line (phase, load
time, requests sent / ok / errors) and the fault's events as they happen. Piped, as lines
(the progress line every 10 s of the clock, and at the end); on a terminal, redrawn in
place. Driven here by a stand-in runner and a manual clock, without a fabric."""

from __future__ import annotations

import io
import re
import time
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from chaos import suite
from chaos.drill import DRILLS_DIR, Drill, load_drill
from chaos.history import History, Outcome
from chaos.load import LoadStats
from chaos.progress import DrillProgress, Phase, phase_at, progress_line
from chaos.schedule import FaultState, RunOutcome, finish
from chaos.timeline import FaultEvent, Timeline
from meridian.clock import ManualClock

DRILL = load_drill(DRILLS_DIR / "01-node-crash.yaml").short_version()  # 30 s, fault [10, 18) s


def _stats(ok: int, failed: int = 0, in_flight: int = 0) -> LoadStats:
    stats = LoadStats(sent=ok + failed + in_flight, in_flight=in_flight)
    for i in range(ok):
        stats.record_end(i * 0.1, Outcome.OK)
    for i in range(failed):
        stats.record_end(i * 0.1, Outcome.FAIL)
    return stats


def _piped() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


def test_the_phase_follows_the_drills_schedule_and_the_line_counts_requests():
    assert [phase_at(DRILL.fault, t) for t in (0, 9.9, 10, 17.9, 18, 29)] == [
        Phase.STEADY, Phase.STEADY, Phase.FAULT, Phase.FAULT, Phase.RECOVERY, Phase.RECOVERY]
    assert progress_line(Phase.FAULT, 12.4, 30, _stats(20, failed=3, in_flight=2)) == (
        "fault 12/30 s · sent 25 ok 20 errors 3 indeterminate 0 in flight 2")


def test_piped_steps_and_events_are_lines_as_they_come_and_progress_every_ten_seconds():
    console, out = _piped()
    clock = ManualClock()
    with DrillProgress("node-crash", DRILL.fault, "a local fabric", console, clock=clock) as progress:
        clock.advance(4)
        progress.step("starting router at http://127.0.0.1:8080")
        clock.advance(20)  # the fabric starts: 20 s without a tick
        progress.tick(0.25, 30, _stats(1))
        for t in range(1, 10):  # 9 s of ticks: no line
            clock.advance(1)
            progress.tick(t + 0.25, 30, _stats(t * 5))
        progress.event(FaultEvent(10.02, "inject", "SIGKILL node-aws-us-east-1-2 (pid 1234)"))
        clock.advance(1)
        progress.tick(10.25, 30, _stats(50, failed=2, in_flight=1))  # 1 s after the last line: held
        clock.advance(3)
        progress.tick(13.25, 30, _stats(60, failed=4))  # held instead, printed at the end
    assert out.getvalue().splitlines() == [
        "[   0s] node-crash: starting on a local fabric",
        "[   4s] node-crash: starting router at http://127.0.0.1:8080",
        "[  24s] node-crash: steady 0/30 s · sent 1 ok 1 errors 0 indeterminate 0 in flight 0",
        # The line held back comes before the event that followed it.
        "[  33s] node-crash: steady 9/30 s · sent 45 ok 45 errors 0 indeterminate 0 in flight 0",
        "[  33s] node-crash: inject at 10.0 s: SIGKILL node-aws-us-east-1-2 (pid 1234)",
        "[  37s] node-crash: fault 13/30 s · sent 64 ok 60 errors 4 indeterminate 0 in flight 0",
    ]


def test_on_a_terminal_the_line_is_redrawn_in_place_and_events_print_above_it():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=200)
    with DrillProgress("node-crash", DRILL.fault, "a local fabric", console, clock=ManualClock()) as progress:
        progress.step("warming up")
        progress.tick(11.0, 30, _stats(40, failed=1))
        progress.event(FaultEvent(10.02, "inject", "SIGKILL node-1"))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())  # the terminal's control codes
    assert "node-crash inject at 10.0 s: SIGKILL node-1" in text
    assert "fault 11/30 s · sent 41 ok 40 errors 1" in text
    assert "\r" in out.getvalue() or "\x1b[" in out.getvalue()  # redrawn, not appended
    assert "[   0s]" not in text  # no piped lines


def _stand_in(drill: Drill, out: Path, progress: DrillProgress) -> RunOutcome:
    """A runner that reports as the real ones do (the timeline tells its events), without a fabric."""
    progress.step("starting the fabric for node-crash")
    env = Timeline(clock_start=time.monotonic(), on_event=progress.event)
    progress.tick(1.0, 30, _stats(4))
    env.event("inject", "SIGKILL node-aws-us-east-1-2 (pid 1234)")
    progress.tick(12.0, 30, _stats(48, failed=3))
    env.event("heal", "restart node-aws-us-east-1-2 (pid 1301)")
    progress.step("checking the request history against the pass criteria")
    return finish(drill.short_version(), short=True, started_at=datetime.now(UTC), history=History(),
                  region_zones={}, env=env, state=FaultState(), invariants={}, out_dir=out)


def test_chaos_run_shows_steps_progress_and_events_before_the_verdict(tmp_path: Path):
    console, out = _piped()
    runner = suite.DrillRunner("a stand-in", lambda _d: None, _stand_in)
    suite.run([load_drill(DRILLS_DIR / "01-node-crash.yaml")], tmp_path, runner, short=True, console=console)
    lines = out.getvalue().splitlines()
    shown = [re.sub(r"^\[ *\d+s\] node-crash: ", "", line) for line in lines if line.startswith("[")]
    assert shown[:5] == ["starting on a stand-in", "starting the fabric for node-crash",
                         "steady 1/30 s · sent 4 ok 4 errors 0 indeterminate 0 in flight 0",
                         "inject at 0.0 s: SIGKILL node-aws-us-east-1-2 (pid 1234)",
                         "fault 12/30 s · sent 51 ok 48 errors 3 indeterminate 0 in flight 0"]
    assert shown[5].startswith("heal at") and shown[5].endswith("restart node-aws-us-east-1-2 (pid 1301)")
    assert shown[6:] == ["checking the request history against the pass criteria"]
    # Then the verdict and where the report is.
    assert any("node-crash (short)" in line for line in lines)
    assert any(line.startswith("report: ") for line in lines)
