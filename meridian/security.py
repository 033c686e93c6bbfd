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


# Shared secrets an operator chooses (the cluster token, the bootstrap admin key, a router's
# metrics token) must be at least this long and not a repeated pattern: "t" or "changeme"
# were accepted, and either one lets anyone past the nodes' or the admin API's auth.
MIN_SECRET_CHARS = 16
MIN_SECRET_DISTINCT_CHARS = 8
SECRET_SETTINGS = ("cluster_token", "bootstrap_admin_key", "metrics_token")


def weak_secret(value: str) -> str | None:
    """Why `value` is too weak to be a shared secret (None: it is not)."""
    if len(value) < MIN_SECRET_CHARS:
        return f"shorter than {MIN_SECRET_CHARS} characters"
    if len(set(value)) < MIN_SECRET_DISTINCT_CHARS:
        return f"fewer than {MIN_SECRET_DISTINCT_CHARS} distinct characters"
    return None


def weak_secrets(settings: object) -> list[str]:
    """'<field>: <why>' for each configured shared secret of `settings` that is too weak
    (make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`)."""
    problems = []
    for name in SECRET_SETTINGS:
        secret = getattr(settings, name, None)
        value = secret.get_secret_value() if secret is not None else None
        if value is not None and (why := weak_secret(value)):
            problems.append(f"{name}: {why}")
    return problems


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
