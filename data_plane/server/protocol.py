"""OpenAI-compatible request and response bodies of the node (pydantic v2).

Request models validate against per-node limits passed as validation context
({"max_tokens_limit": int}); unknown fields are ignored, as vLLM does, so newer
OpenAI clients keep working. vLLM's extensions the node honours (top_k, ignore_eos,
stop_token_ids, cache_salt, return_tokens_as_token_ids, return_token_ids) keep vLLM's names
and meaning.

Token ids (`return_token_ids`, vLLM >= 0.10.2) sit where vLLM 0.32 puts them: chat has
`prompt_token_ids` at the top level (whole answer; the first, role, chunk of a stream) and
`token_ids` in each choice; completions have both in the choice. They are what the router
resumes a broken stream from, so a torch node must give them exactly as a vLLM node does.
Unasked, they are left out altogether: no `null` keys for clients that never asked.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_STOP_SEQUENCES = 4
# OpenAI's limit for chat top_logprobs. Completions' `logprobs` gets the same one: OpenAI
# documents 5, but vLLM accepts up to its default --max-logprobs (20), and a request a
# vLLM node takes must not fail on a torch node behind the same router.
MAX_TOP_LOGPROBS = 20
MAX_CACHE_SALT_CHARS = 256
# JSON has no -inf; OpenAI and vLLM report "very unlikely" as this floor.
LOGPROB_FLOOR = -9999.0

FinishReasonField = Literal["stop", "length"] | None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class GenerationParams(BaseModel):
    """Fields shared by chat completions and completions."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=200)
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions the router and benchmarks rely on.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    # -1 and 0 both disable top-k, as in vLLM.
    top_k: int | None = None
    # Requests with different salts never share prefix-cache entries (tenant isolation).
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # Logprobs name tokens "token_id:<id>": unambiguous where texts collide or are not valid UTF-8.
    return_tokens_as_token_ids: bool | None = None
    # The prompt's and the generated token ids in the answer (vLLM's; stream migration).
    return_token_ids: bool | None = None
    # Prefill/decode hand-off (meridian.kv_transfer, vLLM's keys): served by a node that takes
    # part in one (data_plane.server.kv_transfer), a 400 on any other.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_in_range(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(v, info)

    @field_validator("top_k")
    @classmethod
    def _top_k_in_range(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise ValueError("must be -1 or 0 (disabled), or at least 1")
        return v

    def engine_top_k(self) -> int:
        """top_k as the engine takes it: 0 when disabled."""
        return self.top_k if self.top_k is not None and self.top_k > 0 else 0

    def engine_logprobs(self) -> int | None:
        """How many alternatives per token the engine should report; None: no logprobs."""
        return None

    @field_validator("stop")
    @classmethod
    def _stop_sequences(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list):
            if len(v) > MAX_STOP_SEQUENCES:
                raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed")
            if any(not s for s in v):
                raise ValueError("stop sequences must not be empty")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


def _check_max_tokens(v: int | None, info: ValidationInfo) -> int | None:
    if v is None:
        return v
    if v < 1:
        raise ValueError("must be at least 1")
    limit = (info.context or {}).get("max_tokens_limit")
    if limit is not None and v > limit:
        raise ValueError(f"must be at most {limit}")
    return v


class TextContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for the system role.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ChatCompletionRequest(GenerationParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens_in_range(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(v, info)

    @model_validator(mode="after")
    def _completion_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("requires logprobs to be true")
        return v

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationParams):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("prompt")
    @classmethod
    def _single_prompt(
        cls, v: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], str | list) and len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        elif not v:
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    def engine_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_text_or_ids(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        first = p[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return list(first)
        return [int(t) for t in p if isinstance(t, int)]


# --- responses ------------------------------------------------------------------------

_TOKEN_ID_KEYS = ("prompt_token_ids", "token_ids")


def _without_unasked_ids(data: dict[str, Any]) -> dict[str, Any]:
    """A serialised body without token-id keys that were not asked for (None)."""
    for key in _TOKEN_ID_KEYS:
        if key in data and data[key] is None:
            del data[key]
    return data


class _TokenIdsOmittedWhenUnset(BaseModel):
    """Token-id fields are serialised only when set: vLLM-shaped when asked, absent else."""

    @model_serializer(mode="wrap")
    def _omit_unasked_ids(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_unasked_ids(handler(self))


class PromptTokensDetails(BaseModel):
    # Prompt tokens whose KV came from the prefix cache.
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _omit_missing_details(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Only reported when something was cached, as vLLM does; no `null` otherwise.
        data: dict[str, Any] = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class TopLogprob(BaseModel):
    """One candidate token at a position of a chat completion."""

    token: str
    logprob: float
    # The token's UTF-8 bytes: tokens that split a character cannot be shown as text.
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """The chosen token at a position, and the most likely ones there (best first)."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions layout: parallel lists, one entry per generated token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    # The chosen token and the `logprobs` most likely ones, keyed like `tokens`.
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_TokenIdsOmittedWhenUnset):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReasonField
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_TokenIdsOmittedWhenUnset):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None


class ChatChunkChoice(_TokenIdsOmittedWhenUnset):
    index: int = 0
    # Only the keys that changed: {"role": ...} first, then {"content": ...}, {} at the end.
    delta: dict[str, str]
    finish_reason: FinishReasonField = None
    logprobs: ChatLogprobs | None = None
    # The ids generated in this chunk, whether or not their text is in it yet.
    token_ids: list[int] | None = None


class ChatCompletionChunk(_TokenIdsOmittedWhenUnset):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
    # On the first (role) chunk only.
    prompt_token_ids: list[int] | None = None


class CompletionChoice(_TokenIdsOmittedWhenUnset):
    index: int = 0
    text: str
    finish_reason: FinishReasonField = None
    logprobs: CompletionLogprobs | None = None
    # In a stream, prompt_token_ids is on the first chunk only; token_ids on every chunk.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
