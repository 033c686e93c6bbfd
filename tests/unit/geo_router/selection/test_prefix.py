"""The router's prefix keys: its block hashes are the ones a node publishes for the same
request, and its text keys need no tokenizer. Nothing about them ever fails a request."""

from __future__ import annotations

import logging
import random
import statistics
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from router_harness import eventually, router_settings

from data_plane.lora.make_tiny import make_tiny_lora
from data_plane.model.make_tiny import make_tiny_checkpoint
from data_plane.server.app import create_app as create_node_app
from geo_router.selection.prefix import PrefixKeyBuilder, RequestPrefix
from meridian.block_hash import hash_blocks
from meridian.kv_events import BlockStored, KVEventBatch
from meridian.settings.node import NodeSettings
from meridian.tokenizer import ChatTokenizer

MODEL = "tiny-llama"
ADAPTER = "sql"
BLOCK = 4
WORDS = ("the river runs past an old mill while people in the city talk about time money and the "
         "weather of a long summer").split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def conversation(turns: int, *, seed: int = 0, system: str = "You are a terse assistant.") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for _ in range(turns):
        messages.append({"role": "user", "content": sentence(rng, 30)})
        messages.append({"role": "assistant", "content": sentence(rng, 30)})
    messages.append({"role": "user", "content": sentence(rng, 20)})
    return messages


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, seed=0)


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(checkpoint)


def builder(checkpoint: Path | None = None, **settings: Any) -> PrefixKeyBuilder:
    dirs = {MODEL: checkpoint} if checkpoint is not None else {}
    return PrefixKeyBuilder(router_settings(tokenizer_dirs=dirs, **settings))


# --- the node's own hashes ------------------------------------------------------------------


