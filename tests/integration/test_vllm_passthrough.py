"""vLLM's whole API through the fabric, against real vLLM (its CPU build), with the
official clients: what a vLLM node serves reaches tenants through the router unchanged.

The node passes requests through to vLLM (data_plane/server/passthrough.py); the router
authenticates (Bearer or x-api-key), salts, charges and routes them, and pins stored
responses to their replica (geo_router/ingress/responses.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio
from otlp_collector import OtlpCollector
from router_harness import CLUSTER_TOKEN, ServerGroup
from tenant_fabric import MODEL, TenantFabric, node_settings
from token_ids_contract import (
    REPLACEMENT_CHAR,
    continued,
    detokenize,
    has_no_ids,
    ids_in,
    layout,
    sse,
    stop_across_chunks,
    stream,
)
from vllm_fabric import ADAPTER, ALICE, BOB, WEATHER, require_vllm, vllm_fabric, write_spec

from data_plane.engine.vllm.command import default_vllm_python
from data_plane.model.make_tiny import VLLM_CPU_ARCH
from data_plane.server.app import create_app as create_node_app
from meridian.http_server import SERVER_KEEPALIVE_S
from meridian.tokenizer import ChatTokenizer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def collector() -> Iterator[OtlpCollector]:
    with OtlpCollector() as c:
        yield c


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fabric(tmp_path_factory: pytest.TempPathFactory, collector: OtlpCollector) -> AsyncIterator[TenantFabric]:
    """The module's one vLLM node; the router and the node (so vLLM too) trace to `collector`."""
    require_vllm()
    root = tmp_path_factory.mktemp("vllm")
    # vLLM's span exporter batches for 5 s by default; the tracing test need not wait that long.
    spec = write_spec(root / "traced-spec.json",
                      env={"VLLM_ENABLE_RESPONSES_API_STORE": "1", "OTEL_BSP_SCHEDULE_DELAY": "200"})
    tracing = {"otlp_endpoint": collector.url}
    async with vllm_fabric(root, router=tracing, deployment_spec_file=spec, **tracing) as f:
        yield f


def oai(fabric: TenantFabric, key: str = ALICE.key) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=fabric.router_url + "/v1", api_key=key, max_retries=0, timeout=120)


async def test_chat_streams_with_its_usage_chunk_and_completions_answer(fabric: TenantFabric) -> None:
    client = oai(fabric)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 5
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=5, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content, "greedy: the stream says what the whole answer said"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    completion = await client.completions.create(model=MODEL, prompt="The river", max_tokens=4)
    assert completion.usage is not None and completion.usage.completion_tokens == 4


async def test_vllms_own_span_joins_the_trace_under_the_nodes_span(
        fabric: TenantFabric, collector: OtlpCollector) -> None:
    trace_id = secrets.token_hex(16)
    header = f"00-{trace_id}-{secrets.token_hex(8)}-01"
    chat = await oai(fabric).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Trace me"}], max_tokens=3, temperature=0,
        extra_headers={"traceparent": header})
    await asyncio.to_thread(fabric.state.tracing.flush)
    await asyncio.to_thread(fabric.node.state.tracing.flush)
    await asyncio.to_thread(collector.wait_for, lambda: any(
        s.name == "llm_request" for s in collector.trace(trace_id)), 30.0)
    spans = {s.name: s for s in collector.trace(trace_id)}
    router, node, vllm = (spans["router POST /v1/chat/completions"], spans["node POST /v1/chat/completions"],
                          spans["llm_request"])
    assert (router.service, node.service, vllm.service) == ("meridian-router", "meridian-node", "vllm")
    assert node.parent_span_id == router.span_id
    assert vllm.parent_span_id == node.span_id, "vLLM continues the node's traceparent"
    assert chat.usage is not None
    assert vllm.attributes["gen_ai.usage.completion_tokens"] == chat.usage.completion_tokens == 3
    assert vllm.attributes["gen_ai.usage.prompt_tokens"] == chat.usage.prompt_tokens
    assert vllm.attributes["gen_ai.request.max_tokens"] == 3
    # vLLM names the request after the fabric's request id (the node passes x-request-id).
    assert vllm.attributes["gen_ai.request.id"].endswith(router.attributes["meridian.request_id"])


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}},
    "required",
])
async def test_a_forced_tool_call_has_arguments_valid_against_the_functions_schema(
    fabric: TenantFabric, tool_choice: object
) -> None:
    answer = await oai(fabric).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris for two days?"}],
        tools=[WEATHER], tool_choice=tool_choice, max_tokens=100, seed=7)  # type: ignore[arg-type]
    calls = answer.choices[0].message.tool_calls
    assert calls, f"no tool call: {answer.choices[0]}"
    call = calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


