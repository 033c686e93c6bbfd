"""Who is calling: the tenant (and with it the residency zone) behind a Bearer API key."""

from __future__ import annotations

from meridian.contracts import TenantEntry
from meridian.security import bearer_token, hash_api_key

from ..errors import InvalidApiKey
from ..state.table import LoadedTable


def authenticate(table: LoadedTable, authorization: str | None, api_key: str | None = None) -> TenantEntry:
    """The tenant whose key is in `authorization` (Bearer), else in `api_key` (the
    `x-api-key` header Anthropic's clients send); InvalidApiKey when there is none.

    The tenant's residency zone comes from this entry only: no request header can change it.
    """
    digest = key_digest(authorization, api_key)
    if digest is None:
        raise InvalidApiKey("Missing API key: send `Authorization: Bearer <key>` or `x-api-key: <key>`.")
    # A dict lookup by digest is safe against timing attacks: the attacker controls the key,
    # not its SHA-256, so timing reveals nothing usable about stored digests.
    tenant = table.tenants.get(digest)
    if tenant is None:
        raise InvalidApiKey("Incorrect API key provided.")
    return tenant


def key_digest(authorization: str | None, api_key: str | None = None) -> str | None:
    """The digest the routing table keys tenants by, of the key `authenticate` reads (None
    when there is none): a long-lived connection hashes its key once and looks it up again."""
    key = bearer_token(authorization) or (api_key.strip() if api_key else None)
    return hash_api_key(key) if key else None
