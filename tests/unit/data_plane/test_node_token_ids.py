"""What a router resumes a broken stream from, on a torch node: `return_token_ids` in vLLM
0.32's places (chat and completions, streamed and whole), every generated id in exactly
one chunk even where its text is held back, and /tokenize and /detokenize in vLLM's
shapes, behind the cluster token, with OpenAI errors for bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from node_testkit import MODEL_NAME, asgi_client, make_settings, parse_sse

from data_plane.server.app import create_app
from meridian.tokenizer import REPLACEMENT_CHAR

CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story."}],
                        "temperature": 0, "ignore_eos": True}
COMPLETION: dict[str, Any] = {"model": MODEL_NAME, "prompt": "The river city is", "temperature": 0,
                              "ignore_eos": True}
N = 24


async def events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    parsed = list(parse_sse(r.text))
    assert parsed[-1] == "[DONE]"
    return parsed[:-1]


def streamed_ids(chunks: list[dict[str, Any]]) -> list[int]:
    return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]


def streamed_text(chunks: list[dict[str, Any]], kind: str) -> str:
    key = "content" if kind == "chat" else "text"
    return "".join((ch.get("delta", ch) if kind == "chat" else ch).get(key) or ""
                   for c in chunks for ch in c["choices"])


def assert_no_token_id_keys(body: dict[str, Any]) -> None:
    assert "prompt_token_ids" not in body
    for choice in body.get("choices", []):
        assert "token_ids" not in choice and "prompt_token_ids" not in choice


async def tokenize(client: httpx.AsyncClient, **body: Any) -> list[int]:
    r = await client.post("/tokenize", json={"model": MODEL_NAME, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]  # type: ignore[no-any-return]


# --- whole answers --------------------------------------------------------------------


async def test_a_whole_chat_answer_has_the_prompt_ids_on_top_and_the_generated_ids_in_its_choice(
        client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, "return_token_ids": True})).json()
    assert body["prompt_token_ids"] == await tokenize(client, messages=CHAT["messages"])
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 8
    assert "prompt_token_ids" not in choice


async def test_a_whole_completion_has_both_in_its_choice(client: httpx.AsyncClient) -> None:
    body = (await client.post("/v1/completions", json={**COMPLETION, "max_tokens": 8, "return_token_ids": True})).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == await tokenize(client, prompt=COMPLETION["prompt"])
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 8
    assert "prompt_token_ids" not in body


async def test_without_return_token_ids_no_answer_or_chunk_has_token_id_keys(client: httpx.AsyncClient) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        assert_no_token_id_keys((await client.post(path, json={**body, "max_tokens": 4})).json())
        for flag in ({}, {"return_token_ids": False}):
            for chunk in await events(client, path, {**body, "max_tokens": 4, **flag}):
                assert_no_token_id_keys(chunk)


# --- streams --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_stream_carries_every_generated_id_once_and_the_prompt_ids_first(
        client: httpx.AsyncClient, kind: str) -> None:
    path, base = ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", COMPLETION)
    body = {**base, "max_tokens": N, "return_token_ids": True}
    whole = (await client.post(path, json=body)).json()
    chunks = await events(client, path, {**body, "stream_options": {"include_usage": True}})
    *content, usage = chunks
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == N
    if kind == "chat":
        # vLLM's role chunk: the prompt's ids at the top, no ids in its choice.
        role, *content = content
        assert role["prompt_token_ids"] == whole["prompt_token_ids"]
        assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "token_ids" not in role["choices"][0]
        assert all("prompt_token_ids" not in c for c in content)
    else:
        assert content[0]["choices"][0]["prompt_token_ids"] == whole["choices"][0]["prompt_token_ids"]
        assert all("prompt_token_ids" not in c["choices"][0] for c in content[1:])
    # One chunk per generated token, each naming it, the finish on the last one.
    assert [len(c["choices"][0]["token_ids"]) for c in content] == [1] * N
    assert streamed_ids(content) == whole["choices"][0]["token_ids"]
    assert [c["choices"][0]["finish_reason"] for c in content] == [None] * (N - 1) + ["length"]
    text = whole["choices"][0]["message"]["content"] if kind == "chat" else whole["choices"][0]["text"]
    assert streamed_text(content, kind) == text


async def test_ids_whose_text_is_held_back_for_half_a_character_still_come_in_their_chunk(
        client: httpx.AsyncClient) -> None:
    # The tiny model's first token after this prompt is the first byte of a character.
    chunks = await events(client, "/v1/completions", {**COMPLETION, "max_tokens": N, "return_token_ids": True})
    held = [c["choices"][0] for c in chunks if c["choices"][0]["text"] == ""]
    assert held and all(len(ch["token_ids"]) == 1 for ch in held)
    assert len(streamed_ids(chunks)) == N


def chunk_texts(chunks: list[dict[str, Any]], kind: str) -> list[str]:
    """The text of each chunk that carries token ids (one token each here)."""
    return [streamed_text([c], kind) for c in chunks if c["choices"] and "token_ids" in c["choices"][0]]


def stop_across_tokens(texts: list[str]) -> tuple[str, int]:
    """Three characters that tokens j and j+1 share, first found there; and j + 1."""
    text = "".join(texts)
    for j in range(1, len(texts) - 1):
        stop = texts[j][-1:] + texts[j + 1][:2]
        if len(stop) == 3 and REPLACEMENT_CHAR not in stop and text.find(stop) == len("".join(texts[:j + 1])) - 1:
            return stop, j + 1
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_a_stop_string_ends_the_ids_with_the_token_that_completed_it(
        client: httpx.AsyncClient, kind: str) -> None:
    path, base = ("/v1/chat/completions", CHAT) if kind == "chat" else ("/v1/completions", COMPLETION)
    unbroken = await events(client, path, {**base, "max_tokens": N, "return_token_ids": True})
    ids, texts = streamed_ids(unbroken), chunk_texts(unbroken, kind)
    stop, last = stop_across_tokens(texts)
    chunks = await events(client, path, {**base, "max_tokens": N, "return_token_ids": True, "stop": stop})
    # Every id up to and including the one completing the stop string, none after it; the
    # stop string's first character went out with neither its token nor the next one.
    assert streamed_ids(chunks) == ids[:last + 1]
    stopped = chunk_texts(chunks, kind)
    assert "".join(stopped) == "".join(texts).split(stop)[0]
    assert stopped[last - 1:] == [texts[last - 1][:-1], ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_logprobs_and_token_ids_travel_in_the_same_chunk(client: httpx.AsyncClient) -> None:
    chunks = await events(client, "/v1/completions", {**COMPLETION, "max_tokens": 6, "return_token_ids": True,
                                                      "logprobs": 1})
    for c in chunks:
        choice = c["choices"][0]
        assert len(choice["logprobs"]["tokens"]) == len(choice["token_ids"]) == 1


# --- /tokenize and /detokenize ----------------------------------------------------------


async def test_tokenize_answers_in_vllms_shape_for_a_prompt_and_for_messages(client: httpx.AsyncClient) -> None:
    r = await client.post("/tokenize", json={"model": MODEL_NAME, "prompt": "The river city is"})
    body = r.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == 2048 and body["tokens"][0] == 0  # BOS by default
    bare = await tokenize(client, prompt="The river city is", add_special_tokens=False)
    assert bare == body["tokens"][1:]
    chat = (await client.post("/tokenize", json={"messages": CHAT["messages"], "return_token_strs": True})).json()
    assert chat["token_strs"][:2] == ["<|begin_of_text|>", "<|start_header_id|>"]
    assert chat["token_strs"][-3:] == ["<|end_header_id|>", "Ċ", "Ċ"]
    no_prompt = await tokenize(client, messages=CHAT["messages"], add_generation_prompt=False)
    assert chat["tokens"][:len(no_prompt)] == no_prompt and len(no_prompt) < chat["count"]


async def test_detokenize_answers_the_text_of_the_ids_special_tokens_kept(client: httpx.AsyncClient) -> None:
    ids = await tokenize(client, prompt="héllo wörld 日本語")
    r = await client.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert r.json() == {"prompt": "<|begin_of_text|>héllo wörld 日本語"}
    # Half a character decodes to U+FFFD, as vLLM's decode gives it.
    cut = (await client.post("/detokenize", json={"tokens": ids[:-1]})).json()["prompt"]
    assert cut == "<|begin_of_text|>héllo wörld 日本" + REPLACEMENT_CHAR


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"tokens": [1000]}, 400, "tokens"),
    ({"tokens": [-1]}, 400, "tokens"),
    ({"tokens": [1] * 2049}, 400, "tokens"),
    ({"tokens": "1 2"}, 400, "tokens"),
    ({}, 400, "tokens"),
    ({"tokens": [1], "model": "nope"}, 404, "model"),
])
async def test_bad_detokenize_input_is_an_openai_error(
        client: httpx.AsyncClient, body: dict[str, Any], status: int, param: str) -> None:
    r = await client.post("/detokenize", json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"]


@pytest.mark.parametrize(("body", "status"), [
    ({"prompt": 5}, 400),
    ({"messages": []}, 400),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400),
    ({"prompt": "hi", "model": "nope"}, 404),
])
async def test_bad_tokenize_input_is_an_openai_error(
        client: httpx.AsyncClient, body: dict[str, Any], status: int) -> None:
    r = await client.post("/tokenize", json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert (await client.post("/tokenize", content=b"{not json")).status_code == 400


async def test_tokenize_and_detokenize_need_the_cluster_token(tiny_checkpoint: Path) -> None:
    app = create_app(make_settings(tiny_checkpoint, cluster_token="cluster-secret"))
    async with asgi_client(app) as client:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
            assert (await client.post(path, json=body)).status_code == 401
            ok = await client.post(path, json=body, headers={"authorization": "Bearer cluster-secret"})
            assert ok.status_code == 200, ok.text
