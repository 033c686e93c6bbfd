"""A request's prefix keys: what the router matches against what nodes have cached.

Two kinds, for the two prefix indexes:

- `token_hashes`: Meridian's chained block hashes (meridian.block_hash) of the prompt's
  full blocks. The prompt is templated and tokenised exactly as the node does it (same
  chat template, same tokenizer, BOS as the node adds it) and the LoRA adapter and cache
  salt are folded in as the torch engine folds them, so they equal the hashes the node
  publishes in its BlockStored events: the exact index matches them. They need the
  model's tokenizer (RouterSettings.tokenizer_dirs / tokenizer_root) and the block size.
- `text_keys`: a chained 64-bit hash over fixed-size byte chunks of a canonical rendering of
  the prompt (role and content of each message; the prompt string; the token ids), seeded
  with the model name (adapter included) and the cache salt. They need no tokenizer and
  are the same at every router whatever tokenizers it has, which is what lets routers
  share the routing history (geo_router.state.prefix_history) they key.

Tokenising is CPU work on the event loop, so only about the first `prefix_max_tokens`
tokens are: a longer prompt's text is cut first (at as many characters as the cap's
worth of tokens takes in this model's prompts so far, plus 10%) and tokens near the cut are
dropped, since the whole prompt may tokenise differently there. A prompt that was cut is `truncated`; its hashes still equal the
node's for every block before the cut in practice, but past the cap they are a routing
hint, not a guarantee. A tokenizer is loaded on first use in a worker thread; until it is
there (and forever when it is missing or broken: one warning) the request simply has no
`token_hashes`. Nothing here ever fails a request.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meridian.block_hash import hash_blocks
from meridian.settings.router import RouterSettings
from meridian.tokenizer import ChatTemplateError, ChatTokenizer

from .candidates import split_adapter
from .prompt_tokens import PromptTokens

log = logging.getLogger(__name__)

# Characters per token assumed until a model's own prompts have shown theirs (English with
# Llama 3's tokenizer: ~4.5), and the weight of each new observation, from prompts of at
# least _DENSITY_MIN_TOKENS tokens.
_CHARS_PER_TOKEN = 4.0
_DENSITY_ALPHA = 0.2
_DENSITY_MIN_TOKENS = 256
# Text cut before tokenising covers the cap's worth of tokens with this much to spare.
_BUDGET_SLACK = 1.1
# Tokens ending this close to a cut may tokenise differently in the whole prompt.
_CUT_MARGIN_CHARS = 64
# The canonical text behind text_keys is cut at this many bytes per allowed token.
_TEXT_BYTES_PER_TOKEN = 4
# The node's message roles (data_plane.server.protocol.ChatMessage); others are a 400 there.
_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# Separators of the canonical chat rendering (ASCII unit and record separators).
_UNIT, _RECORD = b"\x1f", b"\x1e"
_TOKEN_ID = struct.Struct(">I")


@dataclass(frozen=True, slots=True)
class RequestPrefix:
    """The prefix keys of one request (see the module docstring)."""

    # Chained block hashes of the prompt's full blocks; None without tokenizer or block size.
    token_hashes: list[int] | None
    # Prompt tokens hashed (at most prefix_max_tokens); without a tokenizer, an estimate
    # from the canonical text's length.
    num_tokens: int
    block_size: int | None
    # Chained hashes of the canonical prompt text's full chunks (the routing-history keys).
    text_keys: list[int]
    adapter: str | None
    # The prompt was longer than the cap: only its beginning is in the keys.
    truncated: bool = False
    # The hashed token ids and the salt folded in: hashes for another block size (nodes
    # differ: vLLM's CPU build uses 128, GPU backends and the torch engine 16).
    token_ids: list[int] | None = field(default=None, compare=False)
    cache_salt: str | None = field(default=None, compare=False)
    _by_size: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def hashes_for(self, block_size: int) -> list[int] | None:
        """The chained hashes of the prompt's full blocks of `block_size` tokens."""
        if block_size == self.block_size and self.token_hashes is not None:
            return self.token_hashes
        if self.token_ids is None or block_size < 1:
            return None
        hashes = self._by_size.get(block_size)
        if hashes is None:
            hashes = self._by_size[block_size] = hash_blocks(self.token_ids, block_size, self.adapter, self.cache_salt)
        return hashes


@dataclass(frozen=True, slots=True)
class _Chat:
    """Messages as the node hands them to its chat template."""

    messages: list[dict[str, str]]


_Prompt = _Chat | str | list[int]


