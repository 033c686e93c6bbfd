"""What a Responses WebSocket connection sends for each turn, and what it answers with:
geo_router.ingress.websocket.conversation and .events, without a socket."""

from __future__ import annotations

import json

import pytest

from geo_router.errors import BadRequest, RateLimited
from geo_router.ingress.websocket.conversation import (
    Conversation,
    ConversationTooLarge,
    PreviousResponseNotFound,
)
from geo_router.ingress.websocket.events import (
    answered_error,
    error_message,
    socket_message,
    warm_up_messages,
)

ANSWER = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
          "content": [{"type": "output_text", "text": "waves", "annotations": []}]}


def _create(**fields: object) -> dict[str, object]:
    return {"type": "response.create", "model": "m", **fields}


def test_a_turn_is_a_streamed_request_without_the_socket_fields() -> None:
    turn = Conversation().prepare(_create(input="hi", stream_id="a", generate=True, stream=False))
    assert turn.payload == {"model": "m", "input": [{"type": "message", "role": "user", "content": "hi"}],
                            "stream": True}
    assert turn.lane == "a" and turn.generate


def test_continuing_the_previous_response_sends_the_whole_conversation() -> None:
    conversation = Conversation()
    first = conversation.prepare(_create(input="sea", instructions="poet", store=False))
    conversation.record(first, {"id": "resp_1", "output": [{**ANSWER, "extra": "dropped"}]})
    second = conversation.prepare(_create(input=[{"role": "user", "content": "more"}], previous_response_id="resp_1"))
    assert "previous_response_id" not in second.payload
    assert second.payload["input"] == [{"type": "message", "role": "user", "content": "sea"}, ANSWER,
                                       {"role": "user", "content": "more"}]
    # Instructions are the turn's own, as in the HTTP API: the first turn's do not carry over.
    assert "instructions" not in second.payload


def test_only_the_most_recent_response_of_a_lane_is_kept() -> None:
    conversation = Conversation()
    first = conversation.prepare(_create(input="a"))
    conversation.record(first, {"id": "resp_1", "output": [ANSWER]})
    conversation.record(conversation.prepare(_create(input="b", previous_response_id="resp_1")),
                        {"id": "resp_2", "output": [ANSWER]})
    with pytest.raises(PreviousResponseNotFound):
        conversation.prepare(_create(input="c", previous_response_id="resp_1"))
    # Lanes are separate conversations.
    with pytest.raises(PreviousResponseNotFound):
        conversation.prepare(_create(input="c", previous_response_id="resp_2", stream_id="other"))


def test_a_stored_response_from_elsewhere_goes_to_the_node_as_named() -> None:
    stored = "resp_abc.bm9kZQ.MAC"  # geo_router.ingress.responses' wrapped id of a node's stored response
    turn = Conversation().prepare(_create(input="c", previous_response_id=stored))
    assert turn.payload["previous_response_id"] == stored


def test_a_warm_up_records_its_input_for_the_next_turn() -> None:
    conversation = Conversation()
    warm = conversation.prepare(_create(input="context", generate=False, tools=[]))
    response = conversation.warm_up(warm)
    assert response["output"] == [] and response["status"] == "completed"
    events = warm_up_messages(response, None)
    assert [e["type"] for e in events] == ["response.created", "response.completed"]
    turn = conversation.prepare(_create(input="go", previous_response_id=response["id"]))
    assert [i["content"] for i in turn.payload["input"]] == ["context", "go"]


@pytest.mark.parametrize("event,param", [
    ({"type": "response.cancel"}, "type"),
    (_create(background=True), "background"),
    (_create(generate="no"), "generate"),
    (_create(stream_id=""), "stream_id"),
    (_create(input=3), "input"),
    (_create(previous_response_id=7), "previous_response_id"),
])
def test_bad_events_are_bad_requests_naming_the_field(event: dict[str, object], param: str) -> None:
    with pytest.raises(BadRequest) as bad:
        Conversation().prepare(event)
    assert bad.value.param == param and bad.value.status == 400


