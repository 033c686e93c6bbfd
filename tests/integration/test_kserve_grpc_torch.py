"""The gRPC endpoint (KServe v2 + Triton's streaming) through a real router to a real torch
node, called with `tritonclient.grpc` as Triton's and KServe's users call it.

`infer` answers what /v1/completions answers (with the prompt in front, as Triton's vLLM
backend does unless `exclude_input_in_output`); `start_stream`/`async_stream_infer` streams
the same text piece by piece; a node killed mid-stream costs the stream nothing (the router
migrates it), and the last response says it is the last.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import tritonclient.grpc.aio as triton
from migration_fabric import PACE_BYTES_PER_S, MigrationRig, torch_rig
from protocol_clients import HEADERS, completion_text, triton_inputs, triton_stream, triton_text
from tenant_fabric import MODEL

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPT = "the sea is"
SAMPLING = {"max_tokens": 32, "temperature": 0, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MigrationRig]:
    async with torch_rig(tmp_path_factory.mktemp("kserve"), inter_token_timeout_s=1.0, grpc_port=0) as r:
        yield r


async def _http_text(rig: MigrationRig) -> str:
    return await completion_text(rig, PROMPT, SAMPLING)


async def test_infer_answers_what_completions_answers(rig: MigrationRig) -> None:
    expected = await _http_text(rig)
    async with triton.InferenceServerClient(f"127.0.0.1:{rig.grpc_port}") as client:
        result = await client.infer(MODEL, triton_inputs(triton, PROMPT, SAMPLING, stream=False), headers=HEADERS)
        excluded = await client.infer(MODEL, triton_inputs(triton, PROMPT, SAMPLING, stream=False, exclude=True), headers=HEADERS)
    assert result.as_numpy("text_output")[0].decode() == PROMPT + expected
    assert excluded.as_numpy("text_output")[0].decode() == expected and expected


async def test_a_stream_sends_the_text_piece_by_piece(rig: MigrationRig) -> None:
    expected = await _http_text(rig)
    results = await asyncio.to_thread(triton_stream, f"127.0.0.1:{rig.grpc_port}", PROMPT, SAMPLING)
    assert triton_text(results) == expected
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
            triton_stream, f"127.0.0.1:{rig.grpc_port}", PROMPT, SAMPLING,
            lambda n: n == 8 and loop.call_soon_threadsafe(rig.proxy.reset))
    finally:
        rig.proxy.heal()
    assert triton_text(results) == expected
    assert rig.proxy.stats.reset >= 1
