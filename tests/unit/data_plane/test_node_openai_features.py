"""The node's per-request features as OpenAI (and vLLM) clients use them: logprobs, top_k,
LoRA adapters by model name, cache_salt, and cached prompt tokens in usage."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI
from node_testkit import MODEL_NAME, make_settings, parse_sse

from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.make_tiny import SPECIAL_TOKENS
from data_plane.server.app import create_app
from data_plane.server.logprobs import TokenTexts
from meridian.tokenizer import ChatTokenizer

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story."}]}
PROMPT = "The river city is"
GREEDY = {"temperature": 0, "ignore_eos": True}
# Long enough to fill several KV blocks (16 tokens each by default).
LONG_PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 12)
ADAPTER = "adapter"


def openai_client_for(app: FastAPI) -> openai.AsyncOpenAI:
    """The official client, talking to the app in-process."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://node")
    return openai.AsyncOpenAI(base_url="http://node/v1", api_key="unused", http_client=http,
                              max_retries=0)


@pytest.fixture
async def oai(node_app: FastAPI) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai_client_for(node_app) as client:
        yield client


def assert_openai_error(resp: httpx.Response, status: int, **fields: Any) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    for key, value in fields.items():
        assert error[key] == value, (key, error)


def assert_sorted_desc(values: list[float]) -> None:
    assert values == sorted(values, reverse=True), values


# --- chat logprobs ----------------------------------------------------------------------


async def test_chat_logprobs_with_openai_client(oai: openai.AsyncOpenAI) -> None:
    resp = await oai.chat.completions.create(
        model=MODEL_NAME, messages=CHAT["messages"], max_tokens=10, temperature=0,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert resp.usage is not None
    assert len(content) == resp.usage.completion_tokens == 10
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert_sorted_desc([t.logprob for t in entry.top_logprobs])
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.bytes is not None
        for top in entry.top_logprobs:
            assert top.logprob <= 0 and top.bytes is not None
    # The tokens' bytes spell the answer, even where a token holds half a character.
    spelled = b"".join(bytes(e.bytes or []) for e in content if e.token not in SPECIAL_TOKENS)
    assert spelled.decode("utf-8", errors="replace") == choice.message.content


def test_token_bytes_rebuild_characters_split_across_tokens(tiny_checkpoint: Path) -> None:
    tok = ChatTokenizer.from_dir(tiny_checkpoint)
    texts = TokenTexts(tok)
    text = "café ☕ naïve <|eot_id|>"
    ids = tok.encode(text, add_special_tokens=False)
    # Accented letters and the emoji are split into byte tokens that read as U+FFFD alone.
    assert "\ufffd" in [texts.text(i) for i in ids]
    assert b"".join(bytes(texts.utf8(i)) for i in ids) == text.encode()


async def test_chat_logprobs_wire_shape(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/chat/completions", json={
        **CHAT, **GREEDY, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})).json()
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"content"}
    for entry in logprobs["content"]:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert all(set(t) == {"token", "logprob", "bytes"} for t in entry["top_logprobs"])
        assert entry["bytes"] == list(entry["token"].encode()) or "\ufffd" in entry["token"]
    by_id = (await client.post("/v1/chat/completions", json={
        **CHAT, **GREEDY, "max_tokens": 3, "logprobs": True, "top_logprobs": 2,
        "return_tokens_as_token_ids": True})).json()["choices"][0]["logprobs"]["content"]
    assert all(e["token"].startswith("token_id:") for e in by_id)
    assert [e["bytes"] for e in by_id] == [e["bytes"] for e in logprobs["content"]]


async def test_chat_logprobs_without_alternatives_and_off_by_default(
    client: httpx.AsyncClient,
) -> None:
    base = {**CHAT, **GREEDY, "max_tokens": 4}
    body = (await client.post("/v1/chat/completions", json={**base, "logprobs": True})).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 4 and all(e["top_logprobs"] == [] for e in content)
    body = (await client.post("/v1/chat/completions", json=base)).json()
    assert body["choices"][0]["logprobs"] is None


async def test_chat_stream_logprobs_match_non_stream(oai: openai.AsyncOpenAI) -> None:
    request: dict[str, Any] = {
        "model": MODEL_NAME, "messages": CHAT["messages"], "max_tokens": 12, "temperature": 0,
        "logprobs": True, "top_logprobs": 2, "extra_body": {"ignore_eos": True},
    }
    full = await oai.chat.completions.create(**request)
    assert full.choices[0].logprobs is not None and full.choices[0].logprobs.content is not None
    expected = full.choices[0].logprobs.content

    streamed: list[Any] = []
    text = ""
    stream = await oai.chat.completions.create(**request, stream=True)
    async for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None and choice.logprobs.content:
            streamed.extend(choice.logprobs.content)
    assert text == full.choices[0].message.content
    assert [e.token for e in streamed] == [e.token for e in expected]
    # The second request reuses the first one's cached prefix: equal up to float noise.
    for got, want in zip(streamed, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token for t in got.top_logprobs] == [t.token for t in want.top_logprobs]


