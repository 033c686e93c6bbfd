"""KServe's Open Inference Protocol v2 (`inference.GRPCInferenceService`) on the router.

Health and metadata answer from the routing table; `ModelInfer` and Triton's decoupled
`ModelStreamInfer` serve text generation in the convention of Triton's vLLM backend
(geo_router.ingress.kserve.tensors), each request as one /v1/completions request through the
router's own pipeline (geo_router.ingress.internal_call): the API key in the call's metadata
(`authorization: Bearer …`), its residency, rate limits, affinity, failover and migration
are the HTTP API's, and so are its errors, mapped to gRPC codes (geo_router.ingress.kserve.status).

- `ServerLive` and `ServerReady` need no key (load balancers ask them, as they ask
  grpc.health.v1); ready means a routing table is loaded. `ServerMetadata` needs one: it
  names the exact version, which tells a keyless prober which advisories apply, and no
  load balancer asks it. `ModelReady` and `ModelMetadata` need one too, and a model the
  tenant may not use is NOT_FOUND, as on HTTP.
- `ModelInfer` answers one response (a `stream` input there is INVALID_ARGUMENT: streaming
  is ModelStreamInfer's). The call's deadline bounds the work (DEADLINE_EXCEEDED), and a
  cancelled call cancels the node's request.
- `ModelStreamInfer` takes any number of requests on one stream, serves up to
  `grpc_max_requests_per_stream` at once and interleaves their responses (each carries its
  request's `id`); a streamed request gets one response per piece of text, the last with
  Triton's `triton_final_response` parameter (and an empty final response when asked). An
  error of one request is that request's `error_message`, never the stream's end; a bad key
  ends the stream UNAUTHENTICATED before anything is served.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from meridian.contracts import Route as InferenceRoute
from meridian.contracts import TenantEntry

from ...errors import ModelNotFound, RouterError, RoutingTableUnavailable, error_response
from ...state.table import LoadedTable
from ..arrival import CallArrival, Departure
from ..auth import authenticate
from ..internal_call import Head, Route, answer_events, error_object, json_of
from . import kserve_v2_pb2 as pb
from . import kserve_v2_pb2_grpc as pb_grpc
from .status import stream_error, to_status
from .tensors import (
    INPUTS,
    OUTPUTS,
    Generation,
    InvalidInput,
    completion_body,
    empty_final,
    read_request,
    response,
)

log = logging.getLogger(__name__)

COMPLETIONS = InferenceRoute.COMPLETIONS
SERVER_NAME = "meridian"
# Metadata a gRPC client sends that means something to the HTTP pipeline.
_PASSED = ("authorization", "x-api-key", "x-request-id", "idempotency-key", "traceparent", "tracestate",
           "baggage", "x-forwarded-for")


class CallFailed(Exception):
    """The pipeline answered an error: its HTTP status, OpenAI error object and headers."""

    def __init__(self, status: int, error: dict[str, Any], headers: dict[str, str]) -> None:
        super().__init__(error.get("message"))
        self.status, self.error, self.headers = status, error, headers


@dataclass(frozen=True, slots=True)
class Piece:
    """A piece of generated text, and what the answer said of its end (when it did)."""

    text: str
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    """The servicer; `route` is the app's pipeline, `table` the routing table in force and
    `models` the models a tenant may use (listed or scaled to zero)."""

    def __init__(self, route: Route, table: Callable[[], LoadedTable | None],
                 models: Callable[[LoadedTable, TenantEntry], set[str]], version: str,
                 max_requests_per_stream: int) -> None:
        self._route = route
        self._table = table
        self._models = models
        self._version = version
        self._per_stream = max_requests_per_stream

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:  # noqa: N802
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: Any) -> pb.ServerReadyResponse:  # noqa: N802
        return pb.ServerReadyResponse(ready=self._table() is not None)

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:  # noqa: N802
        await self._tenant(context)
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=self._version, extensions=["streaming"])

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:  # noqa: N802
        loaded, tenant = await self._tenant(context)
        return pb.ModelReadyResponse(ready=request.name in self._models(loaded, tenant))

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: Any) -> pb.ModelMetadataResponse:  # noqa: N802
        loaded, tenant = await self._tenant(context)
        if request.name not in self._models(loaded, tenant):
            await _abort(context, ModelNotFound(request.name[:256]))
        out = pb.ModelMetadataResponse(name=request.name, versions=["1"], platform="vllm")
        for name, datatype in INPUTS:
            out.inputs.add(name=name, datatype=datatype, shape=[1])
        for name, datatype in OUTPUTS:
            out.outputs.add(name=name, datatype=datatype, shape=[-1 if name == "text_output" else 1])
        return out

    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:  # noqa: N802
        await self._tenant(context)
        try:
            g = read_request(request)
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if g.stream:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "stream = true needs ModelStreamInfer (a decoupled stream of responses)")
        departure = Departure()
        context.add_done_callback(lambda _: departure.left())
        try:
            async with _deadline(context):
                return await self._whole(g, context, departure)
        except CallFailed as failed:
            await context.abort_with_status(to_status(failed.status, failed.error, failed.headers))
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed before the answer")
        raise AssertionError("unreachable: abort raises")

    async def ModelStreamInfer(  # noqa: N802
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        await self._tenant(context)
        departure = Departure()
        context.add_done_callback(lambda _: departure.left())
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue(maxsize=self._per_stream * 4)
        slots = asyncio.Semaphore(self._per_stream)
        tasks: set[asyncio.Task[None]] = set()

        async def serve(request: pb.ModelInferRequest) -> None:
            try:
                await self._stream_one(request, context, departure, out)
            finally:
                slots.release()

        async def read() -> None:
            try:
                async for request in request_iterator:
                    await slots.acquire()
                    task = asyncio.create_task(serve(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                if tasks:
                    await asyncio.gather(*list(tasks), return_exceptions=True)
            finally:
                await out.put(None)

        reader = asyncio.create_task(read(), name="kserve-stream-reader")
        try:
            while (item := await out.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader

    async def _stream_one(self, request: pb.ModelInferRequest, context: Any, departure: Departure,
                          out: asyncio.Queue[pb.ModelStreamInferResponse | None]) -> None:
        try:
            g = read_request(request)
        except InvalidInput as exc:
            await out.put(pb.ModelStreamInferResponse(error_message=f"INVALID_ARGUMENT: {exc}"))
            return
        try:
            async with _deadline(context):
                if not g.stream:
                    await out.put(_streamed(await self._whole(g, context, departure, final=True)))
                    return
                await self._stream_pieces(g, context, departure, out)
        except CallFailed as failed:
            await out.put(pb.ModelStreamInferResponse(
                error_message=stream_error(failed.status, failed.error, failed.headers),
                infer_response=pb.ModelInferResponse(model_name=g.model, id=g.request_id)))
        except TimeoutError:
            await out.put(pb.ModelStreamInferResponse(error_message="DEADLINE_EXCEEDED: the call's deadline passed"))

    async def _whole(self, g: Generation, context: Any, departure: Departure,
                     final: bool | None = None) -> pb.ModelInferResponse:
        """A non-streamed request's one response: the whole text (after the prompt unless
        excluded), with the finish reason and usage the answer gave."""
        text, finish, usage = ([g.prompt] if g.include_prompt else []), None, None
        async for piece in self._pieces(g, context, departure):
            text.append(piece.text)
            finish, usage = piece.finish_reason or finish, piece.usage or usage
        return response(g, "".join(text), finish_reason=finish, usage=usage, final=final)

    async def _stream_pieces(self, g: Generation, context: Any, departure: Departure,
                             out: asyncio.Queue[pb.ModelStreamInferResponse | None]) -> None:
        """A streamed request's responses: each piece as soon as it comes (never held for the
        next one), the one that finishes the answer marked final (Triton's
        `triton_final_response`), or an empty final response when the client asked for one
        or the answer ended without saying so. When token counts were asked for, the
        finishing piece waits for the usage that follows it."""
        counts = bool({"num_input_tokens", "num_output_tokens"} & g.extras)
        held: Piece | None = None
        final_sent = False
        async for piece in self._pieces(g, context, departure):
            if held is not None:
                held = Piece(held.text + piece.text, held.finish_reason, piece.usage or held.usage)
                continue
            if piece.finish_reason is not None and counts and piece.usage is None:
                held = piece
                continue
            final = piece.finish_reason is not None and not g.empty_final
            if piece.text or piece.finish_reason is not None:
                await out.put(_streamed(response(g, piece.text, finish_reason=piece.finish_reason,
                                                 usage=piece.usage, final=final)))
                final_sent = final_sent or final
        if held is not None:
            final = not g.empty_final
            await out.put(_streamed(response(g, held.text, finish_reason=held.finish_reason, usage=held.usage,
                                             final=final)))
            final_sent = final_sent or final
        if not final_sent:
            await out.put(_streamed(empty_final(g)))

    async def _pieces(self, g: Generation, context: Any, departure: Departure) -> AsyncIterator[Piece]:
        """The generated text of `g`, piece by piece, from the pipeline (CallFailed on an error)."""
        arrival = CallArrival(_headers(context), completion_body(g), _peer(context), departure)
        try:
            answered = await self._route(arrival)
        except RouterError as exc:
            answered = error_response(exc)
        head, body = Head(500, {}), b""
        async with contextlib.aclosing(answer_events(answered, departure)) as parts:
            async for part in parts:
                if isinstance(part, Head):
                    head = part
                elif isinstance(part, bytes):
                    body = part
                else:
                    yield _piece(part, head)
        if head.streamed:
            return
        payload = json_of(body)
        if head.status != 200 or not isinstance(payload, dict) or "choices" not in payload:
            status = head.status if head.status != 200 else 502  # a 200 that is no completion: bad gateway
            raise CallFailed(status, error_object(payload, status), head.headers)
        choice = (payload.get("choices") or [{}])[0]
        yield Piece(str(choice.get("text") or ""), choice.get("finish_reason"), payload.get("usage"))

    async def _tenant(self, context: Any) -> tuple[LoadedTable, TenantEntry]:
        """The routing table and the caller's tenant (the call ends UNAUTHENTICATED or
        UNAVAILABLE when there is none)."""
        metadata = dict(_headers_str(context))
        loaded = self._table()
        try:
            if loaded is None:
                raise RoutingTableUnavailable()
            return loaded, authenticate(loaded, metadata.get("authorization"), metadata.get("x-api-key"))
        except RouterError as exc:
            await _abort(context, exc)
            raise AssertionError("unreachable") from None


def _piece(event: dict[str, Any], head: Head) -> Piece:
    if isinstance(event.get("error"), dict):
        raise CallFailed(_status_of(event["error"]), event["error"], head.headers)
    choices = event.get("choices") or []
    choice = choices[0] if choices else {}
    # A completion chunk's text (a chat-shaped chunk's content, from a node that answers so).
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return Piece(str(text), choice.get("finish_reason"), event.get("usage"))


def _status_of(error: dict[str, Any]) -> int:
    # A stream that broke (and could not move) is the node's failure, not the caller's.
    return 503 if error.get("code") in ("upstream_disconnected", "migration_refused") else 500


def _streamed(infer: pb.ModelInferResponse) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(infer_response=infer)


def _headers_str(context: Any) -> list[tuple[str, str]]:
    return [(k.lower(), v) for k, v in (context.invocation_metadata() or ())
            if isinstance(v, str) and k.lower() in _PASSED]


def _headers(context: Any) -> list[tuple[bytes, bytes]]:
    return [(k.encode(), v.encode("latin-1", "replace")) for k, v in _headers_str(context)]


def _peer(context: Any) -> str | None:
    """The caller's address from gRPC's peer string (`ipv4:1.2.3.4:5`, `ipv6:[::1]:5`)."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return None
    host, _, port = rest.rpartition(":")
    return host.strip("[]") if port.isdigit() else None


@contextlib.asynccontextmanager
async def _deadline(context: Any) -> AsyncIterator[None]:
    remaining = context.time_remaining()
    async with asyncio.timeout(remaining if remaining is not None and remaining < 1e9 else None):
        yield


async def _abort(context: Any, exc: RouterError) -> None:
    await context.abort_with_status(to_status(exc.status, exc.body()["error"], exc.headers))
