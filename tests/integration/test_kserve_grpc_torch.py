"""The gRPC endpoint (KServe v2 + Triton's streaming) through a real router to a real torch
node, called with `tritonclient.grpc` as Triton's and KServe's users call it.

`infer` answers what /v1/completions answers (with the prompt in front, as Triton's vLLM
backend does unless `exclude_input_in_output`); `start_stream`/`async_stream_infer` streams
the same text piece by piece; a node killed mid-stream costs the stream nothing (the router
migrates it), and the last response says it is the last.
"""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
import tritonclient.grpc as triton_sync
import tritonclient.grpc.aio as triton
from migration_fabric import CAROL, PACE_BYTES_PER_S, MigrationRig, migration_rig, stream
from router_harness import ServerGroup
from tenant_fabric import MODEL, node_settings

from data_plane.model.make_tiny import make_tiny_checkpoint
from data_plane.server.app import create_app as create_node_app

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "the sea is"
SAMPLING = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}
HEADERS = {"authorization": f"Bearer {CAROL.key}"}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MigrationRig]:
    root = tmp_path_factory.mktemp("kserve")
    checkpoint = make_tiny_checkpoint(root / MODEL, seed=0)
    servers = ServerGroup()
    try:
        node = create_node_app(node_settings(checkpoint, max_tokens_limit=128))
        node_url = await servers.start(node)
        await node.state.runtime.wait_ready()
        async with migration_rig(node_url, root / "router.jsonl", inter_token_timeout_s=1.0, grpc_port=0) as r:
            yield r
    finally:
        await servers.stop()


def _inputs(module: Any, *, stream: bool, exclude: bool | None = None) -> list[Any]:
    text = module.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
    flag = module.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    params = module.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(SAMPLING).encode()], dtype=np.object_))
    inputs = [text, flag, params]
    if exclude is not None:
        ex = module.InferInput("exclude_input_in_output", [1], "BOOL")
        ex.set_data_from_numpy(np.array([exclude], dtype=bool))
        inputs.append(ex)
    return inputs


async def _http_text(rig: MigrationRig) -> str:
    body = {"model": MODEL, "prompt": PROMPT, **SAMPLING, "stream": True}
    return (await stream(rig, "/v1/completions", body)).text


def _stream_sync(target: str, on_piece: Any = None) -> list[Any]:
    """start_stream + async_stream_infer with the thread-based client, as its users do."""
    results: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = triton_sync.InferenceServerClient(target)
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=HEADERS)
    try:
        client.async_stream_infer(MODEL, _inputs(triton_sync, stream=True), request_id="s1",
                                  enable_empty_final_response=True)
        got = []
        while True:
            result, error = results.get(timeout=60)
            assert error is None, error
            got.append(result)
            if on_piece is not None:
                on_piece(len(got))
            if result.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def _text(results: list[Any]) -> str:
    out = []
    for r in results:
        array = r.as_numpy("text_output")
        if array is not None:
            out.extend(x.decode() for x in array)
    return "".join(out)


async def test_infer_answers_what_completions_answers(rig: MigrationRig) -> None:
    expected = await _http_text(rig)
    async with triton.InferenceServerClient(f"127.0.0.1:{rig.grpc_port}") as client:
        result = await client.infer(MODEL, _inputs(triton, stream=False), headers=HEADERS)
        excluded = await client.infer(MODEL, _inputs(triton, stream=False, exclude=True), headers=HEADERS)
    assert result.as_numpy("text_output")[0].decode() == PROMPT + expected
    assert excluded.as_numpy("text_output")[0].decode() == expected and expected


async def test_a_stream_sends_the_text_piece_by_piece(rig: MigrationRig) -> None:
    expected = await _http_text(rig)
    results = await asyncio.to_thread(_stream_sync, f"127.0.0.1:{rig.grpc_port}")
    assert _text(results) == expected
    assert len(results) > 5  # pieces, not one answer
    assert {r.get_response().id for r in results} == {"s1"}
    # The empty final response the client asked for ends it.
    assert results[-1].as_numpy("text_output") is None


async def test_a_node_killed_mid_stream_costs_the_stream_nothing(rig: MigrationRig) -> None:
    expected = await _http_text(rig)
    rig.proxy.set_bandwidth(PACE_BYTES_PER_S, "downstream")
    loop = asyncio.get_running_loop()
    try:
        results = await asyncio.to_thread(
            _stream_sync, f"127.0.0.1:{rig.grpc_port}",
            lambda n: n == 8 and loop.call_soon_threadsafe(rig.proxy.reset))
    finally:
        rig.proxy.heal()
    assert _text(results) == expected
    assert rig.proxy.stats.reset >= 1
