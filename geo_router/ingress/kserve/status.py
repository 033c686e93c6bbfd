"""The router's errors as gRPC statuses: one mapping from the HTTP status each error has.

An error the pipeline answers (OpenAI's error JSON, with its HTTP status and headers)
becomes the gRPC status a gRPC client expects, with Google's rich error model in the
trailers (`grpc-status-details-bin`): an ErrorInfo carrying the OpenAI error's `code`,
`type` and `param`, and a RetryInfo when the answer said when to retry (`retry-after` on a
429 or 503), so that clients with retry policies honour it. Pure apart from building the
grpc.Status object.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    409: grpc.StatusCode.ABORTED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
DOMAIN = "meridian"


def code_for(http_status: int) -> grpc.StatusCode:
    """The gRPC code of an answer with this HTTP status."""
    if http_status in _CODES:
        return _CODES[http_status]
    return grpc.StatusCode.INVALID_ARGUMENT if http_status < 500 else grpc.StatusCode.INTERNAL


def retry_after_s(headers: dict[str, str]) -> int | None:
    value = headers.get("retry-after", "")
    return int(value) if value.isdigit() else None


def to_status(http_status: int, error: dict[str, Any], headers: dict[str, str]) -> grpc.Status:
    """The rich gRPC status for an OpenAI error answered with `http_status` and `headers`."""
    code = code_for(http_status)
    message = str(error.get("message") or f"HTTP {http_status}")
    info = error_details_pb2.ErrorInfo(reason=str(error.get("code") or error.get("type") or code.name).upper(),
                                       domain=DOMAIN)
    for key in ("type", "param", "code"):
        if isinstance(error.get(key), str):
            info.metadata[key] = error[key]
    details = [_pack(info)]
    retry = retry_after_s(headers)
    if retry is not None:
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=retry))))
    proto = status_pb2.Status(code=code.value[0], message=message, details=details)
    return rpc_status.to_status(proto)


def stream_error(http_status: int, error: dict[str, Any], headers: dict[str, str]) -> str:
    """The `error_message` of a ModelStreamInferResponse (Triton's in-stream error): text
    only, so it leads with the gRPC code and the OpenAI code, `UNAVAILABLE
    (no_replica_in_zone): …`, and ends with when to retry."""
    code = code_for(http_status)
    named = f" ({error['code']})" if isinstance(error.get("code"), str) else ""
    text = f"{code.name}{named}: {error.get('message') or f'HTTP {http_status}'}"
    retry = retry_after_s(headers)
    return f"{text} (retry after {retry} s)" if retry is not None else text


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
