"""VersionBumper: every caller waits for a bump that began after its call, bumps never overlap,
and callers that arrive while one runs share the next one instead of queueing one each."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from control_plane.version_bumper import VersionBumper


class Row:
    """The version row: each bump records when it began (a tick of calls seen) and whether
    another was running."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.version = 0
        self.calls = 0  # bump() calls seen so far, by the test
        self.began_after: dict[int, int] = {}  # version -> calls made before its bump began
        self.running = 0
        self.overlapped = False
        self.gate = gate
        self.lock = threading.Lock()

    def bump_once(self) -> int:
        with self.lock:
            self.running += 1
            self.overlapped |= self.running > 1
            began = self.calls
        if self.gate is not None:
            self.gate.wait(5)
        with self.lock:
            self.version += 1
            self.began_after[self.version] = began
            self.running -= 1
            return self.version


def test_each_caller_gets_a_bump_begun_after_its_call_and_callers_share_bumps() -> None:
    gate = threading.Event()
    row = Row(gate)
    bumper = VersionBumper(row.bump_once)

    def call() -> tuple[int, int]:
        with row.lock:
            row.calls += 1
            mine = row.calls
        return mine, bumper.bump()

    with ThreadPoolExecutor(16) as pool:
        first = pool.submit(call)  # runs the first bump, held at the gate
        while row.running == 0:
            threading.Event().wait(0.001)
        rest = [pool.submit(call) for _ in range(15)]
        while bumper._requested < 16:  # everyone is waiting on the first bump
            threading.Event().wait(0.001)
        gate.set()
        answers = [first.result(5)] + [f.result(5) for f in rest]
    for mine, version in answers:
        # The bump that answered this caller began after the caller's call (its write's commit).
        assert row.began_after[version] >= mine
    assert not row.overlapped
    assert row.version == 2 == bumper.bumps  # 15 callers waiting on one bump shared the next
    assert bumper.version == 2


def test_a_failed_bump_raises_to_its_runner_and_the_waiters_bump_again() -> None:
    attempts = {"n": 0}

    def flaky() -> int:
        attempts["n"] += 1
        if attempts["n"] == 1:
            raise ConnectionError("database gone")
        return 7

    bumper = VersionBumper(flaky)
    with pytest.raises(ConnectionError):
        bumper.bump()
    assert bumper.bump() == 7
    assert bumper.version == 7 and bumper.bumps == 1
