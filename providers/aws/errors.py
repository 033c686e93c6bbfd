"""AWS failures as the providers' typed errors: the one place that reads botocore's error codes.

A failed call (botocore's ClientError and its transport errors) and a failed Auto Scaling
launch (which AWS reports in a scaling activity, not as an error of the call that asked for
capacity) both go through `map_error`, so the reconciler tells a stock-out from a used-up
quota or a bad key the same way whichever way AWS said it.
"""

from __future__ import annotations

import re

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    CredentialRetrievalError,
    HTTPClientError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.parsers import ResponseParserError

from providers.errors import AuthError, CapacityError, ProviderError, QuotaError

PROVIDER = "aws"

CAPACITY_CODES = frozenset({
    "InsufficientInstanceCapacity", "InsufficientCapacity", "InsufficientHostCapacity", "Unsupported",
})
QUOTA_CODES = frozenset({
    "VcpuLimitExceeded", "InstanceLimitExceeded", "LimitExceeded", "MaxSpotInstanceCountExceeded",
    "ServiceQuotaExceededException",
})
AUTH_CODES = frozenset({
    "AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken",
    "ExpiredTokenException", "UnrecognizedClientException", "OptInRequired",
})
# Codes that say "not now": the same request may succeed later.
TRANSIENT_CODES = frozenset({
    "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    "ResourceContention", "ScalingActivityInProgress", "InternalError", "InternalFailure",
    "ServiceUnavailable", "Unavailable", "RequestTimeout",
})

# What a failed scaling activity's StatusMessage says when it names no code.
_ACTIVITY_PHRASES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"do not have sufficient .* capacity|no spot capacity available", re.I), "InsufficientInstanceCapacity"),
    (re.compile(r"is not supported in your requested availability zone", re.I), "Unsupported"),
    (re.compile(r"more vcpu capacity than your current vcpu limit|vcpu limit", re.I), "VcpuLimitExceeded"),
    (re.compile(r"instance limit|max spot instance count", re.I), "InstanceLimitExceeded"),
    (re.compile(r"not authorized|unauthorized|access denied|do not have permission", re.I), "UnauthorizedOperation"),
)
_XML_CODE = re.compile(r"<Code>([A-Za-z0-9.]+)</Code>")
_XML_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_KNOWN_CODES = sorted(CAPACITY_CODES | QUOTA_CODES | AUTH_CODES, key=len, reverse=True)


class ScalingActivityFailed(Exception):
    """An Auto Scaling activity that ended in Failed: AWS could not launch the group's instances."""

    def __init__(self, group: str, status_message: str) -> None:
        super().__init__(f"scaling activity of {group} failed: {status_message}")
        self.group = group
        self.status_message = status_message


def error_code(error: BaseException) -> str | None:
    """AWS's error code of a ClientError or a failed scaling activity (None for other errors)."""
    if isinstance(error, ClientError):
        info = error.response.get("Error", {})
        code = str(info.get("Code") or "")
        # An XML error body where botocore expected JSON (moto's Service Quotas) leaves the HTTP
        # status as the code and the body as the message; the real code is in the body.
        if code.isdigit() and (found := _XML_CODE.search(str(info.get("Message") or ""))):
            return found.group(1)
        return code or None
    if isinstance(error, ScalingActivityFailed):
        # The message names the code when EC2 gave one ("... InsufficientInstanceCapacity - ...").
        for code in _KNOWN_CODES:
            if re.search(rf"\b{re.escape(code)}\b", error.status_message):
                return code
        for pattern, code in _ACTIVITY_PHRASES:
            if pattern.search(error.status_message):
                return code
    return None


def _quota_hint(instance_type: str | None) -> str:
    family = "P" if instance_type and instance_type.startswith("p") else "G and VT"
    return (f"request an increase of 'Running On-Demand {family} instances' (or 'All {family} Spot Instance "
            "Requests') in Service Quotas")


def map_error(
    error: BaseException, *, action: str, region: str, instance_type: str | None = None
) -> ProviderError:
    """The typed error for an AWS failure while doing `action` in `region` (for `instance_type`).

    CapacityError: AWS has none of the instance type now. QuotaError: the account's limit is
    used up. AuthError (not retryable): missing, wrong or expired credentials or a missing
    permission. Any other failure is a ProviderError, retryable when AWS or the network may
    answer differently next time (throttling, 5xx, timeouts, unreachable endpoint).
    """
    if isinstance(error, ProviderError):
        return error
    where = f"AWS {action} in {region}" + (f" for {instance_type}" if instance_type else "")
    if isinstance(error, TimeoutError):
        return ProviderError(f"{where}: no answer in time", provider=PROVIDER)
    if isinstance(error, NoCredentialsError | PartialCredentialsError | CredentialRetrievalError):
        return AuthError(f"{where}: no usable AWS credentials ({error}); set them the way boto3 looks for them "
                         "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)",
                         provider=PROVIDER)
    if isinstance(error, BotoConnectionError | HTTPClientError):
        return ProviderError(f"{where}: cannot reach the AWS endpoint: {error}", provider=PROVIDER)
    if isinstance(error, ResponseParserError):
        return ProviderError(f"{where}: unreadable answer from the AWS endpoint: {error}", provider=PROVIDER)

    code = error_code(error)
    if isinstance(error, ClientError):
        detail = str(error.response.get("Error", {}).get("Message") or error)
        if (found := _XML_MESSAGE.search(detail)) is not None:
            detail = found.group(1)
        status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    elif isinstance(error, ScalingActivityFailed):
        detail, status = error.status_message, 0
    elif isinstance(error, NoRegionError | BotoCoreError):
        out = ProviderError(f"{where}: {error}", provider=PROVIDER)
        out.retryable = False
        return out
    else:
        raise TypeError(f"not an AWS error: {error!r}") from error
    said = f"{code}: {detail}" if code and not detail.startswith(code) else detail

    if code in CAPACITY_CODES:
        what = instance_type or "the instance type"
        return CapacityError(f"{where}: AWS has no {what} capacity available now ({said})", provider=PROVIDER)
    if code in QUOTA_CODES:
        return QuotaError(f"{where}: account quota exceeded ({said}); {_quota_hint(instance_type)}",
                          provider=PROVIDER)
    if code in AUTH_CODES or (code or "").startswith("AccessDenied") or status in (401, 403):
        return AuthError(f"{where}: AWS refused the credentials or a permission ({said}); check the keys boto3 "
                         "finds and the IAM policy (ec2:Describe*, autoscaling:*, servicequotas:Get*)",
                         provider=PROVIDER)
    out = ProviderError(f"{where}: {said}", provider=PROVIDER)
    # A request AWS refused as such (4xx) fails the same way until something else changes.
    out.retryable = code in TRANSIENT_CODES or status >= 500
    return out
