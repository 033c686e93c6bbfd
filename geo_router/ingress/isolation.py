"""Per-tenant prefix-cache isolation: the `cache_salt` the router sets on every request.

Prefix caches (the torch engine's and vLLM's) share KV blocks between requests whose
prompts start alike, and `usage.prompt_tokens_details.cached_tokens` tells the caller how
much was shared. Shared across tenants, that is a side channel: a tenant could learn
whether another tenant sent a given prompt (a right guess came back with 112 cached
tokens, a wrong one with 16). Both engines fold `cache_salt` into the first block's hash,
so requests with different salts never share a block.

The router therefore sets the salt itself, from the tenant, on every request it forwards:
tenants share nothing observable unless an operator put them in one cache sharing group
(`TenantEntry.cache_group`). A salt the client sent (vLLM's own use: partitioning one's
own cache further) is folded into the tenant's, so no client can name another tenant's
salt. Routers derive the salt the same way, so the KV-affinity index (which keys on the
salt, as the engines do) agrees across routers and with the nodes.
"""

from __future__ import annotations

import functools
import hashlib

import msgspec

from meridian.contracts import TenantEntry

from ..errors import BadRequest
from .request import InferenceRequest, with_field

# The nodes' limit (vLLM takes any string; ours stay well within a header-sized value).
MAX_CLIENT_SALT_CHARS = 256

_ENCODER = msgspec.json.Encoder()


def tenant_cache_salt(tenant: TenantEntry) -> str:
    """The salt of the tenant's cache partition: its sharing group's, else its own."""
    scope = f"group\x1f{tenant.cache_group}" if tenant.cache_group else f"tenant\x1f{tenant.tenant}"
    return _salt(scope)


@functools.lru_cache(maxsize=4096)
def _salt(scope: str) -> str:
    return hashlib.sha256(b"meridian-cache-salt\x1f" + scope.encode()).hexdigest()[:32]


def salted(request: InferenceRequest, tenant: TenantEntry) -> InferenceRequest:
    """`request` with the tenant's cache salt in its body and payload."""
    salt = tenant_cache_salt(tenant)
    client = request.payload.get("cache_salt")
    if client is None:
        payload = {**request.payload, "cache_salt": salt}
        body = with_field(request.body, "cache_salt", b'"' + salt.encode() + b'"')
    else:
        if not isinstance(client, str) or not 0 < len(client) <= MAX_CLIENT_SALT_CHARS:
            raise BadRequest(f"`cache_salt` must be a non-empty string of at most "
                             f"{MAX_CLIENT_SALT_CHARS} characters.", param="cache_salt")
        # The client's own partition, inside its tenant's.
        payload = {**request.payload, "cache_salt": hashlib.sha256(f"{salt}\x1f{client}".encode()).hexdigest()[:32]}
        body = _ENCODER.encode(payload)
    return InferenceRequest(body=body, model=request.model, stream=request.stream, payload=payload)
