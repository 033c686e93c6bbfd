"""TableStream on its own: the history's bounds, a build that outlives a waiter who gives up,
and the full table spliced from each node's JSON. (Against the real control plane:
test_cp_routing_deltas.py.)"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime

from control_plane.routing_table import NodeRows
from control_plane.table_stream import TableStream, publish
from meridian.clock import ManualClock
from meridian.contracts import (
    DeploymentEntry,
    KVConnector,
    KVTransferInfo,
    NodeRole,
    NodeStatus,
    RoutingNode,
    RoutingTable,
)


def table(version: int, nodes: int) -> RoutingTable:
    return RoutingTable(
        version=version, generated_at=datetime.now(UTC), regions=[], tenants=[],
        nodes=[RoutingNode(node_id=f"n-{i:03d}", region="aws:us-east-1", url=f"http://n{i}:1", models=["m"],
                           status=NodeStatus.READY) for i in range(nodes)],
    )


class Builds:
    """Builds the table of `version`; `gate` holds a build until the test opens it."""

    def __init__(self) -> None:
        self.version = 1
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, known: NodeRows) -> RoutingTable:
        self.gate.wait(10)
        return table(self.version, 20)


async def test_the_history_keeps_at_most_its_versions_and_bytes_and_always_the_newest():
    builds = Builds()
    size = len(table(1, 20).model_dump_json())
    stream = TableStream(builds, max_versions=3, max_bytes=2 * size + size // 2)
    for version in range(1, 6):
        builds.version = version
        await stream.newest_at_least(version)
    # The byte bound (two and a half tables) is the tighter one here.
    assert [v for v, _ in stream.held()] == [4, 5]
    tiny = TableStream(builds, max_versions=3, max_bytes=0)
    await tiny.newest_at_least(1)
    assert [v for v, _ in tiny.held()] == [5]


async def test_a_waiter_that_gives_up_does_not_cancel_the_build_the_others_wait_for():
    builds = Builds()
    builds.gate.clear()
    stream = TableStream(builds, max_versions=3, max_bytes=10**9)
    quitter = asyncio.create_task(stream.newest_at_least(1))
    stayer = asyncio.create_task(stream.newest_at_least(1))
    await asyncio.sleep(0.05)
    quitter.cancel()
    builds.gate.set()
    published = await asyncio.wait_for(stayer, 10)
    assert published.table.version == 1 and stream.builds == 1
    # A newer version than the newest build: built once more, for whoever asks.
    builds.version = 2
    assert (await stream.newest_at_least(2)).table.version == 2 and stream.builds == 2
    assert (await stream.newest_at_least(1)).table.version == 2 and stream.builds == 2


def test_the_spliced_full_table_is_the_tables_own_json_build_after_build():
    transfer = KVTransferInfo(connector=KVConnector.NIXL, endpoint="10.0.0.7:5600", lease_s=30.0)
    first = table(1, 5)
    nodes = list(first.nodes)
    nodes[1] = nodes[1].model_copy(update={"role": NodeRole.PREFILL, "kv_transfer": transfer,
                                           "tool_call_parser": "pythonic", "kv_events": "tcp://10.0.0.7:5557"})
    second = first.model_copy(update={"version": 2, "nodes": nodes,
                                      "deployments": [DeploymentEntry(model="m", zone="global", min_replicas=1, max_replicas=2)]})
    empty = first.model_copy(update={"version": 3, "nodes": []})
    previous = None
    for t in (first, second, empty, first):
        previous = publish(t, previous)
        assert previous.body == t.model_dump_json().encode()
        assert RoutingTable.model_validate_json(previous.body) == t


async def test_a_storm_of_changes_is_built_once_per_interval_covering_all_of_them():
    """Spaced builds (routing_build_min_interval_s): versions committed while the next build
    waits out the interval all go into that one build."""
    builds, clock = Builds(), ManualClock()
    stream = TableStream(builds, max_versions=8, max_bytes=10**9, min_interval_s=1.0, clock=clock)
    assert (await stream.newest_at_least(1)).table.version == 1 and stream.builds == 1
    builds.version = 2
    waiter = asyncio.create_task(stream.newest_at_least(2))
    await clock.settled()  # the build waits out the interval: nothing is built yet
    assert not waiter.done() and stream.builds == 1
    builds.version = 4  # two more changes meanwhile
    await clock.advance_async(1.0)
    published = await asyncio.wait_for(waiter, 10)
    assert published.table.version == 4 and stream.builds == 2
    # Past the interval, a change is built at once.
    await clock.advance_async(5.0)
    builds.version = 5
    assert (await asyncio.wait_for(stream.newest_at_least(5), 10)).table.version == 5 and stream.builds == 3


async def test_builds_take_at_most_their_share_of_a_core_however_costly_they_get():
    """A large fleet's build costs real CPU (every node row): the next one waits at least that
    cost times (1 / share - 1), so builds back to back can never take more than the share."""
    clock = ManualClock()

    class Costly(Builds):
        def __call__(self, known: NodeRows) -> RoutingTable:
            started = time.thread_time()
            while time.thread_time() - started < 0.05:  # 50 ms of this thread's CPU
                pass
            return table(self.version, 20)

    builds = Costly()
    stream = TableStream(builds, max_versions=8, max_bytes=10**9, min_interval_s=0.01, max_cpu_share=0.25,
                         clock=clock)
    await stream.newest_at_least(1)
    builds.version = 2
    waiter = asyncio.create_task(stream.newest_at_least(2))
    await clock.settled()
    await clock.advance_async(0.14)  # past the 0.01 s interval, short of 3 x 50 ms
    assert not waiter.done() and stream.builds == 1
    await clock.advance_async(0.1)  # (the build's own bookkeeping costs a little more than 50 ms)
    assert (await asyncio.wait_for(waiter, 10)).table.version == 2 and stream.builds == 2
