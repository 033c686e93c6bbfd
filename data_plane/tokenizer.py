"""A checkpoint's tokenizer: moved to meridian.tokenizer, which routers share; re-exported here."""

from __future__ import annotations

from meridian.tokenizer import (
    REPLACEMENT_CHAR,
    ChatTemplateError,
    ChatTokenizer,
    IncrementalDetokenizer,
)

__all__ = ["REPLACEMENT_CHAR", "ChatTemplateError", "ChatTokenizer", "IncrementalDetokenizer"]