class PrefixKeyBuilder:
    """Builds RequestPrefix for requests; holds the tokenizers it loaded, per base model."""

    def __init__(self, settings: RouterSettings) -> None:
        self._dirs = dict(settings.tokenizer_dirs)
        self._root = settings.tokenizer_root
        self._max_tokens = settings.prefix_max_tokens
        self._chunk_bytes = settings.prefix_text_chunk_bytes
        # base model -> its tokenizer, or None when it has none (or it failed to load).
        self._tokenizers: dict[str, ChatTokenizer | None] = {}
        self._loading: dict[str, asyncio.Future[ChatTokenizer | None]] = {}
        # base model -> characters per token in its prompts (sizes the text cut before encoding).
        self._density: dict[str, float] = {}
        self._pieces = PromptTokens()

    def build(self, model: str, payload: Mapping[str, Any], block_size: int | None) -> RequestPrefix:
        """The prefix keys of a /v1/chat/completions or /v1/completions request body."""
        base, adapter = split_adapter(model)
        salt = payload.get("cache_salt")
        cache_salt = salt if isinstance(salt, str) and salt else None
        prompt = _prompt_of(payload)
        if prompt is None:
            return RequestPrefix(None, 0, block_size, [], adapter)
        text_keys, text_bytes, text_cut = self._text_keys(model, cache_salt, prompt)
        token_hashes: list[int] | None = None
        num_tokens = text_bytes // _TEXT_BYTES_PER_TOKEN
        truncated = text_cut
        ids: list[int] | None = None
        if block_size:
            tokens = self._prompt_ids(base, prompt, cache_salt)
            if tokens is not None:
                ids, truncated = tokens
                token_hashes = hash_blocks(ids, block_size, adapter, cache_salt)
                num_tokens = len(ids)
        return RequestPrefix(token_hashes, num_tokens, block_size, text_keys, adapter, truncated,
                             token_ids=ids, cache_salt=cache_salt)

    async def preload(self, model: str) -> bool:
        """Load `model`'s tokenizer now (off the event loop); whether it has one."""
        base, _ = split_adapter(model)
        if self.tokenizer(base) is not None:
            return True
        loading = self._loading.get(base)
        if loading is not None:
            await asyncio.shield(loading)
        return self._tokenizers.get(base) is not None

    def tokenizer(self, base: str) -> ChatTokenizer | None:
        """`base`'s tokenizer if loaded; starts loading it in a worker thread if not."""
        try:
            return self._tokenizers[base]
        except KeyError:
            pass
        directory = self._directory(base)
        if directory is None:
            self._tokenizers[base] = None
            return None
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            tokenizer = self._load(base, directory)
            self._tokenizers[base] = tokenizer
            return tokenizer
        if base not in self._loading:
            # Parsing a real tokenizer.json takes a good fraction of a second: not on the loop.
            future = loop.run_in_executor(None, self._load, base, directory)
            self._loading[base] = future
            future.add_done_callback(lambda f: self._loaded(base, f))
        return None

    def _loaded(self, base: str, future: asyncio.Future[ChatTokenizer | None]) -> None:
        self._loading.pop(base, None)
        if not future.cancelled():
            self._tokenizers[base] = future.result()

    def _directory(self, base: str) -> Path | None:
        if base in self._dirs:
            return self._dirs[base]
        # The name comes from the request: never let it leave the root.
        if self._root is not None and base and Path(base).name == base and not base.startswith("."):
            return self._root / base
        return None

    @staticmethod
    def _load(base: str, directory: Path) -> ChatTokenizer | None:
        try:
            return ChatTokenizer.from_dir(directory)
        except Exception as exc:  # noqa: BLE001 - a bad tokenizer costs affinity, never a request
            log.warning(
                "no tokenizer for model %s in %s (%s: %s); its requests are routed without "
                "matching the nodes' KV events", base, directory, type(exc).__name__, exc,
            )
            return None

    # --- token ids, as the node computes them ----------------------------------------------

    def _prompt_ids(self, base: str, prompt: _Prompt, salt: str | None) -> tuple[list[int], bool] | None:
        """The prompt's leading token ids (at most the cap), and whether it was longer."""
        if isinstance(prompt, list):
            return prompt[: self._max_tokens], len(prompt) > self._max_tokens
        tokenizer = self.tokenizer(base)
        if tokenizer is None:
            return None
        if isinstance(prompt, str):
            # The node encodes a completion prompt with the post-processor's BOS.
            return self._encode(base, tokenizer, prompt, add_special_tokens=True)
        budget = self._budget(base)
        messages = prompt.messages
        add_generation_prompt = True
        total = 0
        for i, m in enumerate(messages):
            total += len(m["content"])
            if total > budget:
                # Only the messages the cut reaches: templating a huge chat is work too. For
                # usual templates their rendering is a prefix of the whole chat's.
                messages, add_generation_prompt = messages[: i + 1], False
                break
        try:
            text = tokenizer.render_chat(messages, add_generation_prompt=add_generation_prompt)
        except ChatTemplateError as exc:
            log.debug("chat template failed for %s: %s", base, exc)  # the node answers 400
            return None
        ids, truncated = self._encode(base, tokenizer, text, add_special_tokens=False, salt=salt)
        return ids, truncated or not add_generation_prompt

    def _budget(self, base: str) -> int:
        """Characters of prompt text to tokenise for the cap's worth of tokens."""
        density = self._density.get(base, _CHARS_PER_TOKEN)
        return int(self._max_tokens * density * _BUDGET_SLACK) + _CUT_MARGIN_CHARS

    def _encode(
        self, base: str, tokenizer: ChatTokenizer, text: str, *, add_special_tokens: bool, salt: str | None = None
    ) -> tuple[list[int], bool]:
        cap = self._max_tokens
        budget = self._budget(base)
        if len(text) <= budget:
            # A chat's text (no post-processor tokens) by cached pieces: a conversation's next
            # turn encodes only its new messages (geo_router.selection.prompt_tokens).
            ids = (self._pieces.encode(tokenizer, text, salt) if not add_special_tokens
                   else tokenizer.encode(text, add_special_tokens=True))
            self._observe_density(base, len(text), len(ids))
            return ids[:cap], len(ids) > cap
        ids, offsets = tokenizer.encode_with_offsets(text[:budget], add_special_tokens=add_special_tokens)
        self._observe_density(base, budget, len(ids))
        n, limit = len(ids), budget - _CUT_MARGIN_CHARS
        while n and offsets[n - 1][1] > limit:
            n -= 1
        return ids[: min(n, cap)], True

    def _observe_density(self, base: str, chars: int, tokens: int) -> None:
        if tokens >= _DENSITY_MIN_TOKENS:
            seen = chars / tokens
            density = self._density.get(base, seen)
            self._density[base] = density + _DENSITY_ALPHA * (seen - density)

    # --- text keys ------------------------------------------------------------------------

    def _text_keys(self, model: str, cache_salt: str | None, prompt: _Prompt) -> tuple[list[int], int, bool]:
        """(keys, bytes of canonical text they cover or would, whether it was cut)."""
        limit = self._max_tokens * _TEXT_BYTES_PER_TOKEN
        kind, text, cut = _canonical(prompt, limit)
        seed = f"{kind}\x1f{model}\x1f{cache_salt or ''}".encode()
        return chain_chunks(seed, text, self._chunk_bytes), len(text), cut


