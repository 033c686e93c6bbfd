"""Response ids that carry their replica, bound to the tenant (geo_router/ingress/responses.py)."""

from __future__ import annotations

import pytest
from router_harness import tenants

from geo_router.ingress.responses import ResponseIds, ResponseNotFound

IDS = ResponseIds("cluster-token-0123456789")
ALICE, BOB = tenants()[0], tenants()[1]


def test_an_id_resolves_to_its_node_for_its_tenant_only() -> None:
    wrapped = IDS.wrap("resp_9f3a", "eu-node-1", ALICE)
    stored = IDS.resolve(wrapped, ALICE)
    assert (stored.inner_id, stored.node_id) == ("resp_9f3a", "eu-node-1")
    assert ALICE.tenant != BOB.tenant
    with pytest.raises(ResponseNotFound):
        IDS.resolve(wrapped, BOB)
    with pytest.raises(ResponseNotFound):  # another cluster's routers
        ResponseIds("another-cluster-token").resolve(wrapped, ALICE)


@pytest.mark.parametrize("forged", [
    "resp_9f3a",  # vLLM's bare id
    "resp_9f3a.ZXUtbm9kZS0y.AAAAAAAAAAAAAAAA",  # another node, a made-up MAC
    "resp_9f3a.!!!.x", "x.y.z", "", "resp_." * 3,
])
def test_forged_or_bare_ids_are_not_found(forged: str) -> None:
    with pytest.raises(ResponseNotFound) as caught:
        IDS.resolve(forged, ALICE)
    assert caught.value.status == 404


def test_answers_have_vllms_ids_wrapped_once_in_whole_events() -> None:
    rewrite = IDS.rewriter(ALICE)
    event = b'data: {"type":"response.created","response":{"id":"resp_abc123","previous_response_id":null}}\n\n'
    out = rewrite("eu-node-1", event)
    wrapped = IDS.wrap("resp_abc123", "eu-node-1", ALICE)
    assert out == event.replace(b"resp_abc123", wrapped.encode())
    assert rewrite("eu-node-1", out) == out, "an id already wrapped is left alone"
    assert rewrite("eu-node-1", b'{"id":"chatcmpl-1"}') == b'{"id":"chatcmpl-1"}'
