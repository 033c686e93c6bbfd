"""The engine's per-token log-probabilities in OpenAI's two layouts: chat's `content` list
(token, logprob, bytes, top_logprobs) and the legacy completions' parallel lists."""

from __future__ import annotations

import re
from collections.abc import Sequence

from data_plane.engine.base import TokenLogprob
from data_plane.server.protocol import (
    LOGPROB_FLOOR,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)
from meridian.tokenizer import ChatTokenizer

# SentencePiece byte-fallback pieces stand for one raw byte each.
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the character a piece uses for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_OF_CHAR = _byte_level_table()


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class TokenTexts:
    """Text and UTF-8 bytes of single token ids, as logprobs show them; cached per id.

    The text is the id decoded on its own with special tokens kept (what vLLM reports),
    so a token holding part of a multi-byte character reads as U+FFFD; its bytes are the
    token's real bytes, which is what OpenAI's `bytes` field is for.
    """

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        self.tokenizer = tokenizer
        self._byte_level = tokenizer.is_byte_level
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def utf8(self, token_id: int) -> list[int]:
        return self._entry(token_id)[1]

    def _entry(self, token_id: int) -> tuple[str, list[int]]:
        entry = self._cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            entry = self._cache[token_id] = (text, self._token_bytes(token_id, text))
        return entry

    def _token_bytes(self, token_id: int, text: str) -> list[int]:
        piece = self.tokenizer.id_to_token(token_id)
        if piece is not None:
            fallback = _BYTE_PIECE.fullmatch(piece)
            if fallback is not None:
                return [int(fallback.group(1), 16)]
            if self._byte_level and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
                # Added tokens are stored verbatim rather than byte-mapped: trust the mapping
                # only when it reads back as what the tokenizer decodes.
                if raw.decode("utf-8", errors="replace") == text:
                    return list(raw)
        return list(text.encode("utf-8"))


def _label(texts: TokenTexts, token_id: int, as_ids: bool) -> str:
    # vLLM's return_tokens_as_token_ids spelling.
    return f"token_id:{token_id}" if as_ids else texts.text(token_id)


def chat_logprobs(
    entries: Sequence[TokenLogprob], top_logprobs: int, texts: TokenTexts, *, as_ids: bool = False
) -> list[ChatTokenLogprob]:
    """Chat's `logprobs.content`: one item per token, with its `top_logprobs` best first."""
    return [
        ChatTokenLogprob(
            token=_label(texts, e.token_id, as_ids),
            logprob=_floor(e.logprob),
            bytes=texts.utf8(e.token_id),
            top_logprobs=[
                TopLogprob(token=_label(texts, tid, as_ids), logprob=_floor(lp),
                           bytes=texts.utf8(tid))
                for tid, lp in sorted(e.top, key=lambda p: -p[1])[:top_logprobs]
            ],
        )
        for e in entries
    ]


def completion_logprobs(
    entries: Sequence[TokenLogprob], texts: TokenTexts, text_offset: int = 0, *, as_ids: bool = False
) -> CompletionLogprobs:
    """The completions layout for these tokens; `text_offset` is where the first one starts.

    Offsets advance by each token's text length, as vLLM computes them (by the text even
    when tokens are named by id). `top_logprobs` maps token to logprob for the chosen
    token and the requested alternatives, best first: up to `logprobs` + 1 entries, as
    OpenAI documents.
    """
    out = CompletionLogprobs()
    offset = text_offset
    for e in entries:
        out.tokens.append(_label(texts, e.token_id, as_ids))
        out.token_logprobs.append(_floor(e.logprob))
        top: dict[str, float] = {}
        for tid, lp in sorted(((e.token_id, e.logprob), *e.top), key=lambda p: -p[1]):
            # Two ids can share a text (U+FFFD halves of characters): keep the likelier.
            top.setdefault(_label(texts, tid, as_ids), _floor(lp))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(texts.text(e.token_id))
    return out
