"""The Responses API's WebSocket mode on the global endpoint (see endpoint)."""

from .endpoint import RESPONSES_PATH, ResponsesSocket

__all__ = ["RESPONSES_PATH", "ResponsesSocket"]
