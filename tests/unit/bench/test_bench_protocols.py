"""bench.protocols' pieces that need no server: the KServe request its gRPC client builds is
one the router reads as meant, its reading of responses and WebSocket events, and the
stand-in node's chat stream is one the router turns into a completed Responses stream."""

from __future__ import annotations

from bench.protocol_load import _event_type, _sse_text, text_output
from bench.protocols import chat_stream_answer
from chaos.protocols import infer_request
from geo_router.forwarding.migration.responses_stream import ResponsesEvents
from geo_router.ingress.kserve.tensors import read_request, response
from geo_router.sse import split_events


def test_the_infer_request_reads_as_a_generation_of_new_text() -> None:
    g = read_request(infer_request("m", "the sea is", {"max_tokens": 16, "temperature": 0}, stream=True,
                                   request_id="r1"))
    assert (g.model, g.request_id, g.prompt, g.stream, g.include_prompt) == ("m", "r1", "the sea is", True, False)
    assert g.sampling == {"max_tokens": 16, "temperature": 0.0}
    assert not read_request(infer_request("m", "x", {}, stream=False)).stream


def test_text_output_reads_the_router_s_response() -> None:
    g = read_request(infer_request("m", "x", {}, stream=False))
    assert text_output(response(g, " ok", finish_reason="stop")) == " ok"
    assert text_output(response(g, "")) == ""


def test_event_type_reads_the_front_of_compact_json_and_parses_any_other() -> None:
    assert _event_type('{"type":"response.output_text.delta","delta":"\\"type\\":\\"error\\""}') == \
        "response.output_text.delta"
    assert _event_type('{ "sequence_number": 3, "type": "response.completed"}') == "response.completed"


def test_sse_text_of_each_kind() -> None:
    assert _sse_text(b'{"choices":[{"text":" a"}]}', "chunks") == " a"
    assert _sse_text(b'{"choices":[{"delta":{"role":"assistant","content":""}}]}', "chunks") == ""
    assert _sse_text(b'{"choices":[{"delta":{"content":" b"}}]}', "chunks") == " b"
    assert _sse_text(b'{"type":"response.output_text.delta","delta":" c"}', "responses") == " c"
    assert _sse_text(b'{"type":"response.created","response":{}}', "responses") == ""
    assert _sse_text(b"[DONE]", "chunks") == ""


def test_the_stand_in_chat_stream_is_a_completed_responses_stream() -> None:
    events = ResponsesEvents({})
    out = events.feed(chat_stream_answer().encode())
    sent = [data for _, data in split_events(out) if data is not None]
    assert [e["type"] for e in sent][-1] == "response.completed"
    assert "".join(e["delta"] for e in sent if e["type"] == "response.output_text.delta") == " ok"
    assert sent[-1]["response"]["usage"]["output_tokens"] == 1
    assert sent[-1]["response"]["status"] == "completed"
