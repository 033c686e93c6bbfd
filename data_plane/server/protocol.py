"""OpenAI-compatible request and response bodies of the node (pydantic v2).

Request models validate against per-node limits passed as validation context
({"max_tokens_limit": int}); unknown fields are ignored, as vLLM does, so newer
OpenAI clients keep working.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_STOP_SEQUENCES = 4

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
    logprobs: bool = False

    @field_validator("max_completion_tokens")
    @classmethod
    def _max_completion_tokens_in_range(cls, v: int | None, info: ValidationInfo) -> int | None:
        return _check_max_tokens(v, info)

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool) -> bool:
        if v:
            raise ValueError("logprobs are not supported")
        return v

    @model_validator(mode="after")
    def _completion_tokens_alias(self) -> ChatCompletionRequest:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(GenerationParams):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None

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

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise ValueError("logprobs are not supported")
        return v

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


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReasonField
    logprobs: None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    # Only the keys that changed: {"role": ...} first, then {"content": ...}, {} at the end.
    delta: dict[str, str]
    finish_reason: FinishReasonField = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: FinishReasonField = None
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None