# --- completions logprobs ---------------------------------------------------------------


async def test_completion_logprobs_with_openai_client(
    oai: openai.AsyncOpenAI, tiny_checkpoint: Path
) -> None:
    request: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10,
                               "temperature": 0, "logprobs": 3}
    by_id = await oai.completions.create(
        **request, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = by_id.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert by_id.usage is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert len(lp.tokens) == by_id.usage.completion_tokens == 10
    tok = ChatTokenizer.from_dir(tiny_checkpoint)

    def text_of(label: str) -> str:
        assert label.startswith("token_id:")
        return tok.decode([int(label.removeprefix("token_id:"))], skip_special_tokens=False)

    offset = 0
    for token, logprob, top, start in zip(
        lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True
    ):
        assert logprob is not None and logprob <= 0
        # Greedy: the chosen token is the best of the 3 asked for, so there is no 4th entry.
        assert len(top) == 3
        assert_sorted_desc(list(top.values()))
        assert next(iter(top)) == token and top[token] == logprob
        assert start == offset
        offset += len(text_of(token))

    # By text (the default): the same tokens, named by what they decode to.
    by_text = await oai.completions.create(**request, extra_body={"ignore_eos": True})
    text_lp = by_text.choices[0].logprobs
    assert text_lp is not None and text_lp.top_logprobs is not None
    assert text_lp.tokens == [text_of(t) for t in lp.tokens]
    assert text_lp.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-4)
    for named, ids in zip(text_lp.top_logprobs, lp.top_logprobs, strict=True):
        # Ids whose texts collide (halves of characters) share one entry.
        assert set(named) == {text_of(label) for label in ids}


async def test_completion_logprobs_zero_gives_the_chosen_token_only(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "logprobs": 0,
        "temperature": 1.0, "seed": 7, "ignore_eos": True})).json()
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert [list(top) for top in lp["top_logprobs"]] == [[t] for t in lp["tokens"]]
    assert [top[t] for top, t in zip(lp["top_logprobs"], lp["tokens"], strict=True)] == \
        lp["token_logprobs"]
    assert all(math.isfinite(v) and v <= 0 for v in lp["token_logprobs"])
    body = (await client.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2})).json()
    assert body["choices"][0]["logprobs"] is None


async def test_completion_stream_logprobs_match_non_stream(client: httpx.AsyncClient) -> None:
    request = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 12, "logprobs": 2, **GREEDY}
    full = (await client.post("/v1/completions", json=request)).json()["choices"][0]
    resp = await client.post("/v1/completions", json={**request, "stream": True})
    chunks = [e for e in parse_sse(resp.text) if e != "[DONE]"]
    tokens: list[str] = []
    text = ""
    for chunk in chunks:
        choice = chunk["choices"][0]
        if choice["logprobs"] is not None:
            lp = choice["logprobs"]
            # Offsets continue from the text already streamed.
            assert lp["text_offset"][0] == len(text)
            tokens += lp["tokens"]
        text += choice["text"]
    assert text == full["text"]
    assert tokens == full["logprobs"]["tokens"]


# --- top_k and seeds --------------------------------------------------------------------


async def test_top_k_1_is_greedy_even_at_temperature_1(oai: openai.AsyncOpenAI) -> None:
    greedy = await oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True})
    sampled = await oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True, "top_k": 1})
    assert sampled.choices[0].text == greedy.choices[0].text
    unrestricted = await oai.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True})
    assert unrestricted.choices[0].text != greedy.choices[0].text


async def test_top_k_minus_one_and_zero_mean_off(client: httpx.AsyncClient) -> None:
    base = {**CHAT, "max_tokens": 16, "temperature": 1.0, "seed": 11, "ignore_eos": True}

    async def text(extra: dict[str, Any]) -> str:
        resp = await client.post("/v1/chat/completions", json={**base, **extra})
        assert resp.status_code == 200, resp.text
        return str(resp.json()["choices"][0]["message"]["content"])

    off = await text({})
    assert await text({"top_k": -1}) == off
    assert await text({"top_k": 0}) == off
    assert await text({"top_k": 2}) != off


