"""Stateful Responses API requests reach the replica that stored the response.

vLLM keeps a stored response (and a background response's state) in the memory of the
process that made it, so a follow-up with `previous_response_id`, `GET
/v1/responses/{id}` and cancel must reach that replica. The router carries the replica
in the id it gives the client, bound to the tenant:

    resp_<vLLM's id hex>.<node id, base64url>.<MAC>

MAC = HMAC-SHA256 over (tenant, node, vLLM's id) under a key derived from the cluster
token, which every router of the fabric holds. Why the id and not state held in the
fabric: a shared store (Redis) would sit on the path of every request and still could
not move vLLM's in-memory state to another replica; the id costs nothing, works across
routers without coordination, and is checked on the way in: a tenant can never name
another tenant's response (the MAC fails: 404, as for an id that never existed) nor a
replica outside its zone (the node must be among the tenant's candidates). A response
stored on a replica that is gone is gone with it (404), as on vLLM after a restart.

Ids are rewritten in the answers by a byte-level substitution of vLLM's quoted
`"resp_…"` strings (events are whole when rewritten: the proxy frames SSE first), and
already-wrapped ids, which contain dots, are left as they are.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from meridian.contracts import TenantEntry

from ..errors import BadRequest, RouterError
from .request import InferenceRequest

_VLLM_ID = re.compile(rb'"(resp_[A-Za-z0-9]{1,128})"')
_PREFIX = "resp_"
_MAC_BYTES = 12


class ResponseNotFound(RouterError):
    status = 404
    type_ = "invalid_request_error"
    code = "response_not_found"

    def __init__(self, response_id: str, *, param: str | None = None) -> None:
        # The id is the client's: quoted only when it is short and plain.
        shown = response_id if len(response_id) <= 300 and response_id.isprintable() else "given"
        super().__init__(f"No response with id '{shown}' was found.")
        self.param = param


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """Where a client's response id points: vLLM's own id on one node."""

    inner_id: str
    node_id: str


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ResponseIds:
    """Wraps vLLM's response ids for clients and resolves them back, per tenant."""

    def __init__(self, cluster_token: str) -> None:
        self._key = hashlib.sha256(b"meridian response ids\0" + cluster_token.encode()).digest()

    def _mac(self, tenant: TenantEntry, node_id: str, inner_id: str) -> str:
        message = "\0".join((tenant.tenant, node_id, inner_id)).encode()
        return _b64(hmac.new(self._key, message, hashlib.sha256).digest()[:_MAC_BYTES])

    def wrap(self, inner_id: str, node_id: str, tenant: TenantEntry) -> str:
        return f"{inner_id}.{_b64(node_id.encode())}.{self._mac(tenant, node_id, inner_id)}"

    def resolve(self, response_id: str, tenant: TenantEntry, *, param: str | None = None) -> StoredResponse:
        """The node and vLLM id behind a client's id; ResponseNotFound unless this tenant's."""
        parts = response_id.split(".")
        if len(parts) != 3 or not parts[0].startswith(_PREFIX):
            raise ResponseNotFound(response_id, param=param)
        inner_id, node_part, mac = parts
        try:
            node_id = _unb64(node_part).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise ResponseNotFound(response_id, param=param) from None
        if not hmac.compare_digest(mac, self._mac(tenant, node_id, inner_id)):
            raise ResponseNotFound(response_id, param=param)
        return StoredResponse(inner_id, node_id)

    def rewriter(self, tenant: TenantEntry) -> Callable[[str, bytes], bytes]:
        """rewrite(node_id, chunk): the chunk with vLLM's response ids wrapped for the client."""

        def rewrite(node_id: str, chunk: bytes) -> bytes:
            if b'"resp_' not in chunk:
                return chunk
            return _VLLM_ID.sub(
                lambda m: b'"' + self.wrap(m.group(1).decode(), node_id, tenant).encode() + b'"', chunk
            )

        return rewrite


def follow_up(
    ids: ResponseIds, inference: InferenceRequest, tenant: TenantEntry
) -> tuple[InferenceRequest, StoredResponse | None]:
    """A responses request continuing a stored response: the node that stored it, and the
    body with vLLM's own id in place of the client's."""
    previous = inference.payload.get("previous_response_id")
    if previous is None:
        return inference, None
    if not isinstance(previous, str):
        raise BadRequest("`previous_response_id` must be a string.", param="previous_response_id")
    stored = ids.resolve(previous, tenant, param="previous_response_id")
    # The wrapped id is unique in the body (its MAC), and JSON needs no escape for it.
    body = inference.body.replace(f'"{previous}"'.encode(), f'"{stored.inner_id}"'.encode(), 1)
    return replace(inference, body=body), stored
