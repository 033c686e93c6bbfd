"""The Responses API's WebSocket mode through a real router to a real torch node, with the
official `openai` client (`client.responses.connect()`).

A conversation of two turns on one socket, the second continuing the first with `store:
false`, must say what the same conversation sent whole over HTTP says (greedy decoding);
a node killed between the turns or within one must cost the client nothing; a warm-up
(`generate: false`) is continued like any response; a bad event is answered with an
`error` event and the socket stays usable; a bad key gets no socket.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import websockets
from migration_fabric import CAROL, PACE_BYTES_PER_S, MigrationRig, stream_response, torch_rig
from protocol_clients import as_http, openai_client, text_of, turn, whole_conversation_text
from tenant_fabric import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

FIRST = {"model": MODEL, "input": "write a long poem about the sea", "instructions": "you are a poet",
         "max_output_tokens": 24, "temperature": 0, "store": False, "ignore_eos": True}
SECOND = {"model": MODEL, "input": "and now one about the mountains", "max_output_tokens": 24,
          "temperature": 0, "store": False, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MigrationRig]:
    async with torch_rig(tmp_path_factory.mktemp("websocket"), inter_token_timeout_s=1.0) as r:
        yield r


async def _reference(rig: MigrationRig, first: list[Any]) -> str:
    return await whole_conversation_text(rig, FIRST, first[-1].response.output_text, SECOND)


async def test_two_turns_on_one_socket_continue_an_unstored_response(rig: MigrationRig) -> None:
    async with openai_client(rig) as client, client.responses.connect() as conn:
        first = await turn(conn, FIRST)
        assert first[-1].type == "response.completed", first[-1]
        assert first[0].type == "response.created" and text_of(first)
        second = await turn(conn, {**SECOND, "previous_response_id": first[-1].response.id})
    assert second[-1].type == "response.completed", second[-1]
    # The second turn's prompt held the first turn (its input and answer): it says what the
    # whole conversation sent at once over HTTP says.
    assert text_of(second) == await _reference(rig, first)
    used = second[-1].response.usage
    assert used.input_tokens > first[-1].response.usage.total_tokens
    # Every event is the HTTP stream's, one response id per turn.
    assert len({e.response.id for e in second if hasattr(e, "response")}) == 1
    assert first[-1].response.id != second[-1].response.id


async def test_a_node_killed_between_turns_costs_the_second_turn_nothing(rig: MigrationRig) -> None:
    async with openai_client(rig) as client, client.responses.connect() as conn:
        first = await turn(conn, FIRST)
        rig.proxy.reset()  # `near`, the clients' region, dies: its connections and new ones reset
        try:
            second = await turn(conn, {**SECOND, "previous_response_id": first[-1].response.id})
        finally:
            rig.proxy.heal()
        expected = await _reference(rig, first)
    assert second[-1].type == "response.completed", second[-1]
    assert text_of(second) == expected


async def test_a_node_killed_within_a_turn_resumes_on_another(rig: MigrationRig) -> None:
    async with openai_client(rig) as client, client.responses.connect() as conn:
        unbroken = await turn(conn, FIRST)
        rig.proxy.set_bandwidth(PACE_BYTES_PER_S, "downstream")  # the break lands mid-answer
        try:
            broken = await turn(conn, FIRST, on_delta=lambda n: n == 9 and rig.proxy.reset())
        finally:
            rig.proxy.heal()
        # The socket goes on after a migrated turn, continuing the migrated response.
        after = await turn(conn, {**SECOND, "previous_response_id": broken[-1].response.id})
    assert broken[-1].type == "response.completed", broken[-1]
    assert text_of(broken) == text_of(unbroken)
    trailer = (broken[-1].model_extra or {}).get("meridian")
    assert trailer is not None and trailer["migrations"] == 1 and trailer["node"] == "far"
    assert after[-1].type == "response.completed" and text_of(after) == await _reference(rig, unbroken)


async def test_a_warm_up_is_continued_like_a_response(rig: MigrationRig) -> None:
    async with openai_client(rig) as client, client.responses.connect() as conn:
        warm = await turn(conn, {"model": MODEL, "input": FIRST["input"], "generate": False, "store": False})
        assert [e.type for e in warm] == ["response.created", "response.completed"]
        assert warm[-1].response.output == []
        warmed = await turn(conn, {**SECOND, "input": [], "previous_response_id": warm[-1].response.id})
    # Continuing the warm-up is the same as sending its input with the turn.
    alone = await stream_response(rig, as_http({**SECOND, "input": FIRST["input"]}))
    assert warmed[-1].type == "response.completed" and text_of(warmed) == alone.text


async def test_bad_events_get_error_events_and_the_socket_stays_usable(rig: MigrationRig) -> None:
    async with openai_client(rig) as client, client.responses.connect() as conn:
        unknown = await turn(conn, {"model": "no-such-model", "input": "hi", "store": False})
        assert unknown[-1].type == "error" and unknown[-1].status == 404
        assert unknown[-1].error.code == "model_not_found"
        stale = await turn(conn, {**SECOND, "previous_response_id": "resp_0123456789abcdef"})
        assert stale[-1].type == "error" and stale[-1].error.code == "previous_response_not_found"
        background = await turn(conn, {**FIRST, "background": True})
        assert background[-1].type == "error" and background[-1].error.param == "background"
        ok = await turn(conn, FIRST)
    assert ok[-1].type == "response.completed" and text_of(ok)


async def test_messages_that_are_not_events_are_answered_not_fatal(rig: MigrationRig) -> None:
    url = rig.router_url.replace("http://", "ws://") + "/v1/responses"
    async with websockets.connect(url, additional_headers={"authorization": f"Bearer {CAROL.key}"}) as ws:
        await ws.send("not json")
        answer = json.loads(await ws.recv())
        assert answer["type"] == "error" and answer["status"] == 400
        await ws.send(json.dumps({"type": "session.update"}))
        answer = json.loads(await ws.recv())
        assert answer["type"] == "error" and answer["error"]["param"] == "type"
        await ws.send(json.dumps({"type": "response.create", "stream_id": "lane-a", **FIRST}))
        events = []
        while not events or events[-1]["type"] != "response.completed":
            events.append(json.loads(await ws.recv()))
    assert {e.get("stream_id") for e in events} == {"lane-a"}


async def test_a_bad_key_gets_no_socket(rig: MigrationRig) -> None:
    url = rig.router_url.replace("http://", "ws://") + "/v1/responses"
    with pytest.raises(websockets.InvalidStatus) as refused:
        async with websockets.connect(url, additional_headers={"authorization": "Bearer sk-wrong"}):
            pass
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"
