"""AWS failures mapped to the providers' typed errors, from errors built the way botocore builds them."""

from __future__ import annotations

import json
from typing import Any

import botocore.session
import pytest
from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)
from botocore.parsers import ResponseParserError, create_parser

from providers.aws.errors import ScalingActivityFailed, error_code, map_error
from providers.errors import AuthError, CapacityError, ProviderError, QuotaError

_SESSION = botocore.session.get_session()


def client_error(service: str, operation: str, status: int, code: str, message: str) -> ClientError:
    """The ClientError botocore raises for an HTTP error answer of `service` in its own protocol."""
    model = _SESSION.get_service_model(service)
    protocol = model.metadata["protocol"]
    headers: dict[str, str] = {"x-amzn-requestid": "req-1"}
    body: bytes
    if protocol == "ec2":
        body = (f"<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors>"
                "<RequestID>req-1</RequestID></Response>").encode()
    elif protocol == "query":
        body = (f"<ErrorResponse><Error><Type>Sender</Type><Code>{code}</Code><Message>{message}</Message>"
                "</Error><RequestId>req-1</RequestId></ErrorResponse>").encode()
    else:
        headers["content-type"] = "application/x-amz-json-1.1"
        body = json.dumps({"__type": code, "message": message}).encode()
    operation_model = model.operation_model(operation)
    parsed = create_parser(protocol).parse(
        {"status_code": status, "headers": headers, "body": body}, operation_model.output_shape)
    return ClientError(parsed, operation)


def mapped(error: BaseException, instance_type: str | None = "p5.48xlarge") -> ProviderError:
    return map_error(error, action="resizing group g", region="us-east-1", instance_type=instance_type)


@pytest.mark.parametrize(("service", "operation", "code", "message"), [
    ("ec2", "RunInstances", "InsufficientInstanceCapacity",
     "We currently do not have sufficient p5.48xlarge capacity in the Availability Zone you requested (us-east-1a)."),
    ("ec2", "RunInstances", "Unsupported",
     "Your requested instance type (p5.48xlarge) is not supported in your requested Availability Zone (us-east-1e)."),
    ("ec2", "CreateFleet", "InsufficientCapacity", "There is no capacity available that matches your request."),
])
def test_stock_outs_are_capacity_errors(service: str, operation: str, code: str, message: str) -> None:
    error = mapped(client_error(service, operation, 500 if code == "InsufficientCapacity" else 400, code, message))
    assert type(error) is CapacityError and error.retryable and error.provider == "aws"
    assert "us-east-1" in str(error) and "p5.48xlarge" in str(error) and code in str(error)


@pytest.mark.parametrize(("service", "operation", "code"), [
    ("ec2", "RunInstances", "VcpuLimitExceeded"),
    ("ec2", "RunInstances", "InstanceLimitExceeded"),
    ("ec2", "RequestSpotInstances", "MaxSpotInstanceCountExceeded"),
    ("autoscaling", "CreateAutoScalingGroup", "LimitExceeded"),
])
def test_used_up_limits_are_quota_errors(service: str, operation: str, code: str) -> None:
    error = mapped(client_error(service, operation, 400, code, "You have requested more vCPU capacity than "
                                "your current vCPU limit of 0 allows for the instance bucket."))
    assert type(error) is QuotaError
    assert "us-east-1" in str(error) and "Running On-Demand P instances" in str(error) and code in str(error)


@pytest.mark.parametrize(("service", "operation", "status", "code"), [
    ("ec2", "DescribeSubnets", 401, "AuthFailure"),
    ("ec2", "RunInstances", 403, "UnauthorizedOperation"),
    ("autoscaling", "DescribeAutoScalingGroups", 403, "AccessDenied"),
    ("service-quotas", "GetServiceQuota", 400, "AccessDeniedException"),
    ("autoscaling", "DescribeAutoScalingGroups", 403, "InvalidClientTokenId"),
    ("ec2", "DescribeSubnets", 403, "SignatureDoesNotMatch"),
    ("autoscaling", "SetDesiredCapacity", 403, "ExpiredToken"),
])
def test_refused_credentials_are_auth_errors_and_not_retried(service: str, operation: str, status: int,
                                                            code: str) -> None:
    error = mapped(client_error(service, operation, status, code, "Request refused."))
    assert type(error) is AuthError and not error.retryable
    assert code in str(error) and "us-east-1" in str(error)


def test_missing_credentials_are_an_auth_error() -> None:
    error = mapped(NoCredentialsError())
    assert type(error) is AuthError and not error.retryable and "AWS_ACCESS_KEY_ID" in str(error)


