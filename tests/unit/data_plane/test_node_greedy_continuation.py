"""A stream continued from token ids is the unbroken stream, on a torch node (greedy).

The router resumes a broken stream on another node with `prompt` = the prompt's ids + the
ids generated so far (a /v1/completions request) and `max_tokens` = what was left. With
temperature 0 that must give the same tokens as the unbroken stream, token for token, and
the text the continuation streams, after the text the first piece had streamed (plus what
it held back, which /detokenize gives in context), must be the unbroken text. Tried at
every k from 0 to N-1 generated tokens, for chat and completions, with and without a stop
string.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from node_testkit import MODEL_NAME
from token_ids_contract import detokenize, stop_across_chunks, stream

from data_plane.model.make_tiny import SPECIAL_TOKENS
from meridian.tokenizer import REPLACEMENT_CHAR, ChatTokenizer

N = 24
CHAT: dict[str, Any] = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me a story."}]}
COMPLETION: dict[str, Any] = {"model": MODEL_NAME, "prompt": "The river city is"}


async def held_back(
        client: httpx.AsyncClient, prompt_ids: list[int], generated: list[int], streamed: str) -> str | None:
    """What the router learns was generated but not streamed: the generated ids' text in
    the prompt's context (/detokenize of prompt + generated, less the prompt's), past what
    was streamed, less trailing U+FFFD (an unfinished character: the continuing node
    streams it itself, with the token that finishes it).

    None where a special token was generated: /detokenize spells it (as vLLM's does, with
    no way to ask otherwise) while streams leave it out, so the difference is not text
    that was held back.
    """
    if any(t < len(SPECIAL_TOKENS) for t in generated):
        return None
    before = await detokenize(client, MODEL_NAME, prompt_ids)
    after = await detokenize(client, MODEL_NAME, prompt_ids + generated)
    assert after.startswith(before) and after[len(before):].startswith(streamed)
    return after[len(before) + len(streamed):].rstrip(REPLACEMENT_CHAR)


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_greedy_continuation_from_token_ids_is_the_unbroken_stream(
        client: httpx.AsyncClient, kind: str) -> None:
    base = CHAT if kind == "chat" else COMPLETION
    whole = await stream(client, kind, {**base, "max_tokens": N})
    assert len(whole.token_ids) == N and whole.finish == "length"
    for k in range(N):
        if k in (1, N // 2, N - 1):
            first = await stream(client, kind, {**base, "max_tokens": k})
            assert first.token_ids == whole.token_ids[:k], k
        rest = await stream(client, "completion", {
            "model": MODEL_NAME, "prompt": whole.prompt_ids + whole.token_ids[:k], "max_tokens": N - k})
        assert rest.token_ids == whole.token_ids[k:], f"continued at {k}"
        assert rest.finish == "length"
        # Without a stop string nothing is held back but an unfinished character, which the
        # continuation streams whole with the token that finishes it.
        streamed = whole.text_upto(k)
        assert await held_back(client, whole.prompt_ids, whole.token_ids[:k], streamed) in ("", None)
        assert streamed + rest.text == whole.text, f"text continued at {k}"


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_greedy_continuation_with_a_stop_string(client: httpx.AsyncClient, kind: str) -> None:
    base = CHAT if kind == "chat" else COMPLETION
    stop, _, _ = stop_across_chunks(await stream(client, kind, {**base, "max_tokens": N}))
    whole = await stream(client, kind, {**base, "max_tokens": N, "stop": stop})
    m = len(whole.token_ids)
    assert whole.finish == "stop" and 1 < m < N
    seams: set[str] = set()
    for k in range(m):
        rest = await stream(client, "completion", {
            "model": MODEL_NAME, "prompt": whole.prompt_ids + whole.token_ids[:k], "max_tokens": N - k,
            "stop": stop})
        assert rest.token_ids[:m - k] == whole.token_ids[k:], f"continued at {k}"
        streamed = whole.text_upto(k)
        held = await held_back(client, whole.prompt_ids, whole.token_ids[:k], streamed)
        assert held is not None, "the tiny model generated a special token: pick another prompt"
        # The router's view: streamed + held back + the continuation, cut at the first stop
        # string if the continuing node did not (it straddles the seam: no node can see it),
        # is the unbroken text.
        joined = streamed + held + rest.text
        assert joined.split(stop, 1)[0] == whole.text, f"text continued at {k}"
        if not (streamed + held).endswith(tuple(stop[:i] for i in (1, 2))):
            # Wholly after the seam, the continuing node stops where the unbroken one did.
            assert rest.token_ids == whole.token_ids[k:] and rest.finish == "stop", k
            seams.add("after")
        else:
            seams.add("across")
    assert seams == {"after", "across"}, f"stop string {stop!r} never straddled the seam"


def test_a_detokenizer_continued_at_any_token_reads_as_the_unbroken_one(tiny_checkpoint: Path) -> None:
    tok = ChatTokenizer.from_dir(tiny_checkpoint)
    ids = tok.encode("héllo wörld 日本語 🙂 ok")
    unbroken = tok.detokenizer()
    texts = [unbroken.push(t) for t in ids]
    for cut in range(1, len(ids)):
        continued = tok.detokenizer(context=ids[:cut])
        rest = "".join(continued.push(t) for t in ids[cut:]) + continued.flush()
        assert "".join(texts[:cut]) + rest == tok.decode(ids), cut
