"""Stream migration on real vLLM (its CPU build): the router resumes a broken stream exactly.

One vLLM node serves the module (its start costs ~50 s); the router reaches it as `near`
through a fault proxy and as `far` directly (migration_fabric). Greedy streams cut by a
connection reset at several points must come out token-identical to unbroken runs: the
router continues from vLLM's own `return_token_ids` with a /v1/completions request whose
prompt is the token ids, and asks vLLM's /detokenize for text held back at the seam.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from migration_fabric import MigrationRig, migration_rig, stream
from tenant_fabric import MODEL
from vllm_fabric import require_vllm, vllm_fabric

pytestmark = pytest.mark.asyncio(loop_scope="module")

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "write a long poem about the sea"}],
        "max_tokens": 64, "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}}
COMPLETION = {"model": MODEL, "prompt": "the sea is", "max_tokens": 64, "temperature": 0, "ignore_eos": True,
              "stream": True}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[MigrationRig]:
    require_vllm()
    root: Path = tmp_path_factory.mktemp("vllm-migration")
    async with vllm_fabric(root) as fabric, migration_rig(fabric.node_url, root / "router.jsonl") as r:
        yield r


@pytest.mark.parametrize("break_after", [1, 20, 50])
async def test_a_vllm_chat_stream_resumes_token_identical(rig: MigrationRig, break_after: int) -> None:
    unbroken = await stream(rig, "/v1/chat/completions", CHAT)
    assert unbroken.done and len(unbroken.token_ids) == 64
    got = await stream(rig, "/v1/chat/completions", CHAT, break_after=break_after)
    assert got.error is None and got.done
    assert got.token_ids == unbroken.token_ids and got.text == unbroken.text
    assert len({e["id"] for e in got.events}) == 1
    assert got.trailer is not None and got.trailer["node"] == "far"
    assert got.events[-1]["usage"]["completion_tokens"] == 64


async def test_a_vllm_completion_resumes_with_the_ids_hidden_from_a_client_that_did_not_ask(rig: MigrationRig) -> None:
    unbroken = await stream(rig, "/v1/completions", {**COMPLETION, "return_token_ids": True})
    got = await stream(rig, "/v1/completions", COMPLETION, break_after=None)
    assert got.token_ids == [] and got.text == unbroken.text
    # The break needs ids to count events by: count on a stream that asked, compare text.
    broken = await stream(rig, "/v1/completions", {**COMPLETION, "return_token_ids": True}, break_after=30)
    assert broken.error is None and broken.text == unbroken.text and broken.token_ids == unbroken.token_ids
    assert broken.trailer is not None and broken.trailer["migrations"] == 1
