"""Two workers behave as one router (issue 35): a real `meridian router serve --workers 2`
process in front of two nginx stand-in nodes, every request on a new connection so that the
kernel spreads them over both workers (SO_REUSEPORT).

- A tenant's rate limit holds exactly across the workers (not once per worker).
- Affinity sends every turn of a conversation to one node, whichever worker takes the turn.
- One worker probes the nodes for both.
- A killed worker is replaced; meanwhile new requests are served by the other.
- /metrics, wherever the scrape lands, shows both workers' series.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.router import MODEL, REGION, ROUTE, RunningRouter, chat_node, router_process
from meridian.contracts import NodeStatus, RoutingNode, RoutingTable, TenantEntry
from meridian.security import hash_api_key, key_prefix

pytestmark = pytest.mark.e2e

LIMITED_KEY = "mrd_workers-limited-tenant"
OPEN_KEY = "mrd_workers-open-tenant"
SCRAPE = {"authorization": "Bearer router-bench-cluster-token"}
# One request a minute with an hour's burst: a bucket of exactly 60 requests that refills by
# one request a minute, so a test that runs for seconds sees the bucket and nothing else.
BUCKET = 60


def table(node_urls: list[str]) -> RoutingTable:
    nodes = [RoutingNode(node_id=f"node-{i}", region=REGION.name, url=url, models=[MODEL],
                         status=NodeStatus.READY)
             for i, url in enumerate(node_urls)]
    tenants = [
        TenantEntry(key_hash=hash_api_key(LIMITED_KEY), key_prefix=key_prefix(LIMITED_KEY), tenant="limited",
                    zone="global", requests_per_minute=1),
        TenantEntry(key_hash=hash_api_key(OPEN_KEY), key_prefix=key_prefix(OPEN_KEY), tenant="open", zone="global"),
    ]
    return RoutingTable(version=1, generated_at=datetime.now(UTC), regions=[REGION], nodes=nodes, tenants=tenants)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningRouter]:
    work = tmp_path_factory.mktemp("workers")
    with contextlib.ExitStack() as stack:
        nodes = [stack.enter_context(chat_node(work / f"node-{i}")) for i in range(2)]
        env = {"MERIDIAN_ROUTER_WORKERS": "2", "MERIDIAN_ROUTER_RATE_LIMIT_BURST_S": "3600"}
        yield stack.enter_context(router_process(work / "router", nodes[0].url, env,
                                                 table=table([n.url for n in nodes])))


async def post(url: str, key: str, messages: list[dict[str, str]]) -> httpx.Response:
    """One request on a connection of its own (so the kernel picks a worker for each)."""
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        return await client.post(url + ROUTE, headers={"authorization": f"Bearer {key}"},
                                 json={"model": MODEL, "messages": messages, "max_tokens": 8})


def served_per_worker(url: str) -> dict[str, float]:
    """Requests answered per worker, from one scrape (whichever worker takes it)."""
    page = httpx.get(url + "/metrics", headers=SCRAPE, timeout=10.0, trust_env=False).text
    served: Counter[str] = Counter()
    for family in text_string_to_metric_families(page):
        if family.name == "meridian_router_workers":
            assert family.samples[0].value == 2
        if family.name == "meridian_router_tenant_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    served[sample.labels["worker"]] += sample.value
    return dict(served)


async def test_a_tenants_rate_limit_holds_exactly_across_workers(router: RunningRouter) -> None:
    before = served_per_worker(router.url)
    gate = asyncio.Semaphore(8)

    async def one() -> int:
        async with gate:
            return (await post(router.url, LIMITED_KEY, [{"role": "user", "content": "hi"}])).status_code

    statuses = Counter(await asyncio.gather(*(one() for _ in range(2 * BUCKET))))
    # Both workers took requests, and between them admitted the bucket: not a bucket each.
    assert statuses == {200: BUCKET, 429: BUCKET}, statuses
    after = served_per_worker(router.url)
    assert all(after.get(w, 0) > before.get(w, 0) for w in ("0", "1")), (before, after)


async def test_a_conversation_stays_on_one_node_whichever_worker_takes_each_turn(router: RunningRouter) -> None:
    before = served_per_worker(router.url)
    nodes_of: dict[int, set[str]] = {}
    for conversation in range(12):
        # Long enough for several prefix chunks; different from the first word on.
        messages = [{"role": "system", "content": f"conversation {conversation}: " + "be brief. " * 60}]
        nodes_of[conversation] = set()
        for turn in range(4):
            messages.append({"role": "user", "content": f"question {turn} " * 20})
            answer = await post(router.url, OPEN_KEY, messages)
            assert answer.status_code == 200, answer.text
            nodes_of[conversation].add(answer.headers["x-meridian-node"])
            messages.append({"role": "assistant", "content": "ok"})
    assert all(len(nodes) == 1 for nodes in nodes_of.values()), nodes_of
    after = served_per_worker(router.url)
    assert all(after.get(w, 0) - before.get(w, 0) >= 5 for w in ("0", "1")), (before, after)


def probes_per_worker(url: str) -> dict[str, float]:
    page = httpx.get(url + "/metrics", headers=SCRAPE, timeout=10.0, trust_env=False).text
    return {sample.labels["worker"]: sample.value
            for family in text_string_to_metric_families(page) if family.name == "meridian_router_probes"
            for sample in family.samples if sample.name.endswith("_total")}


async def test_one_worker_probes_the_nodes_for_both(router: RunningRouter) -> None:
    # Each node answers one router's probes, not one set per worker.
    deadline = time.monotonic() + 20
    while sum((probes := probes_per_worker(router.url)).values()) < 4:
        assert time.monotonic() < deadline, probes
        await asyncio.sleep(0.5)
    assert sorted(probes) == ["0", "1"] and sorted(probes.values())[0] == 0, probes


def worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes (not the resource tracker the spawn method adds)."""
    out = subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True, text=True, check=False).stdout
    return [pid for pid in map(int, out.split()) if "spawn_main" in _cmdline(pid)]