@pytest.mark.parametrize("transport", [
    EndpointConnectionError(endpoint_url="https://ec2.us-east-1.amazonaws.com/"),
    ConnectTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com/"),
    ReadTimeoutError(endpoint_url="https://ec2.us-east-1.amazonaws.com/"),
    TimeoutError(),
    ResponseParserError("invalid XML received"),
])
def test_network_failures_are_retryable_provider_errors(transport: Exception) -> None:
    error = mapped(transport)
    assert type(error) is ProviderError and error.retryable and "us-east-1" in str(error)


def test_other_refusals_are_retried_only_when_aws_may_answer_differently() -> None:
    throttled = mapped(client_error("ec2", "DescribeInstances", 503, "RequestLimitExceeded", "Request limit exceeded."))
    assert type(throttled) is ProviderError and throttled.retryable
    busy = mapped(client_error("autoscaling", "SetDesiredCapacity", 400, "ScalingActivityInProgress", "busy"))
    assert busy.retryable
    invalid = mapped(client_error("autoscaling", "SetDesiredCapacity", 400, "ValidationError",
                                  "New SetDesiredCapacity value 20 is above max value 16 for the AutoScalingGroup."))
    assert type(invalid) is ProviderError and not invalid.retryable and "above max value 16" in str(invalid)
    internal = mapped(client_error("ec2", "DescribeInstances", 500, "InternalError", "An internal error occurred."))
    assert internal.retryable


def test_an_xml_error_where_json_was_expected_is_read_by_its_code() -> None:
    # moto answers Service Quotas (a JSON API) with an XML error body when it refuses keys.
    parsed: dict[str, Any] = {
        "Error": {"Code": "403", "Message": "<?xml version=\"1.0\"?><ErrorResponse><Errors><Error>"
                  "<Code>InvalidClientTokenId</Code><Message>The security token included in the request is "
                  "invalid.</Message></Error></Errors></ErrorResponse>"},
        "ResponseMetadata": {"HTTPStatusCode": 403},
    }
    error = ClientError(parsed, "GetServiceQuota")
    assert error_code(error) == "InvalidClientTokenId"
    out = mapped(error)
    assert type(out) is AuthError and "InvalidClientTokenId: The security token included" in str(out)


@pytest.mark.parametrize(("message", "kind", "code"), [
    ("We currently do not have sufficient p5.48xlarge capacity in the Availability Zone you requested "
     "(us-east-1b). Our system will be working on provisioning additional capacity. Launching EC2 instance failed.",
     CapacityError, "InsufficientInstanceCapacity"),
    ("Could not launch Spot Instances. InsufficientInstanceCapacity - There is no Spot capacity available that "
     "matches your request. Launching EC2 instance failed.", CapacityError, "InsufficientInstanceCapacity"),
    ("Your requested instance type (p5.48xlarge) is not supported in your requested Availability Zone "
     "(us-east-1e). Please retry your request by not specifying an Availability Zone. Launching EC2 instance failed.",
     CapacityError, "Unsupported"),
    ("You have requested more vCPU capacity than your current vCPU limit of 0 allows for the instance bucket that "
     "the specified instance type belongs to. Please visit http://aws.amazon.com/contact-us/ec2-request to request "
     "an adjustment to this limit. Launching EC2 instance failed.", QuotaError, "VcpuLimitExceeded"),
    ("Could not launch Spot Instances. MaxSpotInstanceCountExceeded - Max spot instance count exceeded. "
     "Launching EC2 instance failed.", QuotaError, "MaxSpotInstanceCountExceeded"),
    ("You are not authorized to use launch template: lt-0abc. Launching EC2 instance failed.",
     AuthError, "UnauthorizedOperation"),
])
def test_failed_launches_of_a_scaling_activity_map_like_call_errors(message: str, kind: type, code: str) -> None:
    failure = ScalingActivityFailed("meridian-m-p5-48xlarge-abc", message)
    assert error_code(failure) == code
    error = mapped(failure)
    assert type(error) is kind and "us-east-1" in str(error) and "p5.48xlarge" in str(error)


def test_a_failed_launch_for_another_reason_is_not_retried_as_is() -> None:
    error = mapped(ScalingActivityFailed("g", "The image id '[ami-0abc]' does not exist. Launching EC2 instance "
                                              "failed."))
    assert type(error) is ProviderError and not error.retryable and "ami-0abc" in str(error)


def test_typed_errors_pass_through_and_other_exceptions_are_not_aws_errors() -> None:
    original = CapacityError("full")
    assert mapped(original) is original
    with pytest.raises(TypeError):
        mapped(KeyError("x"))
