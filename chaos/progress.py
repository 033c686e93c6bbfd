"""What `meridian chaos run` shows while a drill runs (chaos.suite): its steps (starting the
fabric, warming up, stopping, checking), a progress line while the load runs (phase, load
time, requests sent / ok / errors / indeterminate / in flight) and the drill's own events
(inject, heal, abort) as they happen.

On a terminal the line is redrawn in place under rich's live display, steps show in it and
events print above it. Piped (a CI log, `| tee`), nothing can be redrawn: every step and
event is one line as it happens, and the progress line is printed every `every_s` seconds
of the load (the latest one held back also before the next step or event, and at the end),
so a log never goes quiet for a whole drill and reads in order. Each piped line starts with
the seconds since the drill began, on the injectable clock.

`phase_at` and `progress_line` are pure; DrillProgress does the printing.
"""

from __future__ import annotations

from enum import StrEnum
from types import TracebackType

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from chaos.drill import Fault
from chaos.load import LoadStats
from chaos.timeline import FaultEvent
from meridian.clock import SYSTEM_CLOCK, Clock

# Seconds between two progress lines when the output is not a terminal.
PIPED_EVERY_S = 10.0


class Phase(StrEnum):
    """Where the load is in the drill's schedule."""

    STEADY = "steady"  # before the fault
    FAULT = "fault"
    RECOVERY = "recovery"  # after the fault was healed


def phase_at(fault: Fault, now_s: float) -> Phase:
    """The phase at `now_s` seconds of load, on the drill's schedule."""
    if now_s < fault.start_s:
        return Phase.STEADY
    return Phase.FAULT if now_s < fault.end_s else Phase.RECOVERY


def progress_line(phase: Phase, now_s: float, duration_s: float, stats: LoadStats) -> str:
    """`fault 41/60 s · sent 230 ok 221 errors 7 indeterminate 2 in flight 0`."""
    return (f"{phase} {min(now_s, duration_s):.0f}/{duration_s:.0f} s · sent {stats.sent} ok {stats.ok} "
            f"errors {stats.failed} indeterminate {stats.indeterminate} in flight {stats.in_flight}")


class DrillProgress:
    """Shows one drill's run on `console` (a context manager around the run); its `step`,
    `tick` and `event` are the runner's callbacks, and may be called from other threads
    (the local fabric reports its steps from its own)."""

    def __init__(self, name: str, fault: Fault, where: str, console: Console, *,
                 clock: Clock = SYSTEM_CLOCK, every_s: float = PIPED_EVERY_S) -> None:
        self._name, self._fault, self._where = name, fault, where
        self._console, self._clock, self._every_s = console, clock, every_s
        self._started = clock.monotonic()
        self._live: Progress | None = None
        self._task: TaskID | None = None
        # Piped: when the last progress line was printed, and the line not printed since.
        self._printed_at: float | None = None
        self._pending: str | None = None

    def __enter__(self) -> DrillProgress:
        self._started = self._clock.monotonic()
        if self._console.is_terminal:
            self._live = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                  TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                  console=self._console, transient=True)
            self._live.start()
            self._task = self._live.add_task(self._name, total=None, status=f"starting on {self._where}")
        else:
            self._print(f"starting on {self._where}")
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._live is not None:
            self._live.stop()
        else:
            self._flush()

    def step(self, message: str) -> None:
        """What the runner is doing now (outside the load, or beside it)."""
        if self._live is not None and self._task is not None:
            self._live.update(self._task, status=escape(message))
        else:
            self._flush()
            self._print(message)

    def tick(self, now_s: float, duration_s: float, stats: LoadStats) -> None:
        """The load's counters at `now_s` seconds of `duration_s` (every monitor tick)."""
        line = progress_line(phase_at(self._fault, now_s), now_s, duration_s, stats)
        if self._live is not None and self._task is not None:
            self._live.update(self._task, total=duration_s, completed=min(now_s, duration_s), status=line)
            return
        now = self._clock.monotonic()
        if self._printed_at is None or now - self._printed_at >= self._every_s:
            self._printed_at, self._pending = now, None
            self._print(line)
        else:
            self._pending = line

    def event(self, event: FaultEvent) -> None:
        """What the fault injector did (or why the run aborted), as it happens."""
        text = f"{event.action} at {event.at_s:.1f} s: {event.detail}"
        if self._live is not None:
            self._live.console.print(f"[bold]{escape(self._name)}[/bold] {escape(text)}", highlight=False)
        else:
            self._flush()
            self._print(text)

    def _flush(self) -> None:
        """Piped: the progress line held back, before a line about what came after it."""
        if self._pending is not None:
            self._printed_at, line, self._pending = self._clock.monotonic(), self._pending, None
            self._print(line)

    def _print(self, text: str) -> None:
        elapsed = self._clock.monotonic() - self._started
        self._console.print(f"[{elapsed:4.0f}s] {self._name}: {text}", markup=False, highlight=False,
                            soft_wrap=True)
