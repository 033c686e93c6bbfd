"""GCP failures (google.api_core / google.auth exceptions, operation errors) as typed provider errors."""

from __future__ import annotations

import json

import pytest
import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions

from providers.errors import AuthError, CapacityError, ProviderError, QuotaError
from providers.gcp.errors import ComputeErrorEntry, GcpOperationError, map_error

WHERE = "project p, region us-central1, machine type a3-highgpu-8g"


def http_error(status: int, reason: str, message: str) -> api_exceptions.GoogleAPICallError:
    """The exception google-cloud-compute raises for an HTTP error in Google's JSON shape."""
    response = requests.Response()
    response.status_code = status
    response._content = json.dumps(
        {
            "error": {
                "code": status,
                "message": message,
                "errors": [{"message": message, "domain": "global", "reason": reason}],
            }
        }
    ).encode()
    response.request = requests.Request(
        "POST", "https://compute.googleapis.com/compute/v1/projects/p"
    ).prepare()
    return api_exceptions.from_http_response(response)


def test_quota_exceeded_http_error_is_a_quota_error() -> None:
    err = map_error(
        http_error(
            403, "quotaExceeded", "Quota 'NVIDIA_H100_GPUS' exceeded.  Limit: 8.0 in region us-central1."
        ),
        WHERE,
    )

    assert isinstance(err, QuotaError)
    assert "NVIDIA_H100_GPUS" in str(err) and WHERE in str(err)


def test_rate_limit_is_retryable_and_not_a_quota_error() -> None:
    err = map_error(
        http_error(
            403,
            "rateLimitExceeded",
            "Quota exceeded for quota metric 'Queries' and limit 'Queries per minute'",
        ),
        WHERE,
    )

    assert type(err) is ProviderError and err.retryable
    assert "rate limit" in str(err)
    assert (
        type(
            map_error(
                api_exceptions.TooManyRequests("Quota exceeded for quota metric 'Read requests'"), WHERE
            )
        )
        is ProviderError
    )


def test_permission_denied_is_an_auth_error() -> None:
    err = map_error(
        http_error(403, "forbidden", "Required 'compute.instanceGroupManagers.create' permission"), WHERE
    )

    assert isinstance(err, AuthError) and not err.retryable
    assert "permission" in str(err) and WHERE in str(err)


@pytest.mark.parametrize(
    "exc",
    [
        api_exceptions.Unauthorized("Request had invalid authentication credentials."),
        auth_exceptions.DefaultCredentialsError("Your default credentials were not found."),
        auth_exceptions.RefreshError("invalid_grant: Token has been expired or revoked."),
        auth_exceptions.InvalidOperation("Anonymous credentials cannot be refreshed."),
    ],
)
def test_missing_or_rejected_credentials_are_auth_errors(exc: Exception) -> None:
    err = map_error(exc, WHERE)

    assert isinstance(err, AuthError) and not err.retryable
    assert WHERE in str(err)


@pytest.mark.parametrize(
    "code", ["ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"]
)
def test_stockout_in_an_operation_is_a_capacity_error(code: str) -> None:
    failed = GcpOperationError(
        [
            ComputeErrorEntry(
                code,
                "The zone 'projects/p/zones/us-central1-a' does not have "
                "enough resources available to fulfill the request.",
            )
        ]
    )

    err = map_error(failed, WHERE)

    assert isinstance(err, CapacityError) and err.retryable
    assert code in str(err) and WHERE in str(err)


def test_stockout_as_an_http_error_is_a_capacity_error() -> None:
    err = map_error(
        api_exceptions.ServiceUnavailable(
            "The zone 'us-central1-a' does not have enough resources "
            "available to fulfill the request. Resource pool exhausted."
        ),
        WHERE,
    )

    assert isinstance(err, CapacityError)


def test_quota_exceeded_in_an_operation_is_a_quota_error() -> None:
    failed = GcpOperationError(
        [ComputeErrorEntry("QUOTA_EXCEEDED", "Quota 'PREEMPTIBLE_NVIDIA_H100_GPUS' exceeded.")],
        http_status=403,
    )

    err = map_error(failed, WHERE)

    assert isinstance(err, QuotaError)
    assert "PREEMPTIBLE_NVIDIA_H100_GPUS" in str(err)


def test_not_found_is_a_plain_provider_error_that_retrying_does_not_fix() -> None:
    err = map_error(
        http_error(404, "notFound", "The resource 'projects/p/global/instanceTemplates/t' was not found"),
        WHERE,
    )

    assert type(err) is ProviderError and not err.retryable
    assert "instanceTemplates/t" in str(err)


@pytest.mark.parametrize(
    "exc",
    [
        api_exceptions.InternalServerError("backend error"),
        api_exceptions.ServiceUnavailable("try again"),
        api_exceptions.DeadlineExceeded("deadline"),
        api_exceptions.RetryError("retries exhausted", cause=None),
        requests.ConnectionError("connection refused"),
        requests.ReadTimeout("read timed out"),
    ],
)
def test_server_errors_and_timeouts_are_retryable(exc: Exception) -> None:
    err = map_error(exc, WHERE)

    assert type(err) is ProviderError and err.retryable
    assert WHERE in str(err)


def test_bad_request_is_not_retryable() -> None:
    err = map_error(http_error(400, "invalid", "Invalid value for field 'resource.name'"), WHERE)

    assert type(err) is ProviderError and not err.retryable


def test_a_provider_error_passes_through() -> None:
    original = CapacityError("full", provider="gcp")

    assert map_error(original, WHERE) is original
