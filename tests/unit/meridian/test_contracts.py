from datetime import UTC, datetime

import pytest
from pydantic import ValidationError

from meridian.contracts import (
    NodeHeartbeat,
    NodeLoad,
    NodeRegistration,
    NodeStatus,
    RoutingNode,
    RoutingTable,
    TenantEntry,
    openai_error,
)


def test_registration_validates_region_and_url():
    reg = NodeRegistration(node_id="n1", region="aws:us-east-1", url="http://10.0.0.1:8000/", models=["m"])
    assert reg.url == "http://10.0.0.1:8000"
    # The kernel takes any well-formed "<provider>:<location>"; whether the provider is
    # registered is the control plane's check (tests/unit/providers/test_fourth_provider.py).
    with pytest.raises(ValidationError):
        NodeRegistration(node_id="n1", region="westeurope", url="http://h:1")
    with pytest.raises(ValidationError):
        NodeRegistration(node_id="n1", region="Azure:westeurope", url="http://h:1")
    with pytest.raises(ValidationError):
        NodeRegistration(node_id="n1", region="aws:us-east-1", url="ftp://h:1")
    with pytest.raises(ValidationError):
        NodeRegistration(node_id="Bad Id", region="aws:us-east-1", url="http://h:1")


def test_unknown_fields_are_rejected_not_ignored():
    with pytest.raises(ValidationError):
        NodeRegistration(node_id="n1", region="aws:us-east-1", url="http://h:1", zone="eu")


def test_routing_table_round_trips_through_json():
    table = RoutingTable(
        version=3, generated_at=datetime.now(UTC), regions=[], nodes=[],
        tenants=[TenantEntry(key_hash="a" * 64, key_prefix="mrd_abc", tenant="t", zone="eu")],
    )
    assert RoutingTable.model_validate_json(table.model_dump_json()) == table


def test_openai_error_shape():
    body = openai_error("nope", code="model_not_found", param="model")
    assert body == {"error": {"message": "nope", "type": "invalid_request_error",
                              "param": "model", "code": "model_not_found"}}


def test_heartbeat_request_counters_are_optional_on_the_wire():
    """A node that measures no requests sends the load an older control plane (which forbids
    unknown fields) accepts; one that does sends counts that never go negative."""
    old_shape = {"running": 1, "waiting": 0, "kv_cache_usage": 0.5, "lora_adapters": []}
    assert NodeLoad(running=1, kv_cache_usage=0.5).model_dump(mode="json") == old_shape
    beat = NodeHeartbeat(status=NodeStatus.READY, load=NodeLoad(requests_completed=7, latency_s_sum=1.25))
    assert NodeHeartbeat.model_validate_json(beat.model_dump_json()) == beat
    assert NodeLoad.model_validate(old_shape).requests_completed is None
    for bad in ({"requests_completed": -1}, {"latency_s_sum": -0.5}, {"latency_s_sum": float("nan")}):
        with pytest.raises(ValidationError):
            NodeLoad(**bad)


def test_the_tool_call_parser_is_optional_on_the_wire():
    """A node with no parser sends what an older control plane accepts, and a routing node
    from an older snapshot (no parser) is valid; names are short identifiers."""
    reg = NodeRegistration(node_id="n1", region="aws:us-east-1", url="http://h:1")
    assert "tool_call_parser" not in reg.model_dump(mode="json")
    old = {"node_id": "n1", "region": "aws:us-east-1", "url": "http://h:1", "models": [], "status": "ready"}
    assert RoutingNode.model_validate(old).tool_call_parser is None
    node = RoutingNode.model_validate({**old, "tool_call_parser": "granite-20b-fc"})
    assert RoutingNode.model_validate_json(node.model_dump_json()) == node
    for bad in ("", "-x", "a b", "x" * 65, "pythonic\n"):
        with pytest.raises(ValidationError):
            NodeRegistration(node_id="n1", region="aws:us-east-1", url="http://h:1", tool_call_parser=bad)


def test_a_tenants_priority_and_weight_are_left_out_at_their_defaults():
    """Flow control's fields (issue 37): an entry at band 0 and weight 1 sends what an older
    router (which forbids unknown fields) accepts; others round-trip within their bounds."""
    key = {"key_hash": "a" * 64, "key_prefix": "mrd_abc", "tenant": "t", "zone": "eu"}
    plain = TenantEntry(**key)
    assert (plain.priority, plain.weight, plain.sheddable) == (0, 1.0, False)
    dumped = plain.model_dump(mode="json")
    assert "priority" not in dumped and "weight" not in dumped
    banded = TenantEntry(**key, priority=-1, weight=0.5)
    assert banded.sheddable and banded.model_dump(mode="json")["priority"] == -1
    assert TenantEntry.model_validate_json(banded.model_dump_json()) == banded
    assert not TenantEntry(**key, priority=10, weight=1000).sheddable
    for bad in ({"priority": 11}, {"priority": -11}, {"weight": 0}, {"weight": 1000.5}, {"weight": float("inf")},
                {"weight": float("nan")}):
        with pytest.raises(ValidationError):
            TenantEntry(**key, **bad)
