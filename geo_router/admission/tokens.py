"""What a request costs in tokens, before and after it is answered.

The rate limiter charges a request up front (`estimate_tokens`, no tokenizer: prompt
characters / 4 plus the completion budget) and corrects the charge once the answer says
what it used (`usage_tokens`, in each API's own shape). Pure functions of the request's
and the answer's JSON, shared by admission and settlement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

DEFAULT_COMPLETION_TOKENS = 256
_CHARS_PER_TOKEN = 4
# `n` beyond this is not a real request; it would only make the estimate absurd.
_MAX_CHOICES = 128


def estimate_tokens(
    payload: Mapping[str, Any], default_completion_tokens: int = DEFAULT_COMPLETION_TOKENS
) -> int:
    """Tokens to charge up front: prompt characters / 4 (rounded up) plus the completion budget.

    Cheap on purpose (no tokenizer): `settle` corrects it once the answer's usage is known.
    The budget is max_completion_tokens, else max_tokens, else `default_completion_tokens`,
    times `n` choices.
    """
    budget = _int_field(payload, "max_completion_tokens")
    if budget is None:
        budget = _int_field(payload, "max_tokens")  # completions, Anthropic's messages
    if budget is None:
        budget = _int_field(payload, "max_output_tokens")  # responses
    if budget is None:
        budget = default_completion_tokens
    choices = _int_field(payload, "n")
    choices = min(max(choices or 1, 1), _MAX_CHOICES)
    return estimate_prompt_tokens(payload) + budget * choices


def estimate_prompt_tokens(payload: Mapping[str, Any]) -> int:
    """The prompt part of `estimate_tokens`: characters / 4 (rounded up) plus token ids given as such."""
    chars, token_ids = _prompt_size(payload)
    return -(-chars // _CHARS_PER_TOKEN) + token_ids


def usage_tokens(answer: Mapping[str, Any]) -> int | None:
    """Tokens an answer (or a stream's usage chunk) reports it used, in each API's own shape:
    OpenAI's prompt/completion/total tokens, or the responses and Anthropic messages APIs'
    input/output tokens; None if it says not."""
    usage = answer.get("usage")
    if not isinstance(usage, Mapping):
        return None
    total = _int_field(usage, "total_tokens")
    if total is not None:
        return total
    for prompt_key, completion_key in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
        prompt, completion = _int_field(usage, prompt_key), _int_field(usage, completion_key)
        if prompt is not None or completion is not None:
            return (prompt or 0) + (completion or 0)
    return None


def usage_split(answer: Mapping[str, Any]) -> tuple[int, int] | None:
    """(prompt, completion) tokens an answer's usage reports, in the same shapes as
    `usage_tokens`; None if it reports neither (a total alone counts as prompt)."""
    usage = answer.get("usage")
    if not isinstance(usage, Mapping):
        return None
    for prompt_key, completion_key in (("prompt_tokens", "completion_tokens"), ("input_tokens", "output_tokens")):
        prompt, completion = _int_field(usage, prompt_key), _int_field(usage, completion_key)
        if prompt is not None or completion is not None:
            return prompt or 0, completion or 0
    total = _int_field(usage, "total_tokens")
    return (total, 0) if total is not None else None


def _int_field(payload: Mapping[str, Any], name: str) -> int | None:
    value = payload.get(name)
    # bool is an int to Python, not to JSON.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _prompt_size(payload: Mapping[str, Any]) -> tuple[int, int]:
    """(characters of prompt text, token ids given as such) in a chat, completions, responses
    (`input`, `instructions`) or Anthropic messages (`system`) request."""
    chars = _text_chars(payload.get("instructions")) + _text_chars(payload.get("system"))
    token_ids = 0
    for key in ("messages", "input"):
        items = payload.get(key)
        if isinstance(items, str):
            chars += len(items)
        elif isinstance(items, list):
            chars += sum(_text_chars(m.get("content")) for m in items if isinstance(m, Mapping))
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        for item in prompt:
            if isinstance(item, str):
                chars += len(item)
            elif isinstance(item, int):
                token_ids += 1
            elif isinstance(item, list):
                token_ids += len(item)
    return chars, token_ids


def _text_chars(content: Any) -> int:
    """Characters of a message's content: a string, or text parts of any API's kind."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(t) for p in content if isinstance(p, Mapping) and isinstance(t := p.get("text"), str))
    return 0