async def test_response_format_json_schema_returns_json_valid_against_it(fabric: TenantFabric) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                               "confidence": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "confidence"], "additionalProperties": False}
    answer = await oai(fabric).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), schema)


async def test_responses_stream_and_continue_on_the_replica_that_stored_them(fabric: TenantFabric) -> None:
    client = oai(fabric)
    first = await client.responses.create(model=MODEL, input="Tell me about rivers", max_output_tokens=5)
    assert first.usage is not None and first.usage.output_tokens == 5
    # The id names the replica and the tenant; vLLM's own id is inside it.
    assert first.id.startswith("resp_") and first.id.count(".") == 2
    follow = await client.responses.create(
        model=MODEL, input="And lakes?", previous_response_id=first.id, max_output_tokens=5)
    assert follow.previous_response_id == first.id
    assert follow.usage is not None and follow.usage.input_tokens > first.usage.input_tokens, \
        "the follow-up's prompt holds the first turn"
    fetched = await client.responses.retrieve(first.id)
    assert fetched.id == first.id and fetched.output_text == first.output_text
    events = [e async for e in await client.responses.create(
        model=MODEL, input="Tell me about rivers", max_output_tokens=5, stream=True)]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.id == events[0].response.id and events[0].response.id.count(".") == 2


async def test_a_tenant_cannot_reach_another_tenants_stored_response(fabric: TenantFabric) -> None:
    mine = await oai(fabric).responses.create(model=MODEL, input="secret plans", max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        await oai(fabric, BOB.key).responses.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        await oai(fabric, BOB.key).responses.create(
            model=MODEL, input="more", previous_response_id=mine.id, max_output_tokens=3)
    inner = mine.id.split(".")[0]
    with pytest.raises(openai.NotFoundError):  # vLLM's bare id names no replica
        await oai(fabric).responses.retrieve(inner)


async def test_a_lora_adapter_served_by_vllm_answers_under_the_fabrics_name(fabric: TenantFabric) -> None:
    client = oai(fabric)
    adapted = await client.completions.create(model=f"{MODEL}:{ADAPTER}", prompt="The river", max_tokens=8,
                                              temperature=0)
    base = await client.completions.create(model=MODEL, prompt="The river", max_tokens=8, temperature=0)
    assert adapted.usage is not None and adapted.usage.completion_tokens == 8
    assert adapted.choices[0].text != base.choices[0].text, "the adapter changed nothing"
    card = await client.models.retrieve(MODEL)
    assert card.id == MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("no-such-model")


async def test_anthropic_messages_create_and_stream_through_the_router(fabric: TenantFabric) -> None:
    client = anthropic.AsyncAnthropic(base_url=fabric.router_url, api_key=ALICE.key, max_retries=0, timeout=120)
    message = await client.messages.create(
        model=MODEL, max_tokens=5, system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    assert message.usage.output_tokens == 5 and message.content[0].type == "text"
    async with client.messages.stream(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hello"}]) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert final.usage.output_tokens == 5 and final.content[0].text == text  # type: ignore[union-attr]
    counted = await client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello"}])
    assert counted.input_tokens > 0
    # The router's own refusals come in Anthropic's error shape on these routes.
    stranger = anthropic.AsyncAnthropic(base_url=fabric.router_url, api_key="sk-nobody-0123456789", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        await stranger.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert refused.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                             "message": "Incorrect API key provided."}}


async def test_the_node_journals_what_it_served_through_vllm(fabric: TenantFabric) -> None:
    client = oai(fabric)
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         extra_headers={"idempotency-key": "journal-whole"})
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=2, stream=True,
                                                  extra_headers={"idempotency-key": "journal-stream"})
    [c async for c in stream]
    path = fabric.node.state.runtime.settings.request_journal_path
    served = {r["key"]: r for line in path.read_text().splitlines() if (r := json.loads(line))["type"] == "served"}
    assert served["journal-whole"]["completed"] and served["journal-stream"]["completed"]


