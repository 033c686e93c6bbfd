"""`meridian demo --engine vllm`'s node, against real vLLM (its CPU build): the demo's model
(SmolLM2-135M-Instruct, converted from its GGUF; head_dim 64, which vLLM's CPU attention
needs) served with the deployment spec the local fabric writes, behind a router.

The spec turns tool calling on (`--enable-auto-tool-choice --tool-call-parser pythonic`):
without it vLLM answers any request with tools and the default tool_choice ("auto") with 400,
so the OpenAI client's ordinary tool use failed on the vLLM demo. One vLLM serves the module.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import jsonschema
import openai
import pytest
import pytest_asyncio
from tenant_fabric import MODEL, TenantFabric, tenant_fabric
from vllm_fabric import ALICE, WEATHER, require_vllm

from cli.demo import QUESTION
from localfabric.fabric import vllm_node_spec

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(900)]

ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris for the next two days?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fabric(smollm2_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[TenantFabric]:
    require_vllm()
    spec = tmp_path_factory.mktemp("vllm-demo") / "spec.json"
    spec.write_text(json.dumps(vllm_node_spec(MODEL)))
    node = {"engine": "vllm", "vllm_gpu_count": 0, "vllm_executable": "auto", "deployment_spec_file": spec,
            "vllm_startup_timeout_s": 400.0, "vllm_probe_interval_s": 0.5, "drain_timeout_s": 30.0,
            "vllm_max_restarts": 1, "max_tokens_limit": 256}
    async with tenant_fabric(smollm2_checkpoint, [ALICE], node=node,
                             router={"read_timeout_s": 180.0, "request_timeout_s": 240.0,
                                     "tokenizer_dirs": {MODEL: smollm2_checkpoint}}) as f:
        yield f


def oai(fabric: TenantFabric) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{fabric.router_url}/v1", api_key=ALICE.key, timeout=240, max_retries=0)


async def test_the_demo_question_is_answered_on_vllm_too(fabric: TenantFabric) -> None:
    answer = await oai(fabric).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=32, temperature=0)
    assert "Paris" in (answer.choices[0].message.content or ""), answer


async def test_tools_with_the_default_tool_choice_are_answered(fabric: TenantFabric) -> None:
    answer = await oai(fabric).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=64, temperature=0)  # type: ignore[list-item]
    choice = answer.choices[0]
    # A small model may answer in words or call the tool; either way the request is served.
    assert choice.message.content or choice.message.tool_calls, choice


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"],
                         ids=["named", "required"])
async def test_a_forced_tool_call_names_the_function_with_valid_arguments(fabric: TenantFabric,
                                                                          tool_choice: object) -> None:
    answer = await oai(fabric).chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=[WEATHER],  # type: ignore[list-item]
        tool_choice=tool_choice, max_tokens=128, temperature=0)  # type: ignore[arg-type]
    calls = answer.choices[0].message.tool_calls
    assert calls, answer.choices[0]
    assert calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
