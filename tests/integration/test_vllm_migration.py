"""Stream migration on real vLLM (its CPU build): the router resumes a broken stream exactly.

One vLLM node serves the module (its start costs ~50 s); the router reaches it as `near`
through a fault proxy and as `far` directly (migration_fabric). Greedy streams cut by a
connection reset at several points must come out token-identical to unbroken runs: the
router continues from vLLM's own `return_token_ids` with a /v1/completions request whose
prompt is the token ids, and asks vLLM's /detokenize for text held back at the seam.

Tool calls: the node loads a test-only logits processor (script_logits.py) that makes a
request write a given pythonic call list, so vLLM's own pythonic parser streams real
tool-call deltas; a stream broken inside them must give the client the same calls. The
routing table says what the node's spec says: it reads tool calls as pythonic. Advertised
as another parser, the same node's tool-call streams are not resumed.

The router's other protocols reach the same vLLM node here (its start is this module's):
`openai`'s Responses WebSocket mode (a turn continuing an unstored one, a node killed within
a turn) and `tritonclient.grpc` on the KServe v2 endpoint (infer and a stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import tritonclient.grpc.aio as triton
from migration_fabric import PACE_BYTES_PER_S, MigrationRig, Streamed, migration_rig, stream, stream_response
from protocol_clients import (
    HEADERS,
    completion_text,
    openai_client,
    text_of,
    triton_inputs,
    triton_stream,
    triton_text,
    turn,
    whole_conversation_text,
)
from tenant_fabric import MODEL, TenantFabric
from tokenizers import Tokenizer
from vllm_fabric import require_vllm, vllm_fabric

from data_plane.engine.vllm.spec import load_deployment_spec
from data_plane.model.make_tiny import EOT_TOKEN

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "write a long poem about the sea"}],
        "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}}
COMPLETION = {"model": MODEL, "prompt": "the sea is", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
              "stream": True}


SCRIPT = '[get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]'
CALLS = [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"zone": "CET"}')]
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {p: {"type": "string"} for p in params}}}}
    for name, params in (("get_weather", ("city", "unit")), ("get_time", ("zone",)))]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-migration")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(root: Path) -> AsyncIterator[TenantFabric]:
    require_vllm()
    plugin = ["--logits-processors", "script_logits:ScriptLogitsProcessor"]
    async with vllm_fabric(root, vllm_args=plugin, vllm_env={"PYTHONPATH": str(Path(__file__).parent)}) as fabric:
        yield fabric


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(node: TenantFabric, root: Path) -> AsyncIterator[MigrationRig]:
    # As the node registers it: the parser its deployment spec runs vLLM with.
    parser = load_deployment_spec(root / "spec.json").tool_call_parser
    assert parser == "pythonic"
    async with migration_rig(node.node_url, root / "router.jsonl", engine="vllm", tool_call_parser=parser,
                             grpc_port=0) as r:
        yield r


@pytest.fixture(scope="module")
def tool_chat(rig: MigrationRig, root: Path) -> dict[str, Any]:
    """A chat request with tools whose answer is SCRIPT (the processor writes it)."""
    tokenizer = Tokenizer.from_file(str(root / MODEL / "tokenizer.json"))
    script = tokenizer.encode(SCRIPT, add_special_tokens=False).ids
    assert tokenizer.decode(script) == SCRIPT
    return {**CHAT, "ignore_eos": False, "max_tokens": 200, "tools": TOOLS,
            "vllm_xargs": {"script": script, "script_end": tokenizer.token_to_id(EOT_TOKEN)}}


def tool_calls(got: Streamed) -> list[tuple[str, str]]:
    """The calls as a client assembles them (each index is started once, with an id)."""
    calls: dict[int, list[str]] = {}
    for e in got.events:
        for c in e.get("choices", []):
            for d in (c.get("delta") or {}).get("tool_calls") or []:
                if d.get("id"):
                    assert d["index"] not in calls and d["id"].startswith("chatcmpl-tool-")
                    calls[d["index"]] = [d["function"]["name"], ""]
                calls[d["index"]][1] += d["function"].get("arguments") or ""
    return [(calls[i][0], calls[i][1]) for i in sorted(calls)]


def finish_reason(got: Streamed) -> str | None:
    return next((c["finish_reason"] for e in got.events for c in e.get("choices", []) if c.get("finish_reason")),
                None)


@pytest.mark.parametrize("break_after", [1, 20, 50])
async def test_a_vllm_chat_stream_resumes_token_identical(rig: MigrationRig, break_after: int) -> None:
    unbroken = await stream(rig, "/v1/chat/completions", CHAT)
    assert unbroken.done and len(unbroken.token_ids) == 64
    got = await stream(rig, "/v1/chat/completions", CHAT, break_after=break_after)
    assert got.error is None and got.done
    assert got.token_ids == unbroken.token_ids and got.text == unbroken.text
    assert len({e["id"] for e in got.events}) == 1
    assert got.trailer is not None and got.trailer["node"] == "far"
    assert got.events[-1]["usage"]["completion_tokens"] == 64


async def test_a_vllm_completion_resumes_with_the_ids_hidden_from_a_client_that_did_not_ask(rig: MigrationRig) -> None:
    unbroken = await stream(rig, "/v1/completions", {**COMPLETION, "return_token_ids": True})
    got = await stream(rig, "/v1/completions", COMPLETION, break_after=None)
    assert got.token_ids == [] and got.text == unbroken.text
    # The break needs ids to count events by: count on a stream that asked, compare text.
    broken = await stream(rig, "/v1/completions", {**COMPLETION, "return_token_ids": True}, break_after=30)
    assert broken.error is None and broken.text == unbroken.text and broken.token_ids == unbroken.token_ids
    assert broken.trailer is not None and broken.trailer["migrations"] == 1


async def test_a_stop_string_two_vllm_tokens_make_stops_across_the_seam(rig: MigrationRig) -> None:
    body = {**COMPLETION, "return_token_ids": True}
    unbroken = await stream(rig, "/v1/completions", body)
    texts = [c.get("text") or "" for e in unbroken.events for c in e["choices"]]
    k = next(i for i in range(20, 40) if len(texts[i]) >= 2 and len(texts[i + 1]) >= 2)
    stop = texts[k][-2:] + texts[k + 1][:2]  # a stop string that two tokens make
    body["stop"] = [stop]
    stopped = await stream(rig, "/v1/completions", body)
    assert stopped.text == unbroken.text[: unbroken.text.find(stop)] and stopped.text
    # Broken before the stop string (with its start in the text vLLM holds back) and inside
    # it: the text stops where the unbroken one did, with the same ids. A break this close
    # to the end can land after the node sent everything (nothing to migrate: seen at k - 1
    # once, vLLM having streamed the rest into the socket first), so every break must give
    # the same answer and at least one of them must have moved.
    moved = 0
    for at in (k - 2, k - 1, k):
        got = await stream(rig, "/v1/completions", body, break_after=at)
        assert got.error is None and got.done, at
        assert got.text == stopped.text and got.token_ids == stopped.token_ids, at
        moved += got.trailer is not None and got.trailer["migrations"] == 1
        assert [c["finish_reason"] for e in got.events for c in e["choices"] if c.get("finish_reason")] == ["stop"]
    assert moved >= 1


async def test_a_seeded_sampled_vllm_stream_keeps_its_shape_and_exact_token_count(rig: MigrationRig) -> None:
    # Sampled tokens after the seam come from the continuation's own seeded generator, so
    # they differ from an unbroken run's; the stream must still be whole and count exactly.
    body = {**CHAT, "temperature": 1.0, "seed": 7, "max_tokens": 40}
    got = await stream(rig, "/v1/chat/completions", body, break_after=15)
    assert got.error is None and got.done
    assert got.trailer is not None and got.trailer["migrations"] == 1
    assert len({e["id"] for e in got.events}) == 1
    assert len(got.token_ids) == 40 == got.events[-1]["usage"]["completion_tokens"]
    assert [c["finish_reason"] for e in got.events for c in e["choices"] if c.get("finish_reason")] == ["length"]


async def test_a_vllm_tool_call_stream_resumes_with_the_same_calls(rig: MigrationRig, tool_chat: dict[str, Any]) -> None:
    unbroken = await stream(rig, "/v1/chat/completions", tool_chat)
    assert unbroken.error is None and tool_calls(unbroken) == CALLS and finish_reason(unbroken) == "tool_calls"
    tokens = len(tool_chat["vllm_xargs"]["script"]) + 1  # and EOS
    assert unbroken.events[-1]["usage"]["completion_tokens"] == tokens == len(unbroken.token_ids)
    # vLLM streams the arguments as they come, so a break can land inside them.
    events = _token_events(unbroken)
    argued = [n for n, e in enumerate(events, 1) if any(
        not d.get("id") and d["function"].get("arguments") for d in e["choices"][0]["delta"].get("tool_calls") or [])]
    assert len(argued) >= 5, "vLLM did not stream the arguments"
    sent = ["".join(_arguments(e) for e in events[:n]) for n in range(1, len(events) + 1)]
    # The first value's quote is open: the break falls inside an argument's value.
    inside_value = next(n for n, text in enumerate(sent, 1) if '"city": "' in text)
    assert not sent[inside_value - 1].startswith('{"city": "Paris",')
    for break_after in sorted({1, 3, argued[0], inside_value, len(events) // 2, len(events) - 6}):
        got = await stream(rig, "/v1/chat/completions", tool_chat, break_after=break_after)
        assert got.error is None and got.done, (break_after, got.error)
        assert tool_calls(got) == CALLS, break_after
        assert finish_reason(got) == "tool_calls" and got.token_ids == unbroken.token_ids
        assert got.events[-1]["usage"]["completion_tokens"] == tokens
        assert got.trailer is not None and got.trailer["node"] == "far", break_after


@pytest.mark.parametrize("advertised", ["hermes", None])
async def test_a_vllm_tool_call_stream_from_a_node_advertising_another_parser_is_not_replayed(
        node: TenantFabric, root: Path, tool_chat: dict[str, Any], advertised: str | None) -> None:
    async with migration_rig(node.node_url, root / f"router-{advertised}.jsonl", engine="vllm",
                             tool_call_parser=advertised) as other:
        got = await stream(other, "/v1/chat/completions", tool_chat, break_after=3)
    assert got.error is not None and got.error["code"] == "upstream_disconnected" and not got.done
    assert "format that cannot be resumed" in got.error["message"]
    assert got.trailer is None


def _token_events(got: Streamed) -> list[dict[str, Any]]:
    return [e for e in got.events if e["choices"] and e["choices"][0].get("token_ids")]


def _arguments(event: dict[str, Any]) -> str:
    return "".join(d["function"].get("arguments") or "" for d in event["choices"][0]["delta"].get("tool_calls") or [])


RESPONSE = {"model": MODEL, "input": "write a long poem about the sea", "instructions": "you are a poet",
            "max_output_tokens": 64, "temperature": 0, "store": False, "extra_body": {"ignore_eos": True}}


async def test_a_plain_responses_stream_is_vllms_own_answer_in_vllms_own_events(rig: MigrationRig) -> None:
    # store=True keeps the request vLLM's own (its Responses stream); store=False is served
    # as chat and written back by the router: the same prompt, answer and event shapes.
    own = await stream_response(rig, {**RESPONSE, "store": True})
    ours = await stream_response(rig, RESPONSE)
    assert ours.text == own.text and ours.text
    assert _runs(ours.types) == _runs(own.types)  # deltas may come bundled: their count varies
    mine, theirs = ours.completed.response, own.completed.response
    assert (mine.usage.input_tokens, mine.usage.output_tokens) == (theirs.usage.input_tokens, 64)
    assert (mine.status, mine.incomplete_details, mine.output_text) == (
        theirs.status, theirs.incomplete_details, theirs.output_text)
    for kind in set(own.types):  # the same fields, at every depth, as vLLM's own events
        (a, *_), (b, *_) = ([e for e in s.events if e.type == kind] for s in (ours, own))
        assert _fields(a.model_dump(exclude_unset=True)) == _fields(b.model_dump(exclude_unset=True)) - _VLLM_ONLY


# vLLM's own extras (its per-request metadata, per-turn usage): not the Responses API's.
_VLLM_ONLY = {"response." + k for k in ("input_messages", "output_messages", "kv_transfer_params",
                                          "ec_transfer_params")} | {
    f"response.usage.{k}" for k in ("input_tokens_details.cache_write_tokens",
                                    "input_tokens_details.input_tokens_per_turn",
                                    "input_tokens_details.cached_tokens_per_turn",
                                    "output_tokens_details.tool_output_tokens",
                                    "output_tokens_details.output_tokens_per_turn",
                                    "output_tokens_details.tool_output_tokens_per_turn")}


def _runs(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def _fields(value: object, path: str = "") -> set[str]:
    if isinstance(value, dict):
        return {f for k, v in value.items() for f in {path + k} | _fields(v, path + k + ".")}
    if isinstance(value, list) and value:
        return _fields(value[0], path)
    return set()


@pytest.mark.parametrize("break_after", [1, 25, 40])
async def test_a_vllm_responses_stream_resumes_token_identical(rig: MigrationRig, break_after: int) -> None:
    unbroken = await stream_response(rig, RESPONSE)
    got = await stream_response(rig, RESPONSE, break_after=break_after)
    # vLLM bundles tokens into one delta when its output lags the engine: the number of
    # deltas varies from run to run, their order and the text do not.
    assert got.text == unbroken.text and _runs(got.types) == _runs(unbroken.types)
    usage = got.completed.response.usage
    assert (usage.input_tokens, usage.output_tokens) == (unbroken.completed.response.usage.input_tokens, 64)
    assert len({e.response.id for e in got.events if hasattr(e, "response")}) == 1
    assert [e.sequence_number for e in got.events] == list(range(len(got.events)))
    trailer = (got.completed.model_extra or {}).get("meridian")
    assert trailer is not None and trailer["node"] == "far" and trailer["migrations"] == 1


# --- the other protocols, to the same vLLM node -----------------------------------------

FIRST = {"model": MODEL, "input": "write a long poem about the sea", "max_output_tokens": 32, "temperature": 0,
         "store": False, "ignore_eos": True}
SECOND = {"model": MODEL, "input": "and now the mountains", "max_output_tokens": 32, "temperature": 0,
          "store": False, "ignore_eos": True}


async def test_a_vllm_websocket_turn_continues_an_unstored_one(rig: MigrationRig) -> None:
    async with openai_client(rig) as client, client.responses.connect() as conn:
        first = await turn(conn, FIRST)
        second = await turn(conn, {**SECOND, "previous_response_id": first[-1].response.id})
        rig.proxy.set_bandwidth(PACE_BYTES_PER_S, "downstream")
        try:
            broken = await turn(conn, FIRST, on_delta=lambda n: n == 10 and rig.proxy.reset())
        finally:
            rig.proxy.heal()
    assert first[-1].type == second[-1].type == "response.completed", (first[-1], second[-1])
    assert text_of(second) == await whole_conversation_text(rig, FIRST, first[-1].response.output_text, SECOND)
    assert broken[-1].type == "response.completed" and text_of(broken) == text_of(first)
    trailer = (broken[-1].model_extra or {}).get("meridian")
    assert trailer is not None and trailer["migrations"] == 1


async def test_vllm_over_kserve_grpc_infer_and_stream(rig: MigrationRig) -> None:
    sampling = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    expected = await completion_text(rig, "the sea is", sampling)
    async with triton.InferenceServerClient(f"127.0.0.1:{rig.grpc_port}") as client:
        result = await client.infer(MODEL, triton_inputs(triton, "the sea is", sampling, stream=False, exclude=True),
                                    headers=HEADERS)
    assert result.as_numpy("text_output")[0].decode() == expected and expected
    results = await asyncio.to_thread(triton_stream, f"127.0.0.1:{rig.grpc_port}", "the sea is", sampling)
    assert triton_text(results) == expected and len(results) > 3