async def test_the_node_itself_admits_only_routers(fabric: TenantFabric) -> None:
    async with httpx.AsyncClient(base_url=fabric.node_url, timeout=30) as node:
        refused = await node.post("/v1/responses", json={"model": MODEL, "input": "hi"})
        assert refused.status_code == 401


def _children(pid: int) -> list[int]:
    """Direct child processes of `pid` (from /proc: vLLM's engine core is one)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # pid (comm) state ppid ...: comm may hold spaces and parentheses.
            if int(stat.rpartition(")")[2].split()[1]) == pid:
                out.append(int(entry.name))
    return out


# The two tests below change the node for good: they run last in this module.


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def nodes(fabric: TenantFabric) -> AsyncIterator[dict[str, httpx.AsyncClient]]:
    """The module's vLLM node and a torch node on the same checkpoint, as a router reaches
    them (the cluster token), for the assertions both node kinds are held to."""
    settings = fabric.node.state.runtime.settings
    torch_app = create_node_app(node_settings(settings.model_dir, node_id="torch-node", max_model_len=1024,
                                              max_tokens_limit=64))
    servers = ServerGroup()
    try:
        torch_url = await servers.start(torch_app)
        await torch_app.state.runtime.wait_ready()
        auth = {"authorization": f"Bearer {CLUSTER_TOKEN}"}
        async with httpx.AsyncClient(base_url=fabric.node_url, headers=auth, timeout=120) as vllm, \
                httpx.AsyncClient(base_url=torch_url, headers=auth, timeout=120) as torch:
            yield {"vllm": vllm, "torch": torch}
    finally:
        await servers.stop()


CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 4,
             "temperature": 0, "ignore_eos": True}
COMPLETION_BODY = {"model": MODEL, "prompt": "The river city is", "max_tokens": 4, "temperature": 0,
                   "ignore_eos": True}


@pytest.mark.parametrize(("path", "body", "first", "whole"), [
    ("/v1/chat/completions", CHAT_BODY, ["top"], ["top", "ids"]),
    ("/v1/completions", COMPLETION_BODY, ["prompt", "ids"], ["prompt", "ids"]),
])
async def test_return_token_ids_sit_in_the_same_places_on_vllm_and_torch_nodes(
        nodes: dict[str, httpx.AsyncClient], path: str, body: dict[str, object],
        first: list[str], whole: list[str]) -> None:
    asked = {**body, "return_token_ids": True}
    for name, client in nodes.items():
        chunks = await sse(client, path, {**asked, "stream_options": {"include_usage": True}})
        # The prompt's ids first, then generated ids in every chunk (one each on a torch
        # node; vLLM's can hold several), then the usage chunk with none.
        layouts = [layout(c) for c in chunks]
        assert layouts[0] == first and layouts[-1] == [], (name, chunks)
        assert all(where == ["ids"] for where in layouts[1:-1]), (name, chunks)
        assert ids_in(chunks) == chunks[-1]["usage"]["completion_tokens"] == 4, (name, chunks)
        answer = (await client.post(path, json=asked)).json()
        assert layout(answer) == whole and ids_in([answer]) == 4, (name, answer)
        # Unasked, neither node kind sends any ids (vLLM writes nulls, torch leaves them out).
        assert all(has_no_ids(c) for c in await sse(client, path, body)), name
        assert has_no_ids((await client.post(path, json=body)).json()), name


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_stopped_stream_ends_its_ids_with_the_token_that_completed_the_stop_string_and_continues(
        nodes: dict[str, httpx.AsyncClient], kind: str) -> None:
    base = {k: v for k, v in (CHAT_BODY if kind == "chat" else COMPLETION_BODY).items() if k != "max_tokens"}
    for name, client in nodes.items():
        whole = await stream(client, kind, {**base, "max_tokens": 16})
        stop, fewest, most = stop_across_chunks(whole)
        stopped = await stream(client, kind, {**base, "max_tokens": 16, "stop": stop})
        # Every id up to the one that completed the stop string, in one chunk each, while the
        # text lags them, held back for the stop string, which never goes out. (How much
        # lags differs: vLLM holds back len(stop) - 1 characters all along and sends what
        # precedes the stop string with the last ids; a torch node holds back only what
        # could be the start of a stop string.)
        m = len(stopped.token_ids)
        assert fewest <= m <= most and stopped.finish == "stop", (name, stop, stopped, whole)
        assert stopped.token_ids == whole.token_ids[:m], (name, stop, stopped, whole)
        assert stopped.text == whole.text.split(stop)[0], (name, stop, stopped, whole)
        # Continued from token ids at any chunk boundary before it, the same ids follow.
        for k in stopped.boundaries[:-1]:
            rest = await stream(client, "completion", {
                "model": MODEL, "prompt": stopped.prompt_ids + stopped.token_ids[:k], "max_tokens": 16 - k,
                "stop": stop})
            assert rest.token_ids[:m - k] == stopped.token_ids[k:], (name, k)


async def test_tokenize_and_detokenize_answer_alike_on_vllm_and_torch_nodes(
        nodes: dict[str, httpx.AsyncClient]) -> None:
    answers: dict[str, list[object]] = {}
    for name, client in nodes.items():
        prompt = (await client.post("/tokenize", json={"model": MODEL, "prompt": "Hello , wörld 日本語 . I 'm"})).json()
        chat = (await client.post("/tokenize", json={"model": MODEL, "messages": CHAT_BODY["messages"]})).json()
        assert set(prompt) == set(chat) == {"count", "max_model_len", "tokens", "token_strs"}, (name, prompt)
        ids = prompt["tokens"]
        # Special tokens spelled, spaces as they are (no clean-up), half a character as U+FFFD.
        answers[name] = [prompt, chat, await detokenize(client, MODEL, ids), await detokenize(client, MODEL, ids[:-1])]
        unknown = await client.post("/detokenize", json={"model": "nope", "tokens": ids})
        assert unknown.status_code == 404 and unknown.json()["error"]["message"], name
        negative = await client.post("/detokenize", json={"model": MODEL, "tokens": [-1]})
        assert negative.status_code == 400 and negative.json()["error"]["message"], name
    assert answers["vllm"] == answers["torch"]
    assert answers["torch"][2] == "<|begin_of_text|>Hello , wörld 日本語 . I 'm"
    # Where they differ: vLLM decodes an id outside the vocabulary to nothing, a torch node refuses it.
    outside = {"model": MODEL, "tokens": [ids[1], 5_000_000]}
    first = await detokenize(nodes["torch"], MODEL, [ids[1]])
    assert (await nodes["vllm"].post("/detokenize", json=outside)).json() == {"prompt": first}
    assert (await nodes["torch"].post("/detokenize", json=outside)).status_code == 400


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_greedy_continuation_from_token_ids_is_exact_on_vllm_and_torch_nodes(
        fabric: TenantFabric, nodes: dict[str, httpx.AsyncClient], kind: str) -> None:
    n = 16
    base = {k: v for k, v in (CHAT_BODY if kind == "chat" else COMPLETION_BODY).items() if k != "max_tokens"}
    tokenizer = ChatTokenizer.from_dir(fabric.node.state.runtime.settings.model_dir)
    for name, client in nodes.items():
        seams = await continued(client, MODEL, kind, base, n, list(range(n)))
        assert len(seams) >= n // 2 and [s.k for s in seams if not s.same_tokens] == [], (name, len(seams))
        if name == "torch":
            assert [s.k for s in seams if not s.same_text] == []
            continue
        # vLLM primes its decoder with the prompt (tokenizers' DecodeStream(ids=...)); where
        # the prompt ends in an unfinished character (text held back at the break), the
        # continuation's first text is the whole prompt's text again, then the new text.
        # The router strips that replay (or resumes before the unfinished character).
        for s in seams:
            if s.same_text:
                continue
            replay = tokenizer.decode(s.prompt_ids + s.whole.token_ids[:s.k])
            assert replay.endswith(REPLACEMENT_CHAR), (s.k, replay)
            assert s.rest.text == tokenizer.decode(s.prompt_ids) + s.whole.text, s.k


async def test_a_killed_engine_core_is_restarted_and_serves_again(fabric: TenantFabric) -> None:
    engine = fabric.node.state.runtime.engine
    supervisor = engine.supervisor
    generation, pid = supervisor.generation, supervisor.pid
    cores = _children(pid)
    assert cores, "vLLM's API server has no engine-core process"
    for core in cores:
        os.kill(core, signal.SIGKILL)
    client = oai(fabric)
    deadline = asyncio.get_running_loop().time() + 240
    while True:
        try:
            answer = await client.completions.create(model=MODEL, prompt="The river", max_tokens=3)
            if supervisor.generation > generation:
                break
        except (openai.APIStatusError, openai.APIConnectionError):
            pass  # 503 while vLLM restarts (the router has no other replica)
        assert asyncio.get_running_loop().time() < deadline, "vLLM did not come back"
        await asyncio.sleep(1)
    assert answer.usage is not None and answer.usage.completion_tokens == 3
    assert supervisor.pid != pid and supervisor.restarts >= 1


async def test_vllm_runs_with_the_keep_alive_the_node_gave_it(fabric: TenantFabric) -> None:
    """vLLM's API server keeps an idle connection as long as the node says, by a variable
    this vLLM reads (a rename would put the 5 s default and its race with the pool back)."""
    pid = fabric.node.state.runtime.engine.supervisor.pid
    environ = (await asyncio.to_thread(Path(f"/proc/{pid}/environ").read_bytes)).split(b"\0")
    assert f"VLLM_HTTP_TIMEOUT_KEEP_ALIVE={SERVER_KEEPALIVE_S}".encode() in environ
    read = await asyncio.create_subprocess_exec(
        default_vllm_python(), "-c", "import vllm.envs as e; print(e.VLLM_HTTP_TIMEOUT_KEEP_ALIVE)",
        env={**os.environ, "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEPALIVE_S)}, stdout=asyncio.subprocess.PIPE)
    out, _ = await read.communicate()
    assert read.returncode == 0 and int(out) == SERVER_KEEPALIVE_S


async def test_sigterm_drains_in_flight_streams_before_the_node_stops(fabric: TenantFabric) -> None:
    runtime = fabric.node.state.runtime
    client = oai(fabric)
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell a long story"}], max_tokens=300,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [await anext(stream)]
    # What the node's SIGTERM handler starts (data_plane/node.py): refuse new work, finish the rest.
    drain = asyncio.ensure_future(runtime.drain())
    async with httpx.AsyncClient(base_url=fabric.node_url, timeout=30,
                                 headers={"authorization": f"Bearer {CLUSTER_TOKEN}"}) as node:
        refused = await node.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
    chunks += [c async for c in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 300, "the stream was cut"
    await drain
    assert runtime.lifecycle.in_flight == 0


async def test_embeddings_from_a_pooling_deployment(tmp_path: Path) -> None:
    """A deployment that runs the model as a pooling model (vLLM's `--convert embed`)
    serves /v1/embeddings through the router."""
    require_vllm()
    pooling = {"deployment_spec_file": write_spec(tmp_path / "embed.json", loras=[], env={},
                                                  extra_args=["--runner", "pooling", "--convert", "embed"])}
    async with vllm_fabric(tmp_path, **pooling) as f:
        client = oai(f)
        out = await client.embeddings.create(model=MODEL, input=["the river", "the mountain"])
        assert len(out.data) == 2 and len(out.data[0].embedding) == VLLM_CPU_ARCH.hidden_size
        assert out.usage.prompt_tokens > 0
