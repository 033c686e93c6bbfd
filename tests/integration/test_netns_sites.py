"""Separate hosts in network namespaces, and real packet loss between them and this host."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from chaos.faults.netns import Sites, netns_unavailable
from meridian.ports import free_port


@pytest.fixture
def sites() -> Iterator[Sites]:
    why = netns_unavailable()
    if why is not None:
        if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
            pytest.fail(f"{why} (MERIDIAN_REQUIRE_SERVICES=1)", pytrace=False)
        pytest.skip(why)
    s = Sites(("onprem:tokyo-1",)).open()
    yield s
    s.close()


def _get(url: str, timeout_s: float) -> int | str:
    try:
        return httpx.get(url, timeout=timeout_s).status_code
    except httpx.HTTPError as exc:
        return type(exc).__name__


def test_a_partitioned_site_drops_packets_both_ways_and_heals(sites: Sites):
    site = sites.by_region["onprem:tokyo-1"]
    port = free_port()
    server = subprocess.Popen(
        [*site.placement().command_prefix, sys.executable, "-m", "http.server", str(port), "--bind", site.address],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://{site.address}:{port}/"
        deadline = time.monotonic() + 10
        while _get(url, 1) != 200:
            assert time.monotonic() < deadline, "the server in the namespace never answered"
            time.sleep(0.1)
        # Not reachable on this host's loopback: it is another host.
        assert _get(f"http://127.0.0.1:{port}/", 1) == "ConnectError"

        site.nft("add", "table", "inet", "t")
        site.nft("add", "chain", "inet", "t", "in", "{", "type", "filter", "hook", "input", "priority", "0", ";", "}")
        site.nft("add", "rule", "inet", "t", "in", "iifname", site.ns_link, "drop")
        # Dropped SYNs: the connect times out (a refused connection would be a crash, not a partition).
        assert _get(url, 1) == "ConnectTimeout"

        site.nft("delete", "table", "inet", "t")
        assert _get(url, 2) == 200
    finally:
        server.kill()
        server.wait()
    namespace = site.namespace
    sites.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert namespace not in listed