def chain_chunks(seed: bytes, data: bytes, chunk_bytes: int) -> list[int]:
    """64-bit chained hashes of `data`'s full chunks: each covers its parent and its chunk."""
    parent = hashlib.blake2b(seed, digest_size=8).digest()
    keys: list[int] = []
    for start in range(0, len(data) - chunk_bytes + 1, chunk_bytes):
        parent = hashlib.blake2b(parent + data[start:start + chunk_bytes], digest_size=8).digest()
        keys.append(int.from_bytes(parent, "big"))
    return keys


def _canonical(prompt: _Prompt, limit: int) -> tuple[str, bytes, bool]:
    """(kind, canonical bytes of the prompt up to `limit`, whether they were cut)."""
    if isinstance(prompt, str):
        data = prompt[:limit].encode("utf-8")
        return "text", data[:limit], len(data) > limit or len(prompt) > limit
    if isinstance(prompt, list):
        ids = prompt[: limit // _TOKEN_ID.size]
        return "ids", b"".join(_TOKEN_ID.pack(t & 0xFFFFFFFF) for t in ids), len(ids) < len(prompt)
    parts: list[bytes] = []
    size = 0
    for m in prompt.messages:
        part = m["role"].encode() + _UNIT + m["content"][:limit].encode("utf-8") + _RECORD
        parts.append(part)
        size += len(part)
        if size > limit:
            return "chat", b"".join(parts)[:limit], True
    return "chat", b"".join(parts), False


def _prompt_of(payload: Mapping[str, Any]) -> _Prompt | None:
    """The prompt as the node reads it from the body; None when the node would refuse it.

    Anthropic's messages put the system prompt in `system`, the responses API in
    `instructions` with the conversation in `input` (a string: one user message); vLLM
    templates both as chat messages with the system prompt first.
    """
    messages = payload.get("messages")
    if messages is not None:
        return _with_system(_chat_messages(messages), payload.get("system"))
    given = payload.get("input")
    if given is not None:
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        return _with_system(_chat_messages(items), payload.get("instructions"))
    prompt = payload.get("prompt")
    # As CompletionRequest.prompt_text_or_ids: one prompt, a string or token ids.
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0] if len(prompt) == 1 else None
    if isinstance(prompt, str):
        return prompt or None
    if isinstance(prompt, list) and prompt and all(type(t) is int and t >= 0 for t in prompt):
        return list(prompt)
    return None


def _with_system(chat: _Chat | None, system: object) -> _Chat | None:
    if chat is None or system is None:
        return chat
    text = _content_text(system)
    return None if text is None else _Chat([{"role": "system", "content": text}, *chat.messages])


# Text parts of every API: chat's and Anthropic's "text", the responses API's input and output text.
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})


def _content_text(content: object) -> str | None:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") in _TEXT_PARTS]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            return None
        return "".join(t for t in texts if isinstance(t, str))
    return None


def _chat_messages(messages: object) -> _Chat | None:
    """What ChatMessage.for_template makes of each message: role and text only."""
    if not isinstance(messages, list) or not messages:
        return None
    out: list[dict[str, str]] = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            return None
        text = _content_text(m.get("content"))
        if text is None:
            return None
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": text})
    return _Chat(out)