class _Sink:
    """A KV event sink that keeps every stored block hash."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stored: set[int] = set()

    def publish(self, batch: KVEventBatch) -> None:
        with self._lock:
            for event in batch.events:
                if isinstance(event, BlockStored):
                    self.stored.update(h for h in event.block_hashes if isinstance(h, int))


@pytest.fixture
async def node(checkpoint: Path, tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, _Sink]]:
    """A real node (torch engine, one LoRA adapter) whose KV events the test collects."""
    make_tiny_lora(checkpoint, tmp_path / ADAPTER, seed=1)
    settings = NodeSettings(model_dir=checkpoint, control_plane_url=None, block_size=BLOCK,
                            lora_modules={ADAPTER: tmp_path / ADAPTER}, drain_timeout_s=5.0)
    app: FastAPI = create_node_app(settings)
    sink = _Sink()
    async with app.router.lifespan_context(app):
        await app.state.runtime.wait_ready()
        app.state.runtime.engine.set_kv_event_sink(sink)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
            yield client, sink


REQUESTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", MODEL, {"messages": conversation(3)}),
    "chat with adapter": ("/v1/chat/completions", f"{MODEL}:{ADAPTER}", {"messages": conversation(3)}),
    "chat with cache salt": ("/v1/chat/completions", MODEL,
                             {"messages": conversation(3), "cache_salt": "tenant-7"}),
    "chat with content parts and developer role": ("/v1/chat/completions", MODEL, {"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief. "},
                                          {"type": "text", "text": "Answer in English."}]},
        {"role": "user", "content": sentence(random.Random(5), 40), "name": "ann"},
    ]}),
    "completion": ("/v1/completions", f"{MODEL}:{ADAPTER}",
                   {"prompt": sentence(random.Random(1), 60), "cache_salt": "s"}),
    "completion of token ids": ("/v1/completions", MODEL, {"prompt": list(range(3, 90))}),
}


@pytest.mark.parametrize("name", list(REQUESTS))
async def test_block_hashes_are_the_ones_the_node_publishes(
    name: str, node: tuple[httpx.AsyncClient, _Sink], checkpoint: Path
) -> None:
    client, sink = node
    route, model, body = REQUESTS[name]
    payload = {"model": model, **body}
    b = builder(checkpoint)
    assert await b.preload(model)
    prefix = b.build(model, payload, BLOCK)
    resp = await client.post(route, json={**payload, "max_tokens": 1, "temperature": 0})
    assert resp.status_code == 200, resp.text
    prompt_tokens = resp.json()["usage"]["prompt_tokens"]
    assert prefix.token_hashes is not None and prefix.num_tokens == prompt_tokens
    assert len(prefix.token_hashes) == prompt_tokens // BLOCK > 10
    # Chained hashes: each one commits to the whole prefix before it, adapter and salt included.
    await eventually(lambda: set(prefix.token_hashes or []) <= sink.stored)


# --- what changes the keys ----------------------------------------------------------------


def test_adapter_and_cache_salt_change_every_key(checkpoint: Path) -> None:
    b = builder(checkpoint)
    payload = {"messages": conversation(2)}
    plain = b.build(MODEL, payload, BLOCK)
    adapted = b.build(f"{MODEL}:{ADAPTER}", payload, BLOCK)
    salted = b.build(MODEL, {**payload, "cache_salt": "tenant-1"}, BLOCK)
    other_salt = b.build(MODEL, {**payload, "cache_salt": "tenant-2"}, BLOCK)
    assert (plain.adapter, adapted.adapter) == (None, ADAPTER)
    variants = [plain, adapted, salted, other_salt]
    for a in variants:
        assert a.token_hashes and a.text_keys
        for b_ in variants:
            if a is not b_:
                assert not set(a.token_hashes) & set(b_.token_hashes or [])
                assert not set(a.text_keys) & set(b_.text_keys)
    # Same request, same keys: at any router, any time.
    again = builder(checkpoint).build(MODEL, dict(payload), BLOCK)
    assert (again.token_hashes, again.text_keys) == (plain.token_hashes, plain.text_keys)


def test_text_keys_of_a_growing_conversation_extend_the_earlier_turns_keys() -> None:
    b = builder(prefix_text_chunk_bytes=32)  # no tokenizer at all
    first = conversation(1, seed=3)
    second = [*first, {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "And then?"}]
    k1 = b.build(MODEL, {"messages": first}, BLOCK).text_keys
    k2 = b.build(MODEL, {"messages": second}, BLOCK).text_keys
    assert len(k1) > 3 and k2[: len(k1)] == k1 and len(k2) > len(k1)
    # Another conversation under the same system prompt shares only the system prompt's chunks.
    other = b.build(MODEL, {"messages": conversation(1, seed=4)}, BLOCK).text_keys
    shared = next(i for i, (x, y) in enumerate(zip(k1, other, strict=False)) if x != y)
    assert shared == len("system\x1fYou are a terse assistant.\x1e") // 32
    # A completion's text is another key space than a chat's.
    text = b.build(MODEL, {"prompt": "system\x1fYou are a terse assistant.\x1e" * 4}, BLOCK).text_keys
    assert text and not set(text) & set(k1)


def test_block_size_none_skips_tokenising_but_keeps_text_keys(checkpoint: Path) -> None:
    prefix = builder(checkpoint).build(MODEL, {"messages": conversation(2)}, None)
    assert prefix.token_hashes is None and prefix.text_keys and prefix.num_tokens > 0


@pytest.mark.parametrize("payload", [
    {},
    {"messages": []},
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
    {"messages": "hello"},
    {"prompt": ["a", "b"]},
    {"prompt": [1, -2]},
    {"prompt": ""},
])
def test_a_request_the_node_would_refuse_has_no_keys(checkpoint: Path, payload: dict[str, Any]) -> None:
    prefix = builder(checkpoint).build(MODEL, {"model": MODEL, **payload}, BLOCK)
    assert prefix == RequestPrefix(None, 0, BLOCK, [], None)


# --- the cap --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(10))
def test_only_the_first_max_tokens_are_hashed_and_they_match_the_whole_prompts(
    checkpoint: Path, tokenizer: ChatTokenizer, seed: int
) -> None:
    rng = random.Random(seed)
    cap = rng.choice([64, 200, 512])
    messages = conversation(rng.randrange(8, 30), seed=seed)
    full = tokenizer.apply_chat_template(messages)
    expected = hash_blocks(full, BLOCK)
    assert len(full) > 2 * cap
    b = builder(checkpoint, prefix_max_tokens=cap)
    # Twice: the second build has learnt this tokenizer's characters per token, so cuts elsewhere.
    for _ in range(2):
        prefix = b.build(MODEL, {"messages": messages}, BLOCK)
        assert prefix.truncated and prefix.num_tokens <= cap
        assert prefix.token_hashes == expected[: len(prefix.token_hashes or [])]
        assert len(prefix.token_hashes or []) >= cap // BLOCK // 2
    assert len(prefix.token_hashes or []) == cap // BLOCK
    # A builder that has seen only dense text (few characters per token) cuts this prompt
    # short of the cap: the tokens near its cut must not differ from the whole prompt's.
    dense = builder(checkpoint, prefix_max_tokens=cap)
    noise = "".join(rng.choice("qzxjkvbw0123456789") for _ in range(4000))
    dense.build(MODEL, {"prompt": noise}, BLOCK)
    short = dense.build(MODEL, {"messages": messages}, 1)  # a block per token: any token counts
    assert short.truncated and 0 < short.num_tokens < cap
    assert short.token_hashes == hash_blocks(full, 1)[: short.num_tokens]
    # Completion prompts and token ids are capped the same way.
    text = " ".join(m["content"] for m in messages)
    prompt = b.build(MODEL, {"prompt": text}, BLOCK)
    assert prompt.truncated and prompt.token_hashes == hash_blocks(tokenizer.encode(text), BLOCK)[: len(prompt.token_hashes or [])]
    ids = b.build(MODEL, {"prompt": full}, BLOCK)
    assert ids.truncated and ids.num_tokens == cap and ids.token_hashes == expected[: cap // BLOCK]


def test_building_keys_for_a_2k_token_chat_costs_little_more_than_tokenizing_it(
        checkpoint: Path, tokenizer: ChatTokenizer) -> None:
    """The keys cost about what the chat's tokens cost (rendering and encoding it, which the
    router cannot avoid), not a multiple: no second encode, no per-block re-tokenizing.
    Timed against the tokenizer, pair by pair, so that a loaded machine slows both alike
    (an absolute 50 ms bound read 122 ms on CI's loaded two cores; the ratio was 1.2 here)."""
    turns = 1
    while len(tokenizer.apply_chat_template(conversation(turns))) < 2048:
        turns += 1
    messages = conversation(turns)
    b = builder(checkpoint, prefix_max_tokens=8192)
    payload = {"messages": messages}
    prefix = b.build(MODEL, payload, 16)
    ratios = []
    for _ in range(21):
        t0 = time.perf_counter()
        b.build(MODEL, payload, 16)
        t1 = time.perf_counter()
        tokenizer.apply_chat_template(messages)
        ratios.append((t1 - t0) / (time.perf_counter() - t1))
    ratio = statistics.median(ratios)
    print(f"\nprefix keys of a {prefix.num_tokens}-token chat: {ratio:.2f} x its tokenizing (median of 21)")
    assert prefix.num_tokens >= 2048 and not prefix.truncated
    assert ratio < 3, f"building the keys of a 2k-token chat cost {ratio:.1f} x tokenizing it"


# --- tokenizers that are missing, broken or still loading ----------------------------------


@pytest.mark.parametrize("problem", ["missing", "broken"])
def test_a_missing_or_broken_tokenizer_only_costs_the_block_hashes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, problem: str
) -> None:
    directory = tmp_path / MODEL
    if problem == "broken":
        directory.mkdir()
        (directory / "tokenizer.json").write_text("{not json")
    caplog.set_level(logging.WARNING, logger="geo_router.selection.prefix")
    b = builder(directory)
    for _ in range(3):
        prefix = b.build(MODEL, {"messages": conversation(2)}, BLOCK)
        assert prefix.token_hashes is None and prefix.text_keys
    assert len([r for r in caplog.records if "no tokenizer for model" in r.getMessage()]) == 1


