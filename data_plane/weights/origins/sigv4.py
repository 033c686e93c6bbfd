"""AWS Signature Version 4, header-based, for S3 API requests sent with httpx.

Follows "Authenticating Requests: Using the Authorization Header" of the S3 API
reference: canonical request → string to sign → HMAC chain → Authorization header.
URLs must already be percent-encoded the way S3 expects (see `uri_encode`), since
S3 signs the path exactly as sent, without normalising it."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import quote, unquote

import httpx

ALGORITHM = "AWS4-HMAC-SHA256"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@dataclass(frozen=True)
class AwsCredentials:
    """An access key pair, with the session token of temporary credentials."""

    access_key_id: str
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)


def uri_encode(value: str, *, keep_slash: bool) -> str:
    """Percent-encode all but A-Z a-z 0-9 - _ . ~ (and '/' in paths), as SigV4 requires."""
    return quote(value, safe="/~" if keep_slash else "~")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def canonical_query(raw_query: str) -> str:
    """Query parameters sorted by name, each name and value encoded once."""
    pairs = []
    for part in raw_query.split("&"):
        if not part:
            continue
        name, _, value = part.partition("=")
        pairs.append(
            (uri_encode(unquote(name), keep_slash=False), uri_encode(unquote(value), keep_slash=False))
        )
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


def canonical_request(
    method: str, url: httpx.URL, headers: Mapping[str, str], payload_sha256: str
) -> tuple[str, str]:
    """The canonical request and its signed-headers list; every header given is signed."""
    values = {k.lower(): " ".join(str(v).split()) for k, v in headers.items()}
    names = sorted(values)
    path, _, query = url.raw_path.decode("ascii").partition("?")
    signed_headers = ";".join(names)
    text = "\n".join(
        [
            method.upper(),
            path or "/",
            canonical_query(query),
            "".join(f"{n}:{values[n]}\n" for n in names),
            signed_headers,
            payload_sha256,
        ]
    )
    return text, signed_headers


def string_to_sign(amz_date: str, scope: str, canonical: str) -> str:
    return "\n".join([ALGORITHM, amz_date, scope, sha256_hex(canonical.encode())])


def signing_key(secret_access_key: str, date: str, region: str, service: str) -> bytes:
    key = f"AWS4{secret_access_key}".encode()
    for part in (date, region, service, "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    return key


def sign_headers(
    method: str,
    url: httpx.URL | str,
    headers: Mapping[str, str],
    credentials: AwsCredentials,
    region: str,
    *,
    service: str = "s3",
    payload_sha256: str = UNSIGNED_PAYLOAD,
    now: datetime | None = None,
) -> dict[str, str]:
    """Headers to send with the request: host, x-amz-date, x-amz-content-sha256,
    x-amz-security-token (temporary credentials) and authorization. `headers` are the
    request's other headers to sign (Range, Content-Type, x-amz-*...)."""
    url = httpx.URL(url)
    amz_date = (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    date = amz_date[:8]
    added = {
        "host": url.netloc.decode("ascii"),
        "x-amz-date": amz_date,
        "x-amz-content-sha256": payload_sha256,
    }
    if credentials.session_token:
        added["x-amz-security-token"] = credentials.session_token
    to_sign = {k.lower(): v for k, v in headers.items()} | added
    canonical, signed_headers = canonical_request(method, url, to_sign, payload_sha256)
    scope = f"{date}/{region}/{service}/aws4_request"
    signature = hmac.new(
        signing_key(credentials.secret_access_key, date, region, service),
        string_to_sign(amz_date, scope, canonical).encode(),
        hashlib.sha256,
    ).hexdigest()
    added["authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key_id}/{scope},"
        f"SignedHeaders={signed_headers},Signature={signature}"
    )
    return added