async def test_seeded_top_k_sampling_is_reproducible(client: httpx.AsyncClient) -> None:
    req = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 20, "temperature": 1.0,
           "top_k": 20, "seed": 1234, "ignore_eos": True, "logprobs": 1}
    a = (await client.post("/v1/completions", json=req)).json()["choices"][0]
    b = (await client.post("/v1/completions", json=req)).json()["choices"][0]
    c = (await client.post("/v1/completions", json={**req, "seed": 99})).json()["choices"][0]
    assert a["text"] == b["text"]
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    assert a["text"] != c["text"]


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"top_k": -5}, "top_k"),
    ("/v1/chat/completions", {"cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"cache_salt": "s" * 257}, "cache_salt"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"top_k": -5}, "top_k"),
])
async def test_bad_values_are_openai_400s(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    base: dict[str, Any] = CHAT if "chat" in path else {"model": MODEL_NAME, "prompt": PROMPT}
    resp = await client.post(path, json={**base, **body})
    assert_openai_error(resp, 400, type="invalid_request_error", param=param)


async def test_openai_client_sees_typed_errors(oai: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await oai.chat.completions.create(model=MODEL_NAME, messages=CHAT["messages"],
                                          logprobs=True, top_logprobs=50)
    assert bad.value.status_code == 400 and bad.value.param == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as missing:
        await oai.completions.create(model=f"{MODEL_NAME}:nope", prompt=PROMPT, max_tokens=2)
    assert missing.value.code == "model_not_found"


@pytest.mark.parametrize("model", [f"{MODEL_NAME}:nope", "nope", f"{MODEL_NAME}:", "other:nope"])
async def test_unknown_adapter_is_404(client: httpx.AsyncClient, model: str) -> None:
    resp = await client.post("/v1/chat/completions", json={**CHAT, "model": model})
    assert_openai_error(resp, 404, type="invalid_request_error", code="model_not_found",
                        param="model")
    assert model in resp.json()["error"]["message"]


# --- prefix cache: cached_tokens and cache_salt -----------------------------------------


async def test_repeated_prompt_reports_cached_tokens(oai: openai.AsyncOpenAI) -> None:
    async def usage(**extra: Any) -> Any:
        resp = await oai.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=2,
                                            **extra)
        assert resp.usage is not None
        return resp.usage

    first = await usage()
    assert first.prompt_tokens_details is None
    second = await usage()
    assert second.prompt_tokens_details is not None
    cached = second.prompt_tokens_details.cached_tokens
    assert cached is not None and 0 < cached < second.prompt_tokens

    # A salt keeps other requests' cache entries out of reach, and its own in reach.
    salted = await usage(extra_body={"cache_salt": "tenant-a"})
    assert salted.prompt_tokens_details is None
    again = await usage(extra_body={"cache_salt": "tenant-a"})
    assert again.prompt_tokens_details is not None
    assert again.prompt_tokens_details.cached_tokens == cached


async def test_streamed_usage_reports_cached_tokens(client: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": LONG_PROMPT}]
    request = {"model": MODEL_NAME, "messages": messages, "max_tokens": 2, "stream": True,
               "stream_options": {"include_usage": True}}
    await client.post("/v1/chat/completions", json=request)
    resp = await client.post("/v1/chat/completions", json=request)
    usage = [e for e in parse_sse(resp.text) if e != "[DONE]"][-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


# --- LoRA adapters by model name --------------------------------------------------------


@pytest.fixture
async def lora_app(tiny_checkpoint: Path, tmp_path: Path) -> AsyncIterator[FastAPI]:
    adapter_dir = make_tiny_lora(tiny_checkpoint, tmp_path / ADAPTER, seed=1)
    app = create_app(make_settings(tiny_checkpoint, lora_modules={ADAPTER: adapter_dir}))
    async with app.router.lifespan_context(app):
        await app.state.runtime.wait_ready()
        yield app


async def test_models_lists_adapters_with_their_parent(lora_app: FastAPI) -> None:
    async with openai_client_for(lora_app) as oai:
        models = await oai.models.list()
    cards = {m.id: m.model_dump() for m in models.data}
    assert list(cards) == [MODEL_NAME, f"{MODEL_NAME}:{ADAPTER}"]
    base, adapter = cards[MODEL_NAME], cards[f"{MODEL_NAME}:{ADAPTER}"]
    assert base["object"] == "model" and base["root"] == MODEL_NAME and "parent" not in base
    assert adapter["parent"] == MODEL_NAME and adapter["root"] == MODEL_NAME


async def test_adapter_output_differs_from_base(lora_app: FastAPI) -> None:
    async with openai_client_for(lora_app) as oai:

        async def complete(model: str) -> openai.types.Completion:
            return await oai.completions.create(model=model, prompt=PROMPT, max_tokens=12,
                                                temperature=0, extra_body={"ignore_eos": True})

        base = await complete(MODEL_NAME)
        adapted = await complete(f"{MODEL_NAME}:{ADAPTER}")
        bare = await complete(ADAPTER)
    assert adapted.model == f"{MODEL_NAME}:{ADAPTER}" and bare.model == ADAPTER
    assert adapted.choices[0].text != base.choices[0].text
    assert bare.choices[0].text == adapted.choices[0].text


async def test_adapter_chat_stream_and_unknown_adapter(lora_app: FastAPI) -> None:
    transport = httpx.ASGITransport(app=lora_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        model = f"{MODEL_NAME}:{ADAPTER}"
        resp = await client.post("/v1/chat/completions", json={
            **CHAT, **GREEDY, "model": model, "max_tokens": 4, "stream": True})
        chunks = [e for e in parse_sse(resp.text) if e != "[DONE]"]
        assert chunks and all(c["model"] == model for c in chunks)
        missing = await client.post("/v1/chat/completions", json={
            **CHAT, "model": f"{MODEL_NAME}:other"})
        assert_openai_error(missing, 404, code="model_not_found")
