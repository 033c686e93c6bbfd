"""Typed errors of the providers' drivers, so the reconciler can tell a full site from a bad key."""

from __future__ import annotations


class ProviderError(Exception):
    """A provider refused or failed a request; `retryable` says whether trying again may help."""

    retryable: bool = True

    def __init__(self, message: str, *, provider: str | None = None) -> None:
        super().__init__(message)
        self.provider = provider


class CapacityError(ProviderError):
    """The region has no more of the instance type (a cloud's stock-out, an on-prem site's last host)."""


class QuotaError(ProviderError):
    """The account's quota for the instance type or its GPUs is used up."""


class AuthError(ProviderError):
    """The driver's credentials are missing, wrong or lack a permission."""

    retryable = False
