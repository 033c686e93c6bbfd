"""The chat template where current transformers saves it: chat_template.jinja.

transformers 5 writes a tokenizer's chat template to chat_template.jinja and leaves it out of
tokenizer_config.json. A node that read only tokenizer_config.json answered every chat of such
a checkpoint with 400 ("no chat template"). Here the checkpoint is saved by transformers itself,
and a node on it answers chats; a checkpoint with no template at all is named in a warning when
the node starts, not discovered at the first chat.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from node_testkit import CHAT_REQUEST, MODEL_NAME, asgi_client, make_settings
from transformers import AutoTokenizer

from data_plane.server.app import create_app
from meridian.tokenizer import CHAT_TEMPLATE_FILE, ChatTokenizer


def _copy_weights(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def saved_by_transformers(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with its tokenizer saved by transformers (5.x) save_pretrained."""
    out = _copy_weights(tiny_checkpoint, tmp_path_factory.mktemp("hf5") / "tiny-llama")
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(out)
    return out


def test_transformers_saves_the_template_beside_the_config_not_in_it(saved_by_transformers: Path) -> None:
    # The layout this test is about; if transformers changed it again, the tests below say nothing.
    assert (saved_by_transformers / CHAT_TEMPLATE_FILE).is_file()
    assert "chat_template" not in json.loads((saved_by_transformers / "tokenizer_config.json").read_text())


async def test_a_node_answers_chats_of_a_checkpoint_saved_by_transformers(saved_by_transformers: Path) -> None:
    async with asgi_client(create_app(make_settings(saved_by_transformers))) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT_REQUEST, "max_tokens": 4})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    # The prompt was laid out by the template: header tokens and all, as in tokenizer_config.json.
    assert body["usage"]["prompt_tokens"] == len(
        ChatTokenizer.from_dir(saved_by_transformers).apply_chat_template(CHAT_REQUEST["messages"]))
    assert body["choices"][0]["message"]["role"] == "assistant"


def test_the_template_file_wins_over_the_config(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # As in transformers: a checkpoint carrying both is read with the file's template.
    d = tmp_path / "both"
    shutil.copytree(tiny_checkpoint, d)
    (d / CHAT_TEMPLATE_FILE).write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tok = ChatTokenizer.from_dir(d)
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "[user] hi\n"


async def test_a_node_without_a_template_warns_at_start_and_still_serves_completions(
    tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    d = _copy_weights(tiny_checkpoint, tmp_path / "bare")
    shutil.copy(tiny_checkpoint / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="data_plane.engine.base"):
        async with asgi_client(create_app(make_settings(d, model_name=MODEL_NAME))) as client:
            warned = [r.getMessage() for r in caplog.records if "no chat template" in r.getMessage()]
            assert warned and MODEL_NAME in warned[0], caplog.text
            chat = await client.post("/v1/chat/completions", json={**CHAT_REQUEST, "max_tokens": 4})
            completion = await client.post("/v1/completions", json={
                "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4})
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    assert completion.status_code == 200


async def test_a_checkpoint_with_a_template_starts_without_the_warning(
    saved_by_transformers: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="data_plane.engine.base"):
        async with asgi_client(create_app(make_settings(saved_by_transformers))) as client:
            assert (await client.get("/health")).status_code == 200
    assert "no chat template" not in caplog.text
