"""A checkpoint's tokenizer: tokenizer.json for ids, the jinja chat template for chat prompts,
and incremental decoding for streaming.

The chat template is chat_template.jinja where the checkpoint has one (transformers 5 saves it
there and leaves it out of tokenizer_config.json; like transformers, the file wins), else
tokenizer_config.json's "chat_template".

Shared by nodes and routers: a router that templates and tokenises a chat exactly as the
node does gets the same token ids, hence the same KV block hashes (meridian.block_hash).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders

# U+FFFD is what a byte-level decoder produces for an incomplete UTF-8 sequence.
REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens a detokenizer decodes new tokens against (spaces, a character's first bytes).
CONTEXT_TOKENS = 6
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class ChatTemplateError(ValueError):
    """The chat template is missing or failed to render these messages."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as a string or as an
    # AddedToken dict {"content": ...}, depending on the transformers version.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    # Same as transformers' override: the jinja default HTML-escapes, which templates
    # that embed tool schemas do not expect.
    return json.dumps(value, indent=indent, ensure_ascii=False)


class ChatTokenizer:
    """Encode, decode and apply the chat template of one checkpoint."""

    def __init__(self, tokenizer: Tokenizer, config: dict[str, Any]) -> None:
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template = config.get("chat_template")
        if isinstance(template, list):
            # Newer configs list named templates; "default" is the chat one.
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(self.chat_template) if self.chat_template else None
        eos_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_id: int | None = eos_id

    @classmethod
    def from_dir(cls, model_dir: Path) -> ChatTokenizer:
        """Load tokenizer.json and the (optional) tokenizer_config.json and chat_template.jinja
        of a checkpoint."""
        model_dir = Path(model_dir)
        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        cfg_path = model_dir / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        template_path = model_dir / CHAT_TEMPLATE_FILE
        if template_path.is_file():
            config["chat_template"] = template_path.read_text(encoding="utf-8")
        return cls(tok, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id in its raw form (byte-level BPE spelling)."""
        return self._tok.id_to_token(token_id)

    def added_tokens(self) -> dict[int, AddedToken]:
        """The tokens added to the vocabulary (special and not), by id: the tokenizer cuts a
        text at these before it encodes the pieces between them."""
        return self._tok.get_added_tokens_decoder()

    @property
    def is_byte_level(self) -> bool:
        """Whether vocabulary entries spell bytes with GPT-2's byte-to-character map."""
        return isinstance(self._tok.decoder, decoders.ByteLevel)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of text; add_special_tokens adds what the tokenizer's post-processor
        adds (for Llama 3: <|begin_of_text|>)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_offsets(
        self, text: str, *, add_special_tokens: bool = True
    ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of text and each token's (start, end) character span in it."""
        encoding = self._tok.encode(text, add_special_tokens=add_special_tokens)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """The prompt text the chat template makes of these messages."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; use /v1/completions")
        try:
            return self._template.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, ValueError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat prompt. The template writes the BOS token
        itself, so the post-processor must not add another."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.encode(text, add_special_tokens=False)

    def detokenizer(
        self, *, skip_special_tokens: bool = True, context: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        """A detokenizer for the tokens that follow `context` (the prompt's ids)."""
        return IncrementalDetokenizer(self, skip_special_tokens=skip_special_tokens, context=context)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Byte-level BPE tokens can end in the middle of a UTF-8 character, and decoding
    single tokens loses the spaces some decoders insert between them, so each step
    decodes a short window of recent tokens and emits only what became final.

    The window starts with the tail of `context` (the prompt), as vLLM primes its decoder
    with the prompt: a generation continued from token ids (a migrated stream: prompt +
    what was generated so far) then reads exactly as the unbroken one. The context's
    trailing tokens that decode to U+FFFD (an unfinished character, stray bytes) count as
    not yet read, as the unbroken stream had not emitted them either: they come out with
    the next token, whole characters where it finishes them.
    """

    def __init__(
        self, tokenizer: ChatTokenizer, *, skip_special_tokens: bool = True, context: Sequence[int] = ()
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = self._read_upto(self._ids)

    def _read_upto(self, tail: list[int]) -> int:
        """Where the context's emitted text ends: before its trailing U+FFFD tokens."""
        read = len(tail)
        while read and self._tok.decode(tail[:read], skip_special_tokens=self._skip).endswith(REPLACEMENT_CHAR):
            read -= 1
        return read

    def push(self, token_id: int) -> str:
        """Add one token and return the text that is now complete (may be empty)."""
        self._ids.append(token_id)
        prefix = self._tok.decode(
            self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip
        )
        full = self._tok.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip)
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix = self._tok.decode(
            self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=self._skip
        )
        full = self._tok.decode(self._ids[self._prefix_offset:], skip_special_tokens=self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""
