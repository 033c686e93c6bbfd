"""What the router reads from an inference request: a bounded body, `model` and `stream`.

Everything else in the body is the node's business and is forwarded byte for byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request
from starlette.types import Receive

from meridian import http_body
from meridian.contracts import REQUEST_ID_PATTERN
from meridian.http_stream import HangUpRegister, HangUpWatch
from meridian.json_limits import MAX_JSON_DEPTH, too_deep

from ..errors import BadRequest, ClientClosedRequest, RequestTooLarge

_SANE_REQUEST_ID = re.compile(REQUEST_ID_PATTERN)
# Request ids name a request in logs and journals; they guard nothing (a client may send its
# own), so they need to be unique, not secret: a seeded generator instead of a getrandom()
# system call per request. Seeded from os.urandom, and again in a forked child.
_IDS = random.Random()
os.register_at_fork(after_in_child=_IDS.seed)
# msgspec, not json: it parses a chat request several times faster, and it refuses what is
# not JSON (NaN, lone surrogates) rather than forwarding it to a node that would choke.
_JSON = msgspec.json.Decoder()
# Model names are at most this long everywhere (meridian.contracts.ModelName).
MAX_MODEL_NAME_CHARS = 200
_TOO_DEEP = object()


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    body: bytes
    model: str
    stream: bool
    payload: dict[str, Any]


def with_field(body: bytes, name: str, json_value: bytes) -> bytes:
    """`body`, a JSON object without `name` (parse_inference_request checked it is an object,
    with at least `model` in it), with `"name": json_value` appended to its bytes: a field the
    router adds to every request costs no re-encoding of the client's body."""
    end = body.rstrip().rfind(b"}")
    return body[:end] + b',"' + name.encode() + b'":' + json_value + b"}"


def request_id_for(client_value: str | None) -> str:
    """The client's x-request-id when it is a sane token, else 32 fresh random hex digits."""
    if client_value and _SANE_REQUEST_ID.match(client_value):
        return client_value
    return f"{_IDS.getrandbits(128):032x}"


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) anything over `limit` bytes without buffering it,
    and (400) a Content-Length that is malformed or that the body disagrees with.

    The kernel's one reader (meridian.http_body); its errors become the router's here, so
    that they are counted with every other RouterError of the request.
    """
    try:
        return await http_body.read_body(request.receive, request.headers.get("content-length"), limit)
    except http_body.BodyTooLarge:
        raise RequestTooLarge(limit) from None
    except http_body.BadContentLength as exc:
        raise BadRequest(str(exc)) from None
    except http_body.ClientGone:
        # Gone mid-body (or cut off by the listener's body timeout): nobody reads this.
        raise ClientClosedRequest() from None


async def until_disconnected(receive: Receive) -> None:
    """Return once the client has hung up (the request body has been read already)."""
    with contextlib.suppress(Exception):
        while (await receive())["type"] != "http.disconnect":
            pass


class ClientWatch(HangUpWatch):
    """Cancels the task serving a request as soon as its client hangs up.

    A non-streamed answer is read from the node whole before anything goes to the client,
    so nothing else notices the client leaving: the node went on generating for nobody
    (four closed clients cost 4,096 generated tokens). Cancelling the forward closes the
    upstream connection, which is what tells the node to abort the request.
    """

    def __init__(self, register: HangUpRegister | None, receive: Receive | None) -> None:
        """`register`: the front end's way to be told of a hang-up (the listener's disconnect
        extension, a WebSocket's or gRPC call's Departure); else a task waits on `receive`."""
        super().__init__(register)
        self._watch: asyncio.Future[None] | None = None
        if register is None and receive is not None:  # another server (tests' plain uvicorn)
            self._watch = asyncio.ensure_future(self._wait(receive))

    async def _wait(self, receive: Receive) -> None:
        await until_disconnected(receive)
        self._fire()

    def stop(self) -> None:
        super().stop()
        if self._watch is not None:
            self._watch.cancel()

    def closed_request(self) -> ClientClosedRequest:
        """The error to answer once the watch fired (its cancellation taken back)."""
        if self._task is not None:
            self._task.uncancel()
        return ClientClosedRequest()


def parse_inference_request(body: bytes) -> InferenceRequest:
    """Check the body is a JSON object naming a model; 400 otherwise."""
    try:
        payload = _JSON.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # invalid UTF-8 inside a string
        raise BadRequest(f"Request body is not valid JSON: {exc}") from None
    except RecursionError:
        payload = _TOO_DEEP
    if payload is _TOO_DEEP or too_deep(body, payload):
        # The nodes' limit too: a body one parser takes and the other refuses must not exist.
        raise BadRequest(f"Request body is nested more than {MAX_JSON_DEPTH} levels deep.")
    if not isinstance(payload, dict):
        raise BadRequest("Request body must be a JSON object.")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("You must provide a model parameter.", param="model")
    if len(model) > MAX_MODEL_NAME_CHARS:
        # Never echoed back (a 1 MB name came back whole in the 404).
        raise BadRequest(f"`model` is longer than {MAX_MODEL_NAME_CHARS} characters.", param="model")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("`stream` must be a boolean.", param="stream")
    return InferenceRequest(body=body, model=model, stream=stream, payload=payload)
