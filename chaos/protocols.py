"""The drill load's requests over the router's other protocols, judged as HTTP ones are.

A drill's arrivals may go over the Responses API's WebSocket mode or KServe v2 gRPC
(Load.protocols) as well as HTTP, so that a fault meets every kind of client. Each request
carries its idempotency key (the upgrade's headers, the call's metadata), so the router's
journal joins it like an HTTP request, and ends in the outcome `chaos.load` would give the
same answer over HTTP:

- WebSocket: one connection per request (the generator never reuses answers), one
  `response.create` turn, `store: false`. `response.completed` is `ok`; an `error` event
  `fail` with its code (a stream error event when text had come: like SSE's); the socket
  closing before either is `indeterminate` (`stream_cut` after the first event,
  `connection_lost` before); a refused upgrade `fail` with the error JSON's code.
- gRPC: `ModelInfer` for a non-streamed arrival, `ModelStreamInfer` for a streamed one.
  A result (the last response of a stream) is `ok`; a gRPC status is `fail` with the
  OpenAI code from the status' ErrorInfo and whether it carried RetryInfo (Retry-After's
  twin), or, inside a stream, Triton's `error_message` (a stream error event);
  UNAVAILABLE before any answer with no ErrorInfo is `connect_error` (the call never left
  the client); a stream cut after its first response is `stream_cut`.
"""

from __future__ import annotations

import json
import re
import struct
import time
from dataclasses import dataclass
from typing import Any

import grpc
import websockets
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from chaos.history import Outcome
from geo_router.ingress.kserve import kserve_v2_pb2 as pb
from geo_router.ingress.kserve import kserve_v2_pb2_grpc as pb_grpc

PROTOCOLS = ("http", "websocket", "grpc")


@dataclass(frozen=True, slots=True)
class Ended:
    """How one request ended, whatever carried it (chaos.load turns it into the history's
    record; status and first byte are the other protocols', which have no response head)."""

    outcome: Outcome
    error_code: str | None = None
    retry_after: bool = False
    stream_error_event: bool = False
    status: int | None = None
    first_byte_s: float | None = None


