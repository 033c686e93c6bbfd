"""A zone that loses its last replica fails fast (issue 32), on a local fabric.

As in the report: a deployment in zone eu of the fabric's model, then its only eu node is
killed. Once the control plane has expired the node, eu requests used to be held without a
byte for up to the scale-from-zero timeout (120 s) until their clients gave up, and the
autoscaler counted the us node as a replica of the eu deployment ("hold at 1 … of 2 ready").
Now an eu request is answered 503 no_replica_in_zone with Retry-After within a stated bound,
a us request is still served, and the autoscaler sees the eu zone's replicas only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from e2e_fabric import e2e_spec, running
from prometheus_client.parser import text_string_to_metric_families

from localfabric import DEMO_MODEL, LocalFabric
from meridian.contracts import HEADER_REGION

pytestmark = pytest.mark.e2e

US, EU = "aws:us-east-1", "gcp:europe-west4"
# Nothing is starting in eu, so the answer comes at once (the router takes milliseconds); the
# bound leaves room for a loaded CI machine and stays far under MERIDIAN_ROUTER_REPLICA_START_WAIT_S
# (10 s, the longest wait when a replica is starting) and under the clients' timeouts of the report.
ANSWER_BOUND_S = 5.0
CHAT = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFabric]:
    # No deployment in the spec, so no local scaler: as `meridian demo`, then `meridian deploy`.
    # The autoscaler records a decision every second even when it holds, so the test sees it.
    spec = e2e_spec(tmp_path_factory.mktemp("zone-loss"), regions=(US, EU), default_client_location=US,
                    control_plane_env={"MERIDIAN_CP_AUTOSCALE_INTERVAL_S": "0.5",
                                       "MERIDIAN_CP_AUTOSCALE_HOLD_RECORD_S": "1"})
    yield from running(spec)


def poll(read: Callable[[], Any], done: Callable[[Any], bool], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if done(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:g}s; last: {value!r}")
        time.sleep(0.2)


def gauge(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


def test_a_zone_that_loses_its_last_replica_answers_503_within_the_bound(fabric: LocalFabric) -> None:
    info = fabric.info
    assert info is not None
    admin = httpx.Client(base_url=info.control_plane_url, timeout=10,
                         headers={"authorization": f"Bearer {info.admin_key}"})
    router = httpx.Client(base_url=info.router_url, timeout=20)

    def chat(zone: str, **extra: Any) -> httpx.Response:
        return router.post("/v1/chat/completions", json=CHAT | extra,
                           headers={"authorization": f"Bearer {info.keys[zone]}"})

    def decision() -> dict[str, Any] | None:
        listed = admin.get("/v1/autoscaler/decisions", params={"model": DEMO_MODEL, "limit": "1"}).json()
        return listed[0] if listed else None

    def eu_ready_replicas() -> float | None:
        text = router.get("/metrics", headers={"authorization": f"Bearer {info.cluster_token}"}).text
        return gauge(text, "meridian_router_zone_ready_replicas", zone="eu", model=DEMO_MODEL)

    r = admin.put(f"/v1/deployments/{DEMO_MODEL}", json={"zone": "eu", "min_replicas": 1, "max_replicas": 2})
    assert r.status_code in (200, 201), r.text
    # Both nodes serve the model; only the eu one is a replica of the eu deployment.
    first = poll(decision, lambda d: d is not None, 30, "an autoscaler decision")
    assert first["inputs"]["ready"] == 1, first
    assert chat("eu").headers[HEADER_REGION] == EU

    fabric.kill_node(EU)
    # Once the control plane expires the node (its TTL), the routers' tables have no eu replica.
    poll(eu_ready_replicas, lambda n: n == 0, 60, "the router seeing no eu replica")
    for stream in (False, True):
        started = time.monotonic()
        r = chat("eu", stream=stream)
        elapsed = time.monotonic() - started
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "no_replica_in_zone" and "`eu`" in r.json()["error"]["message"]
        assert int(r.headers["retry-after"]) >= 1
        assert elapsed < ANSWER_BOUND_S, f"answered after {elapsed:.1f}s"
    # Other zones are served as before.
    r = chat("us")
    assert r.status_code == 200 and r.headers[HEADER_REGION] == US

    # The autoscaler counts the eu zone's replicas only: none, whatever the us node runs.
    last = poll(decision, lambda d: d is not None and d["inputs"]["ready"] == 0, 30, "a decision with 0 ready")
    assert last["desired"] == 1 and "0 of 1 ready" in last["reason"]
    admin.close()
    router.close()