def test_a_connection_holds_a_bounded_number_of_lanes() -> None:
    conversation = Conversation(max_lanes=2)
    for lane in ("a", "b"):
        conversation.record(conversation.prepare(_create(input="x", stream_id=lane)), {"id": f"resp_{lane}"})
    with pytest.raises(BadRequest, match="at most 2"):
        conversation.prepare(_create(input="x", stream_id="c"))
    assert conversation.prepare(_create(input="x", stream_id="a")).lane == "a"


def test_a_lane_remembers_at_most_its_cap_and_a_refused_turn_changes_nothing() -> None:
    conversation = Conversation(max_lane_bytes=2_000)
    first = conversation.prepare(_create(input="a" * 900))
    response = conversation.warm_up(first)
    held = conversation.held
    assert held == len(first.body)
    second = conversation.prepare(_create(input="b" * 1200, previous_response_id=response["id"]))
    with pytest.raises(ConversationTooLarge) as refused:
        conversation.room_for(second)
    assert refused.value.code == "conversation_too_large" and refused.value.status == 400
    assert refused.value.param == "input" and "2000 bytes" in refused.value.message
    # The lane still continues from the first turn.
    assert conversation.holds(None) == response["id"] and conversation.held == held


def test_the_lanes_of_a_connection_share_its_cap() -> None:
    conversation = Conversation(max_lane_bytes=2_000, max_socket_bytes=3_200)
    for lane in ("a", "b"):
        conversation.warm_up(conversation.prepare(_create(input="x" * 1400, stream_id=lane)))
    third = conversation.prepare(_create(input="x" * 1400, stream_id="c"))
    with pytest.raises(ConversationTooLarge, match="3200 bytes per connection"):
        conversation.room_for(third)
    # A lane's new conversation replaces its old one in the count.
    conversation.warm_up(conversation.prepare(_create(input="x", stream_id="a")))
    conversation.room_for(third)


def test_an_answer_that_takes_its_lane_past_the_cap_is_not_kept() -> None:
    conversation = Conversation(max_lane_bytes=2_000)
    turn = conversation.prepare(_create(input="short"))
    conversation.room_for(turn)
    long_answer = {**ANSWER, "content": [{"type": "output_text", "text": "w" * 3000, "annotations": []}]}
    conversation.record(turn, {"id": "resp_long", "output": [long_answer]})
    assert conversation.held == 0
    # Continuing it says why it cannot be, not that it was never there.
    with pytest.raises(ConversationTooLarge) as refused:
        conversation.prepare(_create(input="more", previous_response_id="resp_long"))
    assert refused.value.param == "previous_response_id"


def test_streamed_events_become_messages_with_the_lane() -> None:
    created = {"type": "response.created", "sequence_number": 0}
    broke = {"error": {"message": "broke", "type": "server_error", "code": "upstream_disconnected"}}
    assert [socket_message(e, "lane") for e in (created, broke)] == [
        {"type": "response.created", "sequence_number": 0, "stream_id": "lane"},
        {"type": "error", "stream_id": "lane",
         "error": {"message": "broke", "type": "server_error", "code": "upstream_disconnected"}}]


def test_errors_carry_status_code_and_retry_after() -> None:
    limited = error_message(RateLimited("slow down", limit="requests", retry_after_s=7,
                                        headers={"retry-after": "7", "x-secret": "no"}), None)
    assert limited["type"] == "error" and limited["status"] == 429
    assert limited["error"]["headers"] == {"retry-after": "7"} and limited["error"]["type"] == "requests"
    node = answered_error(503, json.dumps({"error": {"message": "busy", "type": "server_error",
                                                     "code": "overloaded"}}).encode(), {"retry-after": "2"}, "x")
    assert node["status"] == 503 and node["error"]["code"] == "overloaded" and node["stream_id"] == "x"
    garbled = answered_error(502, b"<html>", {}, None)
    assert garbled["status"] == 502 and garbled["error"]["type"] == "server_error"
