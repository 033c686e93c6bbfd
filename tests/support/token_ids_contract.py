"""What stream migration needs from a node, in terms both node kinds are held to by the same
assertions: where `return_token_ids` puts the ids (vLLM 0.32's places), the bodies of
/tokenize and /detokenize, and a greedy stream continued from token ids.

A layout names, per chunk, which token-id lists it carries: `top` (chat's prompt ids at
the top level), `prompt` (completions' prompt ids in the choice), `ids` (the choice's
generated ids). A `null` counts as absent: vLLM writes `null` for ids it does not send,
the torch node leaves the key out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

REPLACEMENT_CHAR = "\ufffd"


async def sse(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every JSON event of a stream, [DONE] checked and left out."""
    r = await client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    data = [block[len("data: "):] for block in r.text.split("\n\n") if block.strip()]
    assert data[-1] == "[DONE]", data[-1]
    return [json.loads(d) for d in data[:-1]]


def layout(chunk: dict[str, Any]) -> list[str]:
    """Where this chunk carries token ids (see the module's docstring)."""
    where = ["top"] if isinstance(chunk.get("prompt_token_ids"), list) else []
    for choice in chunk.get("choices", []):
        if isinstance(choice.get("prompt_token_ids"), list):
            where.append("prompt")
        if isinstance(choice.get("token_ids"), list):
            where.append("ids")
    return where


def ids_in(chunks: list[dict[str, Any]]) -> int:
    """How many generated ids the chunks carry."""
    return sum(len(c.get("token_ids") or []) for chunk in chunks for c in chunk.get("choices", []))


def has_no_ids(chunk: dict[str, Any]) -> bool:
    """No token-id list anywhere (absent or null)."""
    return layout(chunk) == []


def chunk_text(chunk: dict[str, Any], kind: str) -> str:
    if kind == "chat":
        return "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    return "".join(c["text"] for c in chunk["choices"])


@dataclass
class Piece:
    """One stream as the router's ledger holds it."""

    prompt_ids: list[int]
    ids: list[list[int]]
    texts: list[str]
    finish: str | None

    @property
    def token_ids(self) -> list[int]:
        return [t for ids in self.ids for t in ids]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def boundaries(self) -> list[int]:
        """How many ids had been streamed after each chunk: where a stream can break. (vLLM
        sends one id per chunk, or several when its output lags the engine.)"""
        counts, seen = [0], 0
        for ids in self.ids:
            seen += len(ids)
            counts.append(seen)
        return counts

    def text_upto(self, k: int) -> str:
        """The text streamed by the time the first k generated ids had been."""
        out, seen = "", 0
        for ids, text in zip(self.ids, self.texts, strict=True):
            if seen + len(ids) > k:
                break
            out, seen = out + text, seen + len(ids)
        assert seen == k, f"no chunk boundary after {k} tokens"
        return out


async def stream(client: httpx.AsyncClient, kind: str, body: dict[str, Any]) -> Piece:
    """A greedy stream with return_token_ids, as the router sends a migratable one."""
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    chunks = await sse(client, path, {"temperature": 0, "ignore_eos": True, **body, "return_token_ids": True})
    if kind == "chat":
        prompt_ids = chunks[0]["prompt_token_ids"]
        chunks = chunks[1:]
    else:
        prompt_ids = chunks[0]["choices"][0]["prompt_token_ids"]
    chunks = [c for c in chunks if c["choices"]]
    return Piece(prompt_ids, [c["choices"][0]["token_ids"] for c in chunks], [chunk_text(c, kind) for c in chunks],
                 chunks[-1]["choices"][0]["finish_reason"])


def stop_across_chunks(piece: Piece) -> tuple[str, int, int]:
    """Three characters of `piece`'s text that its chunks j and j + 1 share, found there
    first (none U+FFFD), and the range of id counts the one completing them ends in."""
    texts = piece.texts
    for j in range(1, len(texts) - 1):
        stop = texts[j][-1:] + texts[j + 1][:2]
        if len(stop) == 3 and REPLACEMENT_CHAR not in stop and piece.text.find(stop) == len("".join(texts[:j + 1])) - 1:
            return stop, piece.boundaries[j + 1] + 1, piece.boundaries[j + 2]
    raise AssertionError(f"no usable stop string in {piece.text!r}")


async def detokenize(client: httpx.AsyncClient, model: str, ids: list[int]) -> str:
    r = await client.post("/detokenize", json={"model": model, "tokens": ids})
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"prompt"}
    return r.json()["prompt"]  # type: ignore[no-any-return]


@dataclass
class Seam:
    """A greedy stream continued after its first k generated ids."""

    k: int
    prompt_ids: list[int]
    whole: Piece
    rest: Piece

    @property
    def same_tokens(self) -> bool:
        return self.rest.token_ids == self.whole.token_ids[self.k:]

    @property
    def same_text(self) -> bool:
        """Streamed before the break + the continuation's text is the unbroken text."""
        return self.whole.text_upto(self.k) + self.rest.text == self.whole.text


async def continued(client: httpx.AsyncClient, model: str, kind: str, base: dict[str, Any], n: int,
                    ks: list[int]) -> list[Seam]:
    """The greedy stream of `base` (n tokens), continued at each k of `ks` that is a chunk
    boundary as the router continues a broken one: a completions prompt of the prompt's
    ids + the first k generated ids, n - k more tokens."""
    whole = await stream(client, kind, {**base, "max_tokens": n})
    assert len(whole.token_ids) == n, whole
    seams = []
    for k in (k for k in ks if k in whole.boundaries):
        rest = await stream(client, "completion", {
            "model": model, "prompt": whole.prompt_ids + whole.token_ids[:k], "max_tokens": n - k})
        seams.append(Seam(k, whole.prompt_ids, whole, rest))
    return seams
