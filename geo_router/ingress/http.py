"""The HTTP front end: the inference routes served ahead of FastAPI's stack.

Every model route (POST /v1/chat/completions and the rest of contracts.MODEL_ROUTES) is a
dictionary lookup here and a call of its handler; everything else (the model list, stored
responses, health, metrics, the WebSocket, the 404s and 405s) goes through FastAPI as before.
The reason is cost: FastAPI's stack (its OpenTelemetry check, which reads the environment on
every request, the exception and exit-stack middlewares, the route list matched in turn, the
request handler) cost more CPU per request than a whole nginx proxy_pass, on the one path
that runs for every token a tenant buys. What that stack did for these routes is done here:
the request's `app` in its scope, and every exception answered as the installed handlers
answer it (geo_router.errors.answer_error, the one mapping).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ..errors import answer_error
from .arrival import Arrival, HttpArrival

# handler(arrival) -> the answer (it raises RouterError and the like for errors).
Handler = Callable[[Arrival], Awaitable[Response]]


class RouterApp(FastAPI):
    """FastAPI, with POSTs to the routes given to `serve_inference` taken before its stack."""

    _inference: Mapping[str, Handler] = {}

    def serve_inference(self, handlers: Mapping[str, Handler]) -> None:
        """POST `path` is answered by `handlers[path]`, without FastAPI's middlewares."""
        self._inference = dict(handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self._inference.get(scope["path"])
            if handler is not None:
                scope["app"] = self
                request = Request(scope, receive, send)
                try:
                    response = await handler(HttpArrival(request))
                except Exception as exc:  # answered as FastAPI's installed handlers would
                    response = await answer_error(request, exc)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
