"""The drill harness keeps the heap it started with out of garbage collection while the load
runs: a pytest session that ran the suite first holds millions of objects, and a full
collection of them stopped the harness (the fault proxies between router and nodes, the
load) for 2-3 s, long enough for the router to eject a zone's only node (CI: disk-full)."""

from __future__ import annotations

import gc
import socket
import weakref
from collections.abc import Mapping
from pathlib import Path

from chaos.drill import Drill
from chaos.heap import frozen_heap
from chaos.history import History, HistoryWriter
from chaos.load import LoadGenerator, LoadTarget
from chaos.schedule import FaultState, drive
from chaos.timeline import Timeline


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def _walked(obj: object) -> bool:
    """Whether a collection now would walk `obj` (the permanent generation is left out)."""
    return any(o is obj for o in gc.get_objects())


class _Watcher:
    """A stand-in injector that looks at what the collector walks while the fault is on."""

    def __init__(self, ballast: object) -> None:
        self.ballast = ballast
        self.walked: list[bool] = []
        self.tracked_during_load = -1

    async def inject(self) -> None:
        self.walked.append(_walked(self.ballast))
        self.tracked_during_load = len(gc.get_objects())

    async def heal(self) -> None:
        self.walked.append(_walked(self.ballast))

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {}


def _drill() -> Drill:
    return Drill.model_validate({
        "name": "heap", "description": "the load runs with the session's heap frozen",
        "steady_state": {"min_success_rate": 0, "window_s": 0.1},
        "load": {"arrivals_per_s": 20, "duration_s": 0.6, "streaming_fraction": 0,
                 "tenants": [{"name": "t", "zone": "global", "weight": 1}]},
        "fault": {"kind": "process_hang", "target": {"node": "any"}, "start_s": 0.2, "end_s": 0.4},
        "pass": {},
    })


def _refused_url() -> str:
    """A port nothing listens on: every request is a quick connect error, which is enough here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def test_a_collection_during_the_load_does_not_walk_the_heap_that_existed_before_it(tmp_path: Path) -> None:
    # The test session's heap, as a suite run leaves it: far more than a drill allocates.
    ballast = [[i] for i in range(200_000)]
    watcher = _Watcher(ballast)
    drill = _drill()
    with HistoryWriter(tmp_path / "client.jsonl") as writer:
        gen = LoadGenerator(drill.load, LoadTarget((_refused_url(),), {"t": "key"}, "m"), writer)
        await drive(drill, gen, Timeline(), FaultState(), lambda _f: watcher, injection_errors=())
    assert watcher.walked == [False, False], "the session's heap was walked while the fault was on"
    assert watcher.tracked_during_load < 50_000, watcher.tracked_during_load
    # Once the load has ended the collector has the whole heap again.
    assert _walked(ballast)
    assert gc.get_freeze_count() == 0


def test_garbage_made_while_frozen_is_collected_and_garbage_frozen_is_collected_after() -> None:
    before = _Cycle()
    gone_before = weakref.ref(before)
    del before
    with frozen_heap() as frozen:
        assert frozen > 0
        inside = _Cycle()
        gone_inside = weakref.ref(inside)
        del inside
        gc.collect()
        assert gone_inside() is None, "a cycle made during the load must still be collected"
        assert gone_before() is not None, "what existed on entry is left alone until the exit"
    gc.collect()
    assert gone_before() is None
