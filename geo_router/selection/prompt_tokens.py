"""A chat prompt's token ids by pieces, cached: a conversation's next turn encodes only its new text.

Affinity matches a prompt's KV blocks, so the router tokenises each chat-templated prompt as
the node will, on the event loop: a 1,446-token chat costs 1.9 ms to encode with
SmolLM2's tokenizer on this project's 2-core box (rendering its template 0.06 ms), and every
turn of a conversation re-encodes all the earlier messages. HF tokenizers split a text at its
added tokens (`<|im_start|>`, `<|im_end|>`, …) before normalising, pre-tokenising and modelling
each piece on its own, so a text's ids are its pieces' ids and the added tokens' own, in
order. Chat templates write such tokens around every message, so the pieces are the messages;
each piece's ids are kept (LRU, at most `max_chars` characters of pieces), and a turn encodes
only the pieces it has not seen. Pieces are cached per tenant (the request's cache salt, as the
nodes' prefix caches are: geo_router.ingress.isolation): a cached piece answers 10–40× sooner,
and a tenant must not be able to time whether another sent a text.

The split is only at added tokens that match exactly (no lstrip, rstrip or single-word rule,
not normalised): the others change the text around them, and stay inside a piece. A
pre-tokenizer may still treat the first piece of a text differently from the others (a
SentencePiece-converted model's Metaspace with `prepend_scheme: first` adds its "▁" only at
the very start), which piece-by-piece encoding would get wrong; so the first _VERIFY prompts
of each tokenizer are encoded whole as well and compared, and a tokenizer whose pieces ever
disagree with the whole is encoded whole from then on (logged once).
"""

from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

from meridian.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

# Prompts per tokenizer encoded both ways before its pieces are trusted.
_VERIFY = 16
DEFAULT_MAX_CHARS = 8_000_000  # ≈ 2M tokens of pieces; tens of MiB


@dataclass(frozen=True, slots=True)
class _Splitter:
    pattern: re.Pattern[str]
    ids: dict[str, int]


class PromptTokens:
    """Encodes chat prompts (no post-processor tokens) piece by piece, with a piece cache."""

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        self._max_chars = max_chars
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        self._chars = 0
        # per tokenizer (by identity: one per base model): its splitter, None when it cannot
        # be split (no exact added tokens, or its pieces disagreed with the whole)
        self._splitters: dict[int, _Splitter | None] = {}
        self._unverified: dict[int, int] = {}

    @property
    def cached_chars(self) -> int:
        return self._chars

    def encode(self, tokenizer: ChatTokenizer, text: str, salt: str | None = None) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, from cached pieces where it can;
        only pieces cached under the same `salt` (the request's tenant cache salt) are used."""
        key = id(tokenizer)
        if key not in self._splitters:
            self._splitters[key] = _splitter_of(tokenizer)
            self._unverified[key] = _VERIFY
        splitter = self._splitters[key]
        if splitter is None:
            return tokenizer.encode(text, add_special_tokens=False)
        ids = self._by_pieces(tokenizer, splitter, text, f"{key}\x00{salt or ''}\x00")
        if self._unverified[key] > 0:
            self._unverified[key] -= 1
            whole = tokenizer.encode(text, add_special_tokens=False)
            if whole != ids:
                log.warning("prompt tokens: this tokenizer encodes a text differently from its pieces; "
                            "its prompts are encoded whole")
                self._splitters[key] = None
                return whole
        return ids

    def _by_pieces(self, tokenizer: ChatTokenizer, splitter: _Splitter, text: str, scope: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in splitter.pattern.finditer(text):
            if match.start() > start:
                ids += self._piece(tokenizer, scope, text[start:match.start()])
            ids.append(splitter.ids[match.group()])
            start = match.end()
        if start < len(text):
            ids += self._piece(tokenizer, scope, text[start:])
        return ids

    def _piece(self, tokenizer: ChatTokenizer, scope: str, piece: str) -> list[int]:
        # Keyed by tokenizer (two models' pieces of equal text are not the same ids) and salt.
        key = scope + piece
        ids = self._pieces.get(key)
        if ids is not None:
            self._pieces.move_to_end(key)
            return ids
        ids = tokenizer.encode(piece, add_special_tokens=False)
        self._pieces[key] = ids
        self._chars += len(key)
        while self._chars > self._max_chars and self._pieces:
            old, _ = self._pieces.popitem(last=False)
            self._chars -= len(old)
        return ids


def _splitter_of(tokenizer: ChatTokenizer) -> _Splitter | None:
    exact = {t.content: i for i, t in tokenizer.added_tokens().items()
             if t.content and not (t.lstrip or t.rstrip or t.single_word or t.normalized)}
    if not exact:
        return None
    # Longest first: an added token that begins another must not cut it.
    alternatives = "|".join(re.escape(c) for c in sorted(exact, key=len, reverse=True))
    return _Splitter(re.compile(alternatives), exact)
