"""API-key generation and hashing shared by the control plane and the router.

Keys are 256-bit random tokens, so a plain SHA-256 is the right hash at rest (as GitHub
and Stripe do): a slow password hash buys nothing against a key that cannot be guessed,
and routers must check keys on every request.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "mrd_"


def generate_api_key() -> str:
    """Return a new random API key; shown to its owner once and never stored."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """SHA-256 hex digest of an API key, the only form that is stored or distributed."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_prefix(key: str) -> str:
    """A short, non-secret handle for logs and listings."""
    return key[: len(KEY_PREFIX) + 6]


def constant_time_equals(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


def bearer_token(authorization: str | None) -> str | None:
    """Extract the token from an `Authorization: Bearer <token>` header."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
