"""Tokenizer: round trips, Llama 3 chat layout, and streaming-safe decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from meridian.tokenizer import REPLACEMENT_CHAR, ChatTemplateError, ChatTokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln — naïve café, 東京で寿司を食べた 🍣🎉!",
    "  leading spaces,\ttabs\nand newlines  ",
]


@pytest.fixture(scope="module")
def tok(tiny_checkpoint: Path) -> ChatTokenizer:
    return ChatTokenizer.from_dir(tiny_checkpoint)


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: ChatTokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_plain_encode_starts_with_bos(tok: ChatTokenizer) -> None:
    ids = tok.encode("hello")
    assert ids[0] == tok.token_to_id("<|begin_of_text|>")
    assert tok.decode(ids) == "hello"


def test_common_words_are_single_tokens(tok: ChatTokenizer) -> None:
    # The tokenizer was trained, not just byte-level: frequent words merge.
    for word in (" the", " is", " and"):
        assert len(tok.encode(word, add_special_tokens=False)) == 1, word


def test_chat_template_renders_llama3_layout(tok: ChatTokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi! "}]
    text = tok.render_chat(messages)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = tok.apply_chat_template(messages)
    # Special tokens become single ids, and BOS appears exactly once.
    assert ids.count(tok.token_to_id("<|begin_of_text|>")) == 1
    assert ids.count(tok.token_to_id("<|eot_id|>")) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    no_prompt = tok.render_chat(messages, add_generation_prompt=False)
    assert not no_prompt.endswith("<|end_header_id|>\n\n")


def test_template_is_sandboxed_and_errors_are_typed(tiny_checkpoint: Path) -> None:
    raw = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    evil = ChatTokenizer(raw, {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(ChatTemplateError):
        evil.render_chat([{"role": "user", "content": "x"}])
    strict = ChatTokenizer(raw, {"chat_template": "{{ raise_exception('roles must alternate') }}"})
    with pytest.raises(ChatTemplateError, match="alternate"):
        strict.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTokenizer(raw, {}).render_chat([{"role": "user", "content": "x"}])


def test_special_tokens_from_added_token_dicts(tiny_checkpoint: Path) -> None:
    raw = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    cfg = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|eot_id|>", "special": True}
    assert ChatTokenizer(raw, cfg).eos_token_id == raw.token_to_id("<|eot_id|>")


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decode_never_emits_partial_characters(tok: ChatTokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    detok = tok.detokenizer()
    pieces = [detok.push(i) for i in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any(REPLACEMENT_CHAR in p for p in pieces)


def test_multibyte_character_split_across_tokens_waits(tok: ChatTokenizer) -> None:
    ids = tok.encode("🍣", add_special_tokens=False)
    assert len(ids) > 1  # a rare 4-byte character is several byte tokens
    detok = tok.detokenizer()
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🍣"