def test_tokenizers_are_found_under_a_root_by_model_name(checkpoint: Path) -> None:
    b = PrefixKeyBuilder(router_settings(tokenizer_root=checkpoint.parent))
    assert b.build(f"{MODEL}:{ADAPTER}", {"prompt": "hello there"}, BLOCK).num_tokens > 0
    # A request's model name never reaches outside the root.
    escape = PrefixKeyBuilder(router_settings(tokenizer_root=checkpoint))
    assert escape.build(f"../{MODEL}", {"prompt": "hello " * 20}, BLOCK).token_hashes is None
    # A model without a tokenizer anywhere: text keys only, unless the prompt is token ids.
    assert b.build("other-model", {"prompt": "hello " * 40}, BLOCK).token_hashes is None
    ids = b.build("other-model", {"prompt": list(range(40))}, BLOCK)
    assert ids.token_hashes == hash_blocks(list(range(40)), BLOCK) and ids.num_tokens == 40


async def test_on_the_event_loop_a_tokenizer_loads_in_the_background(checkpoint: Path) -> None:
    b = builder(checkpoint)
    payload = {"messages": conversation(2)}
    first = b.build(MODEL, payload, BLOCK)
    assert first.token_hashes is None and first.text_keys  # not blocked on loading
    assert await b.preload(MODEL)
    assert b.build(MODEL, payload, BLOCK).token_hashes
    assert not await builder(checkpoint.parent / "nowhere").preload(MODEL)
