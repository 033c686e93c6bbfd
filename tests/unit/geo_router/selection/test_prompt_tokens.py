"""A chat prompt encoded by cached pieces (geo_router.selection.prompt_tokens): the same ids as
encoding it whole, for every tokenizer, and a conversation's next turn encodes only what is new."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from data_plane.model.make_tiny import make_tiny_checkpoint
from geo_router.selection.prompt_tokens import PromptTokens
from meridian.tokenizer import ChatTokenizer

WORDS = "the router keeps each tenant in its zone and prefers replicas holding the cache of a prompt".split()


class Counting(ChatTokenizer):
    """A ChatTokenizer that counts the characters it was asked to encode."""

    encoded_chars = 0

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        return super().encode(text, add_special_tokens=add_special_tokens)


def conversation(rng: random.Random, turns: int) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "You are terse. " * rng.randint(1, 8)}]
    for i in range(turns):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 80)))
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text + rng.choice(["", "\n", "  ", "!"])})
    return messages


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0)


def test_pieces_give_the_whole_texts_ids_and_a_next_turn_encodes_only_its_new_text(tiny: Path) -> None:
    tokenizer = Counting.from_dir(tiny)
    assert isinstance(tokenizer, Counting)
    pieces = PromptTokens()
    rng = random.Random(7)
    for _ in range(30):
        messages = conversation(rng, rng.randint(1, 12))
        text = tokenizer.render_chat(messages)
        assert pieces.encode(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)
    # Past the first prompts (checked whole too), a conversation's turn encodes its new message.
    messages = conversation(rng, 10)
    pieces.encode(tokenizer, tokenizer.render_chat(messages))
    messages.append({"role": "user", "content": "and what of the zones?"})
    text = tokenizer.render_chat(messages)
    before = tokenizer.encoded_chars
    ids = pieces.encode(tokenizer, text)
    assert tokenizer.encoded_chars - before < 60, "only the new message (and its role line) is encoded"
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def metaspace_first(tmp_path: Path) -> ChatTokenizer:
    """A SentencePiece-style tokenizer whose "▁" goes only at the start of a text: encoding a
    piece on its own differs from encoding it in context."""
    vocab = {"<unk>": 0, "<s>": 1, "<|im_start|>": 2, "<|im_end|>": 3}
    for word in ["▁" + w for w in WORDS] + WORDS + ["▁", "user", "▁user", "\n", "▁\n"]:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.add_special_tokens([AddedToken("<|im_start|>", special=True, normalized=False),
                            AddedToken("<|im_end|>", special=True, normalized=False)])
    directory = tmp_path / "metaspace"
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    return ChatTokenizer.from_dir(directory)


def test_a_tokenizer_whose_pieces_differ_from_the_whole_is_encoded_whole(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = metaspace_first(tmp_path)
    pieces = PromptTokens()
    text = "<|im_start|>user the router<|im_end|><|im_start|>the zone<|im_end|>"
    whole = tokenizer.encode(text, add_special_tokens=False)
    assert pieces.encode(tokenizer, text) == whole
    assert "encoded whole" in caplog.text
    for _ in range(40):  # long past the checked prompts: still whole, still right
        assert pieces.encode(tokenizer, text) == whole


def test_the_piece_cache_stays_within_its_bound_and_stays_right(tiny: Path) -> None:
    tokenizer = ChatTokenizer.from_dir(tiny)
    pieces = PromptTokens(max_chars=2_000)
    rng = random.Random(3)
    for _ in range(60):
        text = tokenizer.render_chat(conversation(rng, rng.randint(1, 8)))
        assert pieces.encode(tokenizer, text) == tokenizer.encode(text, add_special_tokens=False)
        assert pieces.cached_chars <= 2_000


def test_pieces_are_cached_per_tenant_salt(tiny: Path) -> None:
    """A tenant must not be able to time whether another sent a text: its pieces are its own."""
    tokenizer = Counting.from_dir(tiny)
    assert isinstance(tokenizer, Counting)
    pieces = PromptTokens()
    rng = random.Random(5)
    for _ in range(20):  # past the prompts also encoded whole to check the pieces
        pieces.encode(tokenizer, tokenizer.render_chat(conversation(rng, 3)), "tenant-c")
    text = tokenizer.render_chat(conversation(rng, 6))
    pieces.encode(tokenizer, text, "tenant-a")
    before = tokenizer.encoded_chars
    pieces.encode(tokenizer, text, "tenant-b")
    assert tokenizer.encoded_chars - before >= len(text) // 2, "tenant b's prompt was encoded, not served from a's pieces"
    before = tokenizer.encoded_chars
    pieces.encode(tokenizer, text, "tenant-a")
    assert tokenizer.encoded_chars - before < len(text) // 2
