"""Admission for node registrations: a bounded number in flight, the rest told when to retry.

A registration is the control plane's most expensive node request (~8 ms of CPU on a 2-core
box against ~1.5 ms for a heartbeat): several statements, a commit and a routing version bump.
When a whole fleet registers at once (a control plane restored, a region brought up) the
requests used to queue in the thread pool until the nodes' own timeouts ran out; each node then
retried, so the control plane spent its CPU on registrations nobody waited for any more, and
heartbeats starved behind them (issue 34: 10,000 simulated nodes at 100 a second stalled at
~800, heartbeats falling to zero). Every cloud API's answer to that is the same: admit what you
can serve and say 429 with a Retry-After to the rest, at once and for nothing.

`RegistrationGate` admits `limit` registrations at a time per process. A refused one is given
a turn: the next free one on a schedule spaced by the rate the control plane registers at (the
recent rate of finished registrations, at least `limit` a second), and told it as Retry-After,
at least 1 s and at most `MAX_RETRY_AFTER_S`. Turns are handed out one after the other, so
however many nodes wait, they come back spread at the rate they can be served, not in a herd
that would be refused again (a fixed or random Retry-After brings the whole crowd back within
a few seconds). The node comes back at its turn, jittered a little (data_plane.agent).

`RegistrationAdmission` applies the gate as ASGI middleware, outermost: a refusal is a few
hundred bytes written before any body is read or validated, as cheap as a request can be
answered, since under a registration storm refusals are most of the traffic. Heartbeats of
registered nodes never pass through the gate.

Both run on the event loop only (no lock).
"""

from __future__ import annotations

import math
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send

from control_plane.errors import problem_response
from meridian.clock import SYSTEM_CLOCK, Clock

# How far back finished registrations are counted for the rate.
WINDOW_S = 5.0
MAX_RETRY_AFTER_S = 600
REGISTER_PATH = "/v1/nodes/register"


class RegistrationGate:
    """At most `limit` registrations in flight; a turn (Retry-After) for each one refused."""

    def __init__(self, limit: int | None, clock: Clock = SYSTEM_CLOCK) -> None:
        self.limit = limit
        self._clock = clock
        self.in_flight = 0
        self._done: deque[float] = deque()  # when admitted registrations finished
        self._next_turn = 0.0  # monotonic: the last turn handed out
        self.refused_total = 0

    def try_enter(self) -> bool:
        """Admit one registration (call `leave` when it ends), or False: call `refuse`."""
        if self.limit is None or self.in_flight < self.limit:
            self.in_flight += 1
            return True
        return False

    def leave(self) -> None:
        self.in_flight -= 1
        self._done.append(self._clock.monotonic())

    def refuse(self) -> int:
        """The refused registration's turn: seconds from now (its Retry-After)."""
        assert self.limit is not None
        now = self._clock.monotonic()
        while self._done and self._done[0] < now - WINDOW_S:
            self._done.popleft()
        rate = max(len(self._done) / WINDOW_S, float(self.limit))
        self._next_turn = max(self._next_turn, now) + 1.0 / rate
        self.refused_total += 1
        # (less a hair: turns summed from 1/rate steps must not round up to the next second)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self._next_turn - now - 1e-9)))


class RegistrationAdmission:
    """ASGI middleware: POST /v1/nodes/register through the app's RegistrationGate
    (`app.state.ctx.registrations`), 429 problem+json with Retry-After when refused."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != REGISTER_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        ctx = getattr(scope["app"].state, "ctx", None)
        gate: RegistrationGate | None = ctx.registrations if ctx is not None else None
        if gate is None or gate.try_enter():
            try:
                await self.app(scope, receive, send)
            finally:
                if gate is not None:
                    gate.leave()
            return
        retry_after = gate.refuse()
        response = problem_response(
            429, f"too many nodes registering at once; register again in {retry_after} s",
            headers={"retry-after": str(retry_after)},
        )
        await response(scope, receive, send)
