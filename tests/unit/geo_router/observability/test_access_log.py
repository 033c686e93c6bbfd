"""The access line's token counts, read from each API's answer without decoding all of it."""

from __future__ import annotations

import json

import pytest

from geo_router.observability.access_log import _tokens
from geo_router.observability.accounting import body_usage as _body_usage


@pytest.mark.parametrize(("answer", "tokens"), [
    ({"choices": [{"message": {"content": 'say "usage": {"prompt_tokens": 999}'}}],
      "usage": {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}}, (12, 5)),
    ({"output": [], "usage": {"input_tokens": 7, "output_tokens": 3}}, (7, 3)),  # responses, messages
    ({"usage": {"prompt_tokens": 4, "total_tokens": 4}}, (4, None)),  # embeddings: no completion
    ({"choices": []}, (None, None)),
    ({"usage": None}, (None, None)),
])
def test_tokens_of_a_whole_answer(answer: dict[str, object], tokens: tuple[int | None, int | None]) -> None:
    assert _tokens(_body_usage(json.dumps(answer, indent=1).encode())) == tokens


def test_a_truncated_or_foreign_body_has_no_tokens() -> None:
    assert _body_usage(b'{"usage": {"prompt_tok') is None
    assert _body_usage(b"not json at all") is None