def _messages_input(messages: list[dict[str, str]]) -> tuple[str | None, list[dict[str, str]]]:
    """Chat messages as the Responses API's instructions and input items."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    items = [{"role": m["role"], "content": m["content"]} for m in messages if m["role"] != "system"]
    return ("\n".join(system) or None), items


async def send_websocket(url: str, headers: dict[str, str], model: str, messages: list[dict[str, str]],
                         max_tokens: int, start: float) -> Ended:
    """One turn over the Responses WebSocket at `url` (ws://…/v1/responses)."""
    instructions, items = _messages_input(messages)
    event: dict[str, Any] = {"type": "response.create", "model": model, "input": items, "store": False,
                             "max_output_tokens": max_tokens, "temperature": 0}
    if instructions:
        event["instructions"] = instructions
    first: float | None = None
    try:
        async with websockets.connect(url, additional_headers=headers, open_timeout=5, max_size=2**22) as ws:
            await ws.send(json.dumps(event))
            async for raw in ws:
                if first is None:
                    first = time.monotonic() - start
                message = json.loads(raw)
                kind = message.get("type") if isinstance(message, dict) else None
                if kind in ("response.completed", "response.incomplete"):
                    return Ended(Outcome.OK, status=200, first_byte_s=first)
                if kind == "error":
                    error = message.get("error") or {}
                    headers_seen = error.get("headers") or {}
                    streamed = message.get("status") is None
                    return Ended(Outcome.FAIL, error_code(error) or "stream_error", "retry-after" in headers_seen,
                                 stream_error_event=streamed, status=message.get("status"), first_byte_s=first)
    except websockets.InvalidStatus as refused:
        return Ended(Outcome.FAIL, body_error_code(refused.response.body or b""), "retry-after" in refused.response.headers,
                     status=refused.response.status_code)
    except (OSError, TimeoutError) as exc:
        if first is None and isinstance(exc, ConnectionRefusedError | TimeoutError):
            return Ended(Outcome.FAIL, "connect_error")
        return Ended(Outcome.INDETERMINATE, "stream_cut" if first is not None else "connection_lost",
                     first_byte_s=first)
    except (websockets.ConnectionClosed, ValueError):
        pass
    return Ended(Outcome.INDETERMINATE, "stream_cut" if first is not None else "connection_lost", first_byte_s=first)


def body_error_code(raw: bytes) -> str | None:
    """The OpenAI error JSON's `code` (its `type` when the code is null); None for any other body."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return error_code(data.get("error")) if isinstance(data, dict) else None


def error_code(error: object) -> str | None:
    """An OpenAI error object's `code`, else its `type` (what the checker groups errors by)."""
    if not isinstance(error, dict):
        return None
    for name in ("code", "type"):
        value = error.get(name)
        if value is not None:
            return str(value)
    return None


def infer_request(model: str, prompt: str, sampling: dict[str, Any], *, stream: bool,
                  request_id: str = "") -> pb.ModelInferRequest:
    """A ModelInferRequest in Triton's vLLM-backend convention, its contents raw as tritonclient
    sends them, asking for the new text only (`exclude_input_in_output`)."""
    request = pb.ModelInferRequest(model_name=model, id=request_id)
    for name, datatype, raw in (
        ("text_input", "BYTES", _bytes_element(prompt.encode())),
        ("stream", "BOOL", b"\x01" if stream else b"\x00"),
        ("sampling_parameters", "BYTES", _bytes_element(json.dumps(sampling).encode())),
        ("exclude_input_in_output", "BOOL", b"\x01"),
    ):
        request.inputs.add(name=name, datatype=datatype, shape=[1])
        request.raw_input_contents.append(raw)
    return request


def _bytes_element(data: bytes) -> bytes:
    """One serialized BYTES element: its 4-byte little-endian length, then the bytes."""
    return struct.pack("<I", len(data)) + data


def prompt_of(messages: list[dict[str, str]]) -> str:
    """Chat messages as one completion prompt (the gRPC convention takes text)."""
    return "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"


async def send_grpc(channel: grpc.aio.Channel, metadata: tuple[tuple[str, str], ...], request: pb.ModelInferRequest,
                    stream: bool, timeout_s: float, start: float) -> Ended:
    """One inference over KServe v2 gRPC on `channel`."""
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    first: float | None = None
    try:
        if not stream:
            await stub.ModelInfer(request, metadata=metadata, timeout=timeout_s)
            return Ended(Outcome.OK, status=200, first_byte_s=time.monotonic() - start)
        call = stub.ModelStreamInfer(iter([request]), metadata=metadata, timeout=timeout_s)
        texts = 0
        async for answer in call:
            if first is None:
                first = time.monotonic() - start
            if answer.error_message:
                # An error after text is a stream's error event; before any, a refusal.
                return Ended(Outcome.FAIL, _stream_code(answer.error_message), "retry after" in answer.error_message,
                             stream_error_event=texts > 0, first_byte_s=first if texts else None)
            texts += 1
            final = answer.infer_response.parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return Ended(Outcome.OK, status=200, first_byte_s=first)
        return Ended(Outcome.INDETERMINATE, "stream_cut" if first is not None else "connection_lost",
                     first_byte_s=first)
    except grpc.aio.AioRpcError as exc:
        return _status_end(exc, first)


def _stream_code(message: str) -> str:
    """The OpenAI code of the router's in-stream error text (`UNAVAILABLE (code): …`), else
    its gRPC code."""
    found = re.match(r"([A-Z_]+)(?: \(([A-Za-z0-9_.-]+)\))?:", message)
    if found is None:
        return "stream_error"
    return found.group(2) or found.group(1).lower()


def _status_end(exc: grpc.aio.AioRpcError, first: float | None) -> Ended:
    code = exc.code()
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return Ended(Outcome.INDETERMINATE, "timeout", first_byte_s=first)
    status = rpc_status.from_call(exc)
    info, retry = error_details_pb2.ErrorInfo(), False
    found = False
    for detail in status.details if status is not None else ():
        if detail.Is(info.DESCRIPTOR):
            detail.Unpack(info)
            found = True
        retry = retry or detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR)
    if found:
        return Ended(Outcome.FAIL, info.metadata.get("code") or info.reason.lower(), retry, first_byte_s=first)
    if code == grpc.StatusCode.UNAVAILABLE and first is None and "failed to connect" in (exc.details() or ""):
        return Ended(Outcome.FAIL, "connect_error")  # the router was not reached: the call never left
    if first is not None:
        return Ended(Outcome.INDETERMINATE, "stream_cut", first_byte_s=first)
    return Ended(Outcome.INDETERMINATE, "connection_lost")
