"""Compute Engine failures as Meridian's typed provider errors: the one mapping the GCP driver uses.

Three shapes of failure reach the driver:

- an HTTP error of the REST API, raised by google-cloud-compute as a google.api_core
  `GoogleAPICallError` whose `errors` list carries Compute's `reason` ("quotaExceeded",
  "rateLimitExceeded", "forbidden", "notFound", ...);
- an Operation that finished with `error.errors[].code` ("QUOTA_EXCEEDED",
  "ZONE_RESOURCE_POOL_EXHAUSTED", ...), or a managed instance whose `lastAttempt.errors` says
  why the MIG could not create it; both are wrapped in `GcpOperationError`;
- no answer at all: missing credentials (google.auth), a refused connection or a timeout.

`map_error` turns any of them into ProviderError / CapacityError / QuotaError / AuthError with
a message naming the project, region and machine type (the caller's `where`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions

from providers.errors import AuthError, CapacityError, ProviderError, QuotaError

PROVIDER = "gcp"

# Compute's codes are UPPER_SNAKE in operations and camelCase in HTTP errors; both are
# normalised to UPPER_SNAKE before these sets are consulted.
_RATE_LIMIT = {"RATE_LIMIT_EXCEEDED", "USER_RATE_LIMIT_EXCEEDED"}
_CAPACITY_MARKERS = ("RESOURCE_POOL_EXHAUSTED", "STOCKOUT", "RESOURCE_NOT_AVAILABLE")
_CAPACITY_TEXT = (
    "resource pool exhausted",
    "resource_pool_exhausted",
    "stockout",
    "does not have enough resources available",
)
_AUTH = {
    "FORBIDDEN",
    "PERMISSION_DENIED",
    "INSUFFICIENT_PERMISSIONS",
    "ACCESS_NOT_CONFIGURED",
    "AUTH_ERROR",
    "UNAUTHENTICATED",
    "REQUIRED",
    "ACCOUNT_DISABLED",
    "SERVICE_DISABLED",
}


@dataclass(frozen=True, slots=True)
class ComputeErrorEntry:
    """One entry of an Operation's `error.errors` or an instance's `lastAttempt.errors.errors`."""

    code: str
    message: str = ""


class GcpOperationError(Exception):
    """A Compute operation, or a MIG's attempt to create an instance, that failed with these errors."""

    def __init__(self, errors: Sequence[ComputeErrorEntry], http_status: int | None = None) -> None:
        self.errors = tuple(errors)
        self.http_status = http_status or None
        super().__init__("; ".join(f"{e.code}: {e.message}" if e.message else e.code for e in self.errors))


def _snake(code: str) -> str:
    """ "quotaExceeded" → "QUOTA_EXCEEDED"; UPPER_SNAKE codes stay as they are."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", code).upper()


def _reasons(exc: api_exceptions.GoogleAPICallError) -> list[str]:
    out = []
    for e in exc.errors or ():
        reason = e.get("reason") if isinstance(e, dict) else getattr(e, "reason", None)
        if reason:
            out.append(str(reason))
    if exc.reason:
        out.append(str(exc.reason))
    return out


def _error(cls: type[ProviderError], message: str, retryable: bool | None = None) -> ProviderError:
    err = cls(message, provider=PROVIDER)
    if retryable is not None:
        err.retryable = retryable
    return err


def classify(status: int | None, codes: Iterable[str], message: str, where: str) -> ProviderError:
    """The typed error for an HTTP status (None: none known), Compute error codes and a message."""
    snake = {_snake(c) for c in codes if c}
    text = message.lower()
    detail = f"{where}: {message}" if message else where
    capacity = any(m in c for c in snake for m in _CAPACITY_MARKERS) or any(t in text for t in _CAPACITY_TEXT)
    if capacity:
        return _error(CapacityError, f"GCP has no capacity for the machine type ({detail})")
    # Rate limits come as 403 rateLimitExceeded or 429, often worded "Quota exceeded for quota metric
    # 'Queries'": they are API request quotas, not resource quotas, so they are checked first.
    if snake & _RATE_LIMIT or status == 429:
        return _error(ProviderError, f"GCP API rate limit hit, retry later ({detail})", retryable=True)
    if any(c.startswith("QUOTA_EXCEEDED") for c in snake) or (
        not snake and "quota" in text and "exceeded" in text
    ):
        return _error(
            QuotaError, f"GCP quota exceeded ({detail}); ask for a quota increase or place elsewhere"
        )
    if status == 401 or "UNAUTHENTICATED" in snake:
        return _error(
            AuthError, f"GCP rejected the credentials ({detail}); check Application Default Credentials"
        )
    if status == 403 or snake & _AUTH:
        return _error(
            AuthError, f"GCP permission denied ({detail}); the credentials lack a Compute Engine role"
        )
    if status == 404:
        return _error(ProviderError, f"GCP resource not found ({detail})", retryable=False)
    if status is None or status >= 500 or status == 409:
        return _error(ProviderError, f"GCP request failed, retryable ({detail})", retryable=True)
    return _error(ProviderError, f"GCP refused the request ({detail})", retryable=False)


def map_error(exc: BaseException, where: str) -> ProviderError:
    """`exc` (an SDK, google.auth, transport or operation failure) as a typed ProviderError.

    `where` names what was asked, e.g. "project p, region us-central1, machine type a3-highgpu-8g".
    A ProviderError passes through unchanged.
    """
    if isinstance(exc, ProviderError):
        return exc
    if isinstance(exc, auth_exceptions.InvalidOperation):
        # google-auth refreshes the token after a 401; anonymous credentials (a stand-in) cannot.
        return _error(
            AuthError,
            f"GCP rejected the request as unauthenticated for {where} and the credentials "
            f"cannot be refreshed: {exc}",
        )
    if isinstance(exc, auth_exceptions.DefaultCredentialsError):
        return _error(
            AuthError,
            f"no GCP credentials for {where}: {exc} (run `gcloud auth application-default "
            "login` or set GOOGLE_APPLICATION_CREDENTIALS)",
        )
    if isinstance(exc, auth_exceptions.RefreshError) and not getattr(exc, "retryable", False):
        return _error(AuthError, f"GCP credentials could not be refreshed for {where}: {exc}")
    if isinstance(exc, GcpOperationError):
        return classify(exc.http_status, [e.code for e in exc.errors], str(exc), where)
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return classify(exc.code, _reasons(exc), exc.message or str(exc), where)
    if isinstance(
        exc,
        api_exceptions.RetryError
        | auth_exceptions.TransportError
        | auth_exceptions.RefreshError
        | requests.RequestException
        | TimeoutError
        | ConnectionError,
    ):
        return _error(
            ProviderError, f"GCP did not answer for {where}: {type(exc).__name__}: {exc}", retryable=True
        )
    return _error(ProviderError, f"GCP call failed for {where}: {type(exc).__name__}: {exc}", retryable=True)
