"""What a continuation asks of the next node (geo_router.forwarding.migration.plan).

The continuation generates the rest from prompt + generated ids with the client's sampling
and stop conditions; the router itself matches stop strings across the seam, so a vLLM
node is asked not to hold back the end of its text for them (it would otherwise send one
token past a stop string that started before the seam), and a torch node, which refuses
that field, is not.
"""

from __future__ import annotations

import json
from typing import Any

from geo_router.forwarding.migration.plan import plan_for
from meridian.contracts import NodeCapability, NodeStatus, RoutingNode

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                        "max_tokens": 50, "min_tokens": 10, "temperature": 0.5, "seed": 3, "stop": ["END"]}


def node(engine: str, capabilities: list[NodeCapability] | None = None) -> RoutingNode:
    return RoutingNode(node_id="n", region="aws:us-east-1", url="http://n:1", models=["m"], status=NodeStatus.READY,
                       engine=engine, capabilities=capabilities)  # type: ignore[arg-type]


def _continuation(payload: dict[str, Any], engine: str, capabilities: list[NodeCapability] | None = None
                  ) -> dict[str, Any]:
    plan = plan_for("/v1/chat/completions", payload, json.dumps(payload).encode())
    assert plan is not None
    return json.loads(plan.continuation_body([1, 2, 3, 4], 4, node(engine, capabilities)))  # type: ignore[no-any-return]


def test_the_rest_is_asked_with_the_clients_sampling_and_what_is_left_of_its_budgets() -> None:
    body = _continuation(CHAT, "torch")
    assert body["prompt"] == [1, 2, 3, 4] and body["stream"] is True and body["return_token_ids"] is True
    assert (body["max_tokens"], body["min_tokens"]) == (46, 6)
    assert (body["temperature"], body["seed"], body["stop"]) == (0.5, 3, ["END"])


def test_a_vllm_node_is_asked_to_keep_stop_strings_and_a_torch_node_is_not() -> None:
    assert _continuation(CHAT, "vllm")["include_stop_str_in_output"] is True
    assert "include_stop_str_in_output" not in _continuation(CHAT, "torch")
    without_stops = {k: v for k, v in CHAT.items() if k != "stop"}
    assert "include_stop_str_in_output" not in _continuation(without_stops, "vllm")


def test_what_a_node_registered_it_can_do_decides_not_its_engines_name() -> None:
    # A vLLM node that says it cannot, and a torch node that says it can (an engine that grew
    # the field): the capability decides. A node of an older agent said nothing: its kind's.
    assert "include_stop_str_in_output" not in _continuation(CHAT, "vllm", [])
    can = [NodeCapability.STOP_STRING_IN_OUTPUT]
    assert _continuation(CHAT, "torch", can)["include_stop_str_in_output"] is True
