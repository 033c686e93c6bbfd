"""Fixtures: one tiny checkpoint per session (seed 0), its model config (`base`, what LoRA
adapters are made for) and a node app built on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from node_testkit import MODEL_NAME, make_settings

from data_plane.engine.torch_engine import TorchEngine
from data_plane.model.llama import LlamaConfig
from data_plane.model.loader import read_config
from data_plane.model.make_tiny import make_tiny_checkpoint
from data_plane.server.app import create_app
from meridian.settings.node import NodeSettings


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL_NAME, seed=0)


@pytest.fixture(scope="module")
def base(tiny_checkpoint: Path) -> LlamaConfig:
    return LlamaConfig.from_hf(read_config(tiny_checkpoint))


@pytest.fixture
async def engine(tiny_checkpoint: Path) -> AsyncIterator[TorchEngine]:
    """A started torch engine on the tiny checkpoint, four sequences at a time."""
    eng = TorchEngine(make_settings(tiny_checkpoint, max_num_seqs=4))
    await eng.start()
    yield eng
    await eng.stop()


@pytest.fixture
def node_settings(tiny_checkpoint: Path) -> NodeSettings:
    return make_settings(tiny_checkpoint)


@pytest.fixture
async def node_app(node_settings: NodeSettings) -> AsyncIterator[FastAPI]:
    app = create_app(node_settings)
    async with app.router.lifespan_context(app):
        await app.state.runtime.wait_ready()
        yield app


@pytest.fixture
async def client(node_app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=node_app)
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as c:
        yield c
