"""POST /tokenize and /detokenize on torch nodes, with vLLM 0.32's bodies, so that a router
speaks to both node kinds alike (a vLLM node passes the same paths through to vLLM).

tokenize: {"model", "prompt", "add_special_tokens"=true} or {"model", "messages",
"add_generation_prompt"=true, "add_special_tokens"=false} -> {"count", "max_model_len",
"tokens", "token_strs"} (token_strs null unless `return_token_strs`).
detokenize: {"model", "tokens"} -> {"prompt": text}, special tokens kept, as vLLM decodes.

The router's stream migration asks /detokenize what text a broken stream had generated but
not yet sent (held back for a stop string or half a character). Bad input is an OpenAI
400 (ids outside the vocabulary, more ids than a sequence can hold) or 404 (model), never a
500; `model` may be left out (the served model), as vLLM allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from data_plane.server.body import decode_json_object, read_body
from data_plane.server.errors import BadRequestError, validation_error
from data_plane.server.protocol import ChatMessage
from meridian.settings.node import NodeSettings
from meridian.tokenizer import ChatTokenizer


class _TokenizeBase(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, min_length=1, max_length=200)
    return_token_strs: bool | None = False


class TokenizeCompletionRequest(_TokenizeBase):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeBase):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    # The chat template writes the special tokens itself.
    add_special_tokens: bool = False
    continue_final_message: bool = False

    @field_validator("continue_final_message")
    @classmethod
    def _no_prefill(cls, v: bool) -> bool:
        if v:
            raise ValueError("continue_final_message is not supported by the torch engine")
        return v


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = Field(None, min_length=1, max_length=200)
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize_request(data: dict[str, Any]) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The body as vLLM reads it: with `messages`, a chat; else a prompt."""
    kind: type[TokenizeCompletionRequest | TokenizeChatRequest] = (
        TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest)
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None


def check_detokenizable(tokens: list[int], vocab_size: int, max_model_len: int) -> None:
    """400 unless every id is in the vocabulary and a sequence could hold them all."""
    if len(tokens) > max_model_len:
        raise BadRequestError(
            f"{len(tokens)} tokens are more than this model's maximum context length "
            f"({max_model_len})", param="tokens")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})",
                              param="tokens")


def tokenize(tokenizer: ChatTokenizer, req: TokenizeCompletionRequest | TokenizeChatRequest,
             max_model_len: int) -> TokenizeResponse:
    if isinstance(req, TokenizeChatRequest):
        text = tokenizer.render_chat([m.for_template() for m in req.messages],
                                     add_generation_prompt=req.add_generation_prompt)
    else:
        text = req.prompt
    ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    strs = None
    if req.return_token_strs:
        strs = [tokenizer.id_to_token(t) or "" for t in ids]
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


class TokenizationService:
    """The two routes of a torch node; `resolve_model` 404s a model the node does not serve."""

    def __init__(self, settings: NodeSettings, tokenizer: Callable[[], ChatTokenizer],
                 resolve_model: Callable[[str], Awaitable[object]]) -> None:
        self._settings = settings
        self._tokenizer = tokenizer
        self._resolve_model = resolve_model

    async def tokenize(self, request: Request) -> TokenizeResponse:
        req = tokenize_request(await self._body(request))
        if req.model is not None:
            await self._resolve_model(req.model)
        # Templating and encoding up to max_request_bytes of text: off the event loop.
        return await asyncio.to_thread(tokenize, self._tokenizer(), req, self._settings.max_model_len)

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        try:
            req = DetokenizeRequest.model_validate(await self._body(request))
        except ValidationError as exc:
            raise validation_error(exc) from None
        if req.model is not None:
            await self._resolve_model(req.model)
        tokenizer = self._tokenizer()
        check_detokenizable(req.tokens, tokenizer.vocab_size, self._settings.max_model_len)
        text = await asyncio.to_thread(tokenizer.decode, req.tokens, skip_special_tokens=False)
        return DetokenizeResponse(prompt=text)

    async def _body(self, request: Request) -> dict[str, Any]:
        return decode_json_object(await read_body(request, self._settings.max_request_bytes))

