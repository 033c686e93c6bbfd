"""The one OpenAI error base, shared by the router and the node.

Both apps answer errors in OpenAI's shape (`{"error": {message, type, code, param}}`) and
map their own typed errors to it in one place each (`geo_router/errors.py`,
`data_plane/server/errors.py`). The base is here so that the two trees have the same
attributes and a client sees the same body for the same failure whichever part answered.

Subclasses set the class attributes; an instance may override status, code and param.
`type_` follows OpenAI: `invalid_request_error` below 500, `server_error` from 500 up,
unless a subclass names another (`requests` / `tokens` for rate limits).
"""

from __future__ import annotations

from typing import Any

from meridian.contracts import openai_error


class OpenAIError(Exception):
    """An error answered in OpenAI's error shape."""

    status: int = 500
    type_: str = "server_error"
    code: str | None = None
    param: str | None = None

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
            self.type_ = "invalid_request_error" if status < 500 else "server_error"
        if code is not None:
            self.code = code
        if param is not None:
            self.param = param
        self.headers: dict[str, str] = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body of the answer."""
        return openai_error(self.message, self.type_, self.code, self.param)
