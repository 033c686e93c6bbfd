"""Prefill/decode disaggregation between two torch nodes (meridian.kv_transfer), as the
router drives it: the prefill node answers a one-token request with `kv_transfer_params`
naming its held KV; the decode node, handed those params with the original request, pulls
the KV over HTTP and generates. Greedy output must be token for token a co-located node's,
whether the KV arrived or had to be recomputed (lease expired, handle unknown, another
model), and the decode node must account the prompt as vLLM does (external_kv_transfer).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from node_testkit import (
    MODEL_NAME,
    TOKEN,
    StandInControlPlane,
    asgi_client,
    eventually,
    make_settings,
    running_server,
)
from prometheus_client.parser import text_string_to_metric_families
from token_ids_contract import stream

from data_plane.server.app import create_app
from meridian.clock import ManualClock
from meridian.contracts import KVConnector, KVTransferInfo, NodeRole
from meridian.kv_transfer import decode_params, prefill_request_params
from meridian.ports import free_port

AUTH = {"Authorization": f"Bearer {TOKEN}"}
LEASE_S = 30.0
N = 12
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


def body(kind: str, text: str, model: str = MODEL_NAME) -> dict[str, Any]:
    base: dict[str, Any] = {"model": model, "temperature": 0, "ignore_eos": True, "max_tokens": N,
                            "return_token_ids": True}
    if kind == "chat":
        return {**base, "messages": [{"role": "user", "content": text}]}
    return {**base, "prompt": text}


@dataclass
class Fabric:
    prefill: httpx.AsyncClient
    decode: httpx.AsyncClient
    colocated: httpx.AsyncClient
    prefill_app: Any
    decode_app: Any

    async def prefill_params(self, kind: str, request: dict[str, Any]) -> dict[str, Any]:
        """What the router does first: the request as a one-token prefill, its params back."""
        r = await self.prefill.post(PATHS[kind], json={
            **request, "max_tokens": 1, "stream": False, "kv_transfer_params": prefill_request_params()})
        assert r.status_code == 200, r.text
        return decode_params(r.json())

    async def whole(self, client: httpx.AsyncClient, kind: str, request: dict[str, Any]) -> dict[str, Any]:
        r = await client.post(PATHS[kind], json=request)
        assert r.status_code == 200, r.text
        return r.json()


def ids_of(kind: str, answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def prefill_usage(fabric: Fabric) -> float:
    return float(fabric.prefill_app.state.runtime.engine.stats().kv_cache_usage)


async def scrape(client: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = (await client.get("/metrics")).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def by_source(metrics: dict[Any, float], source: str) -> float:
    return metrics[("vllm:prompt_tokens_by_source_total", (("source", source),))]


@contextlib.asynccontextmanager
async def fabric(checkpoint: Path, *, clock: ManualClock | None = None,
                 decode_model: str | None = None) -> AsyncIterator[Fabric]:
    port = free_port()
    prefill_app = create_app(make_settings(
        checkpoint, role="prefill", host="127.0.0.1", port=port, node_id="prefill-1",
        cluster_token=TOKEN, kv_lease_s=LEASE_S), **({"clock": clock} if clock else {}))
    decode_app = create_app(make_settings(checkpoint, role="decode", node_id="decode-1", cluster_token=TOKEN,
                                          model_name=decode_model))
    colocated_app = create_app(make_settings(checkpoint, node_id="both-1", cluster_token=TOKEN))
    async with (running_server(prefill_app, port=port) as url,
                httpx.AsyncClient(base_url=url, headers=AUTH, timeout=30) as prefill,
                asgi_client(decode_app) as decode, asgi_client(colocated_app) as colocated):
        await prefill_app.state.runtime.wait_ready()
        for c in (decode, colocated):
            c.headers.update(AUTH)
        yield Fabric(prefill, decode, colocated, prefill_app, decode_app)


@pytest.mark.parametrize("kind", ["chat", "completion"])
async def test_disaggregated_greedy_output_is_the_colocated_output(tiny_checkpoint: Path, kind: str) -> None:
    async with fabric(tiny_checkpoint) as f:
        request = body(kind, "Tell me a story about a river city and its bridges.")
        expected = ids_of(kind, await f.whole(f.colocated, kind, request))

        params = await f.prefill_params(kind, request)
        assert params["remote_engine_id"] == "prefill-1" and params["tp_size"] == 1
        assert params["remote_host"] == "127.0.0.1" and params["remote_request_id"].startswith("kv-")
        assert params["remote_block_ids"] and params["remote_num_tokens"] > 16
        assert prefill_usage(f) > 0  # held for the decode node
        answer = await f.whole(f.decode, kind, {**request, "kv_transfer_params": params})
        assert ids_of(kind, answer) == expected
        prompt_tokens = answer["usage"]["prompt_tokens"]
        assert prompt_tokens == params["remote_num_tokens"]
        # Transferred tokens count as cached, as vLLM's usage counts them.
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt_tokens
        metrics = await scrape(f.decode)
        assert by_source(metrics, "external_kv_transfer") == prompt_tokens
        assert by_source(metrics, "local_compute") == 0
        assert metrics[("meridian_node_kv_pulls_total", (("outcome", "ok"),))] == 1
        # One read per handle: the prefill node let go of the blocks once they were pulled.
        assert prefill_usage(f) == 0
        assert (await f.prefill.get(f"/v1/kv/{params['remote_request_id']}")).status_code == 404

        # Streamed, a second prompt: the same tokens as the co-located stream.
        request = body(kind, "Name three colours of the evening sky, please.")
        colocated = await stream(f.colocated, kind, request)
        params = await f.prefill_params(kind, request)
        decoded = await stream(f.decode, kind, {**request, "kv_transfer_params": params})
        assert decoded.token_ids == colocated.token_ids and len(decoded.token_ids) == N
        assert decoded.text == colocated.text
        assert by_source(await scrape(f.decode), "local_compute") == 0


async def test_an_expired_lease_frees_the_blocks_and_the_decode_recomputes(tiny_checkpoint: Path) -> None:
    clock = ManualClock()
    async with fabric(tiny_checkpoint, clock=clock) as f:
        request = body("chat", "What is the tallest mountain in the river city?")
        expected = ids_of("chat", await f.whole(f.colocated, "chat", request))
        params = await f.prefill_params("chat", request)
        assert prefill_usage(f) > 0
        await eventually(lambda: clock.sleepers >= 1)
        await clock.advance_async(LEASE_S - 1)
        assert prefill_usage(f) > 0  # not yet
        await clock.advance_async(1)
        await eventually(lambda: prefill_usage(f) == 0)

        answer = await f.whole(f.decode, "chat", {**request, "kv_transfer_params": params})
        assert ids_of("chat", answer) == expected
        metrics = await scrape(f.decode)
        assert by_source(metrics, "external_kv_transfer") == 0
        assert by_source(metrics, "local_compute") == answer["usage"]["prompt_tokens"]
        assert metrics[("meridian_node_kv_pulls_total", (("outcome", "not_found"),))] == 1


async def test_delete_releases_held_kv_and_unknown_handles_are_404(tiny_checkpoint: Path) -> None:
    async with fabric(tiny_checkpoint) as f:
        params = await f.prefill_params("completion", body("completion", "The river city is"))
        handle = params["remote_request_id"]
        assert prefill_usage(f) > 0
        async with httpx.AsyncClient(base_url=str(f.prefill.base_url)) as anonymous:
            for method in ("GET", "DELETE"):
                assert (await anonymous.request(method, f"/v1/kv/{handle}")).status_code == 401
        assert prefill_usage(f) > 0  # an unauthenticated caller took nothing

        r = await f.prefill.delete(f"/v1/kv/{handle}")
        assert r.status_code == 204
        assert prefill_usage(f) == 0
        for method in ("GET", "DELETE"):
            r = await f.prefill.request(method, f"/v1/kv/{handle}")
            assert r.status_code == 404
            assert r.json()["error"]["code"] == "kv_not_found"


async def test_kv_of_another_model_is_refused_and_recomputed(tiny_checkpoint: Path) -> None:
    async with fabric(tiny_checkpoint, decode_model="tiny-llama-b") as f:
        request = body("completion", "Once upon a time in the river city")
        expected = ids_of("completion", await f.whole(f.colocated, "completion", request))
        params = await f.prefill_params("completion", request)
        answer = await f.whole(f.decode, "completion",
                               {**request, "model": "tiny-llama-b", "kv_transfer_params": params})
        assert ids_of("completion", answer) == expected
        metrics = await scrape(f.decode)
        assert metrics[("meridian_node_kv_pulls_total", (("outcome", "mismatch"),))] == 1
        assert by_source(metrics, "external_kv_transfer") == 0


async def test_an_unreachable_prefill_node_is_recomputed(tiny_checkpoint: Path) -> None:
    async with fabric(tiny_checkpoint) as f:
        request = body("chat", "Hello there")
        expected = ids_of("chat", await f.whole(f.colocated, "chat", request))
        params = {**await f.prefill_params("chat", request), "remote_port": free_port()}
        answer = await f.whole(f.decode, "chat", {**request, "kv_transfer_params": params})
        assert ids_of("chat", answer) == expected
        metrics = await scrape(f.decode)
        assert metrics[("meridian_node_kv_pulls_total", (("outcome", "unreachable"),))] == 1


async def test_a_colocated_node_refuses_a_hand_off_it_cannot_honour(client: httpx.AsyncClient) -> None:
    for params in (prefill_request_params(), {"do_remote_prefill": True, "remote_request_id": "kv-x"}):
        r = await client.post("/v1/completions", json={**body("completion", "Hi"), "kv_transfer_params": params})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "kv_transfer_params"
    # Params that ask for no hand-off ask for nothing (vLLM ignores them too).
    r = await client.post("/v1/completions", json={**body("completion", "Hi"), "kv_transfer_params": {}})
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in r.json()


async def test_a_disaggregated_node_registers_its_role_and_kv_transfer(tiny_checkpoint: Path) -> None:
    cp = StandInControlPlane()
    async with running_server(cp.app()) as url:
        settings = make_settings(tiny_checkpoint, control_plane_url=url, region="aws:us-east-1",
                                 node_id="decode-1", cluster_token=TOKEN, host="127.0.0.1", port=8123,
                                 role="decode", kv_lease_s=45)
        async with asgi_client(create_app(settings)):
            await eventually(lambda: cp.heartbeats())
        reg = cp.registrations()[0]
        assert reg.role is NodeRole.DECODE
        assert reg.kv_transfer == KVTransferInfo(connector=KVConnector.MERIDIAN, endpoint="127.0.0.1:8123",
                                                 lease_s=45)
        assert cp.heartbeats()[-1].load.waiting_prompt_tokens == 0


def test_the_torch_engine_has_no_nixl_connector(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match="MeridianConnector"):
        create_app(make_settings(tiny_checkpoint, role="prefill", kv_connector="NixlConnector"))
