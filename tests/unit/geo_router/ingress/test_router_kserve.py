"""The router's gRPC endpoint (KServe v2) with Triton's own client, in front of stand-in
nodes: the error mapping (bad key, unknown model, bad tensors, no replica in the zone, a
rate limit with its retry delay), residency from the key, health and reflection."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc.aio as triton
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from router_harness import (
    EU_KEY,
    GLOBAL_KEY,
    MODEL,
    NodeBehaviour,
    ServerGroup,
    make_table,
    node,
    node_app,
    router_settings,
    self_signed_cert,
    serve_router,
)
from tritonclient.utils import InferenceServerException

from geo_router import create_app
from geo_router.ingress.kserve import kserve_v2_pb2 as pb
from geo_router.ingress.kserve import kserve_v2_pb2_grpc as pb_grpc
from geo_router.state.table import StaticTableSource
from meridian.contracts import TenantEntry
from meridian.security import hash_api_key

LIMITED = "mrd_one-request-a-minute"


@dataclass
class GrpcRig:
    target: str
    behaviours: dict[str, NodeBehaviour]
    node_urls: dict[str, str]
    source: StaticTableSource

    def client(self) -> triton.InferenceServerClient:
        return triton.InferenceServerClient(self.target)


def _table(urls: dict[str, str], version: int = 1, names: tuple[str, ...] = ("us", "eu")):  # type: ignore[no-untyped-def]
    table = make_table([node(n, urls[n]) for n in names], version=version)
    table.tenants.append(TenantEntry(key_hash=hash_api_key(LIMITED), key_prefix=LIMITED[:10], tenant="slow",
                                     zone="global", requests_per_minute=1))
    return table


@pytest.fixture
async def rig() -> AsyncIterator[GrpcRig]:
    servers = ServerGroup()
    behaviours = {name: NodeBehaviour(name) for name in ("us", "eu")}
    try:
        urls = {name: await servers.start(node_app(b)) for name, b in behaviours.items()}
        source = StaticTableSource(_table(urls))
        app = create_app(router_settings(grpc_port=0), table_source=source)
        await servers.start(app)
        yield GrpcRig(f"127.0.0.1:{app.state.router.grpc.port}", behaviours, urls, source)
    finally:
        for b in behaviours.values():
            b.release.set()
        await servers.stop()


def _inputs(prompt: str = "hello", *, stream: bool = False, sampling: dict | None = None) -> list[triton.InferInput]:
    text = triton.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    flag = triton.InferInput("stream", [1], "BOOL")
    flag.set_data_from_numpy(np.array([stream], dtype=bool))
    params = triton.InferInput("sampling_parameters", [1], "BYTES")
    params.set_data_from_numpy(np.array([json.dumps(sampling or {"max_tokens": 4}).encode()], dtype=np.object_))
    return [text, flag, params]


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def _infer_error(rig: GrpcRig, key: str, model: str = MODEL, inputs=None) -> InferenceServerException:  # type: ignore[no-untyped-def]
    async with rig.client() as client:
        with pytest.raises(InferenceServerException) as failed:
            await client.infer(model, inputs or _inputs(), headers=_bearer(key))
    return failed.value


async def test_errors_map_to_grpc_codes(rig: GrpcRig) -> None:
    assert (await _infer_error(rig, "sk-wrong")).status() == "StatusCode.UNAUTHENTICATED"
    assert (await _infer_error(rig, GLOBAL_KEY, model="no-such-model")).status() == "StatusCode.NOT_FOUND"
    bad = triton.InferInput("text_input", [1], "INT32")
    bad.set_data_from_numpy(np.array([1], dtype=np.int32))
    invalid = await _infer_error(rig, GLOBAL_KEY, inputs=[bad])
    assert invalid.status() == "StatusCode.INVALID_ARGUMENT" and "text_input" in invalid.message()
    unknown = await _infer_error(rig, GLOBAL_KEY, inputs=_inputs(sampling={"max_tokens": 4, "beam_width": 3}))
    assert unknown.status() == "StatusCode.INVALID_ARGUMENT" and "beam_width" in unknown.message()
    assert rig.behaviours["us"].hits == rig.behaviours["eu"].hits == 0


async def test_a_rate_limit_is_resource_exhausted_with_its_retry_delay(rig: GrpcRig) -> None:
    async with grpc.aio.insecure_channel(rig.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name=MODEL)
        tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(b"hello")
        metadata = (("authorization", f"Bearer {LIMITED}"),)
        await stub.ModelInfer(request, metadata=metadata, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as limited:
            await stub.ModelInfer(request, metadata=metadata, timeout=10)
    assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    status = rpc_status.from_call(limited.value)
    assert status is not None
    retry = error_details_pb2.RetryInfo()
    assert any(d.Unpack(retry) for d in status.details if d.Is(retry.DESCRIPTOR))
    assert retry.retry_delay.seconds >= 1


async def test_an_eu_key_is_served_in_eu_or_refused(rig: GrpcRig) -> None:
    async with rig.client() as client:
        await client.infer(MODEL, _inputs(), headers=_bearer(EU_KEY))
        assert rig.behaviours["eu"].hits == 1 and rig.behaviours["us"].hits == 0
        rig.source.set(_table(rig.node_urls, version=2, names=("us",)))
        with pytest.raises(InferenceServerException) as refused:
            await client.infer(MODEL, _inputs(), headers=_bearer(EU_KEY))
    assert refused.value.status() == "StatusCode.UNAVAILABLE"
    assert rig.behaviours["us"].hits == 0


async def test_a_stream_reports_a_request_error_and_goes_on(rig: GrpcRig) -> None:
    async def requests() -> AsyncIterator[dict]:
        yield {"model_name": "no-such-model", "inputs": _inputs(stream=True), "request_id": "a"}
        yield {"model_name": MODEL, "inputs": _inputs(stream=True), "request_id": "b"}

    async with rig.client() as client:
        results = [r async for r in client.stream_infer(requests(), headers=_bearer(GLOBAL_KEY))]
    errors = [e for _, e in results if e is not None]
    served = [r for r, e in results if e is None]
    assert len(errors) == 1 and "NOT_FOUND" in errors[0].message()
    assert served and {r.get_response().id for r in served} == {"b"}
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in served]
    assert finals[-1] is True and not any(finals[:-1])


async def test_health_liveness_and_reflection(rig: GrpcRig) -> None:
    async with rig.client() as client:
        assert await client.is_server_live() and await client.is_server_ready()
        assert await client.is_model_ready(MODEL, headers=_bearer(GLOBAL_KEY))
        assert not await client.is_model_ready("no-such-model", headers=_bearer(GLOBAL_KEY))
        meta = await client.get_model_metadata(MODEL, headers=_bearer(GLOBAL_KEY), as_json=True)
        assert {i["name"] for i in meta["inputs"]} >= {"text_input", "stream", "sampling_parameters"}
        # The exact version only to a tenant (issue 33, finding 6): it tells a prober which
        # advisories apply, and load balancers ask ServerLive/ServerReady or grpc.health.
        server = await client.get_server_metadata(headers=_bearer(GLOBAL_KEY), as_json=True)
        assert server["version"] and "streaming" in server["extensions"]
        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED|API key"):
            await client.get_server_metadata()
    async with grpc.aio.insecure_channel(rig.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)

        async def ask() -> AsyncIterator[reflection_pb2.ServerReflectionRequest]:
            yield reflection_pb2.ServerReflectionRequest(list_services="")
            yield reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.GRPCInferenceService")

        answers = [a async for a in stub.ServerReflectionInfo(ask())]
    names = {s.name for s in answers[0].list_services_response.service}
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
    assert answers[1].file_descriptor_response.file_descriptor_proto


async def test_with_a_certificate_both_listeners_serve_tls(tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    behaviour = NodeBehaviour("us")
    servers = ServerGroup()
    try:
        node_url = await servers.start(node_app(behaviour))
        settings = router_settings(grpc_port=0, tls_cert_file=cert, tls_key_file=key)
        app = create_app(settings, table_source=StaticTableSource(make_table([node("us", node_url)])))
        url = await serve_router(servers, app, settings)
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(cert))) as http:
            assert (await http.get(url.replace("http://", "https://") + "/health")).status_code == 200
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{app.state.router.grpc.port}", credentials) as channel:
            live = await pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=5)
            assert live.live
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.state.router.grpc.port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await pb_grpc.GRPCInferenceServiceStub(plain).ServerLive(pb.ServerLiveRequest(), timeout=2)
    finally:
        await servers.stop()


async def test_the_calls_deadline_bounds_the_work(rig: GrpcRig) -> None:
    rig.behaviours["us"].mode = "hang"  # a node that takes the request and never answers
    async with grpc.aio.insecure_channel(rig.target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        request = pb.ModelInferRequest(model_name=MODEL)
        request.inputs.add(name="text_input", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await stub.ModelInfer(request, metadata=(("authorization", f"Bearer {GLOBAL_KEY}"),), timeout=0.5)
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert rig.behaviours["us"].hits == 1  # it reached the node, and was not retried elsewhere


async def test_a_streamed_piece_is_sent_as_soon_as_it_comes(rig: GrpcRig) -> None:
    """Never held back for the next one (to mark the last final): a client's first text
    arrives with the node's first event, however long the node takes for the second."""
    behaviour = rig.behaviours["us"]
    behaviour.mode = "slow"  # one event, then nothing until released

    async def requests() -> AsyncIterator[dict]:
        yield {"model_name": MODEL, "inputs": _inputs(stream=True), "request_id": "r"}

    async with rig.client() as client:
        answers = client.stream_infer(requests(), headers=_bearer(GLOBAL_KEY))
        first, error = await asyncio.wait_for(answers.__anext__(), 10)
        assert error is None and first.as_numpy("text_output")[0] == b"us0 "
        assert not first.get_response().parameters["triton_final_response"].bool_param
        behaviour.release.set()
        rest = [r async for r, e in answers if e is None]
    assert rest[-1].get_response().parameters["triton_final_response"].bool_param