def _cmdline(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    return ""


async def test_a_killed_worker_is_replaced_and_the_other_serves_meanwhile(router: RunningRouter) -> None:
    workers = worker_pids(router.pid)
    assert len(workers) == 2, workers
    # Connections the kernel queued on the dying worker's socket die with it; "meanwhile"
    # starts once it has exited (its pidfd turns readable; a zombie holds no sockets).
    pidfd = os.pidfd_open(workers[0])
    try:
        os.kill(workers[0], signal.SIGKILL)
        assert select.select([pidfd], [], [], 10.0)[0], "the killed worker did not exit"
    finally:
        os.close(pidfd)
    # Meanwhile, every new request is answered (by the survivor, then by both).
    statuses: Counter[int] = Counter()
    replaced: list[int] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        statuses[(await post(router.url, OPEN_KEY, [{"role": "user", "content": "hi"}])).status_code] += 1
        replaced = [p for p in worker_pids(router.pid) if p != workers[0]]
        if len(replaced) == 2 and served_per_worker(router.url).keys() >= {"0", "1"}:
            break
    assert statuses.keys() == {200}, statuses
    assert len(replaced) == 2 and workers[1] in replaced, (workers, replaced)
    assert workers[0] not in worker_pids(router.pid)


def test_a_second_router_on_the_same_port_fails_instead_of_sharing_it(router: RunningRouter,
                                                                      tmp_path: Path) -> None:
    """SO_REUSEPORT would let it join the first router's port and take half its connections."""
    port = router.url.rsplit(":", 1)[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    env |= {"MERIDIAN_CLUSTER_TOKEN": "router-bench-cluster-token", "MERIDIAN_ROUTER_WORKERS": "2"}
    second = subprocess.run([sys.executable, "-m", "cli", "router", "serve", "--host", "127.0.0.1", "--port", port,
                             "--snapshot-path", str(tmp_path / "table.json")],
                            env=env, capture_output=True, text=True, timeout=60, check=False)
    assert second.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in second.stdout + second.stderr
