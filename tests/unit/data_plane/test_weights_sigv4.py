"""SigV4 signing against the example signature calculations that the S3 API reference
publishes ("Authenticating Requests: Using the Authorization Header", examples for
GET Object, PUT Object, GET Bucket Lifecycle and GET Bucket (List Objects))."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest

from data_plane.weights.origins.sigv4 import (
    EMPTY_SHA256,
    AwsCredentials,
    canonical_query,
    canonical_request,
    sha256_hex,
    sign_headers,
    string_to_sign,
    uri_encode,
)

CREDENTIALS = AwsCredentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
WHEN = datetime(2013, 5, 24, tzinfo=UTC)
SCOPE = "20130524/us-east-1/s3/aws4_request"
HOST = "https://examplebucket.s3.amazonaws.com"


def _authorization(signed_headers: str, signature: str) -> str:
    return (
        f"AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/{SCOPE},"
        f"SignedHeaders={signed_headers},Signature={signature}"
    )


def test_get_object_with_range_matches_the_published_example() -> None:
    url = f"{HOST}/test.txt"
    signed = sign_headers(
        "GET", url, {"Range": "bytes=0-9"}, CREDENTIALS, "us-east-1", payload_sha256=EMPTY_SHA256, now=WHEN
    )
    assert signed["authorization"] == _authorization(
        "host;range;x-amz-content-sha256;x-amz-date",
        "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41",
    )
    assert signed["x-amz-date"] == "20130524T000000Z"
    assert signed["host"] == "examplebucket.s3.amazonaws.com"
    # The intermediate steps, as the documentation spells them out.
    canonical, _ = canonical_request(
        "GET",
        httpx.URL(url),
        {k: v for k, v in signed.items() if k != "authorization"} | {"range": "bytes=0-9"},
        EMPTY_SHA256,
    )
    assert canonical == (
        "GET\n/test.txt\n\n"
        "host:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
        f"x-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:20130524T000000Z\n\n"
        f"host;range;x-amz-content-sha256;x-amz-date\n{EMPTY_SHA256}"
    )
    assert string_to_sign("20130524T000000Z", SCOPE, canonical) == (
        f"AWS4-HMAC-SHA256\n20130524T000000Z\n{SCOPE}\n"
        "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972"
    )


def test_put_object_with_an_encoded_key_matches_the_published_example() -> None:
    payload = b"Welcome to Amazon S3."
    url = f"{HOST}/{uri_encode('test$file.text', keep_slash=True)}"
    assert url.endswith("/test%24file.text")
    signed = sign_headers(
        "PUT",
        url,
        {"Date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class": "REDUCED_REDUNDANCY"},
        CREDENTIALS,
        "us-east-1",
        payload_sha256=sha256_hex(payload),
        now=WHEN,
    )
    assert (
        signed["x-amz-content-sha256"] == "44ce7dd67c959e0d3524ffac1771dfbba87d2b6b4b4e99e42034a8b803f8b072"
    )
    assert signed["authorization"] == _authorization(
        "date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class",
        "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd",
    )


def test_get_bucket_lifecycle_matches_the_published_example() -> None:
    signed = sign_headers(
        "GET", f"{HOST}/?lifecycle", {}, CREDENTIALS, "us-east-1", payload_sha256=EMPTY_SHA256, now=WHEN
    )
    assert signed["authorization"] == _authorization(
        "host;x-amz-content-sha256;x-amz-date",
        "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543",
    )


def test_list_objects_matches_the_published_example() -> None:
    # Parameters are sorted in the canonical request whatever their order in the URL.
    signed = sign_headers(
        "GET",
        f"{HOST}/?prefix=J&max-keys=2",
        {},
        CREDENTIALS,
        "us-east-1",
        payload_sha256=EMPTY_SHA256,
        now=WHEN,
    )
    assert signed["authorization"] == _authorization(
        "host;x-amz-content-sha256;x-amz-date",
        "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7",
    )


def test_session_token_is_sent_and_signed() -> None:
    temporary = AwsCredentials(CREDENTIALS.access_key_id, CREDENTIALS.secret_access_key, "session-token")
    signed = sign_headers("GET", f"{HOST}/test.txt", {}, temporary, "us-east-1", now=WHEN)
    assert signed["x-amz-security-token"] == "session-token"
    assert "x-amz-security-token" in signed["authorization"].split("SignedHeaders=")[1].split(",")[0]
    assert signed["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD"
    without = sign_headers("GET", f"{HOST}/test.txt", {}, CREDENTIALS, "us-east-1", now=WHEN)
    assert without["authorization"] != signed["authorization"]


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("", ""),
        ("uploads", "uploads="),
        ("uploadId=a%2Fb%3D&partNumber=2", "partNumber=2&uploadId=a%2Fb%3D"),
        ("name=a b", "name=a%20b"),
        ("k=%7E~", "k=~~"),
    ],
)
def test_canonical_query_sorts_and_encodes_once(raw: str, canonical: str) -> None:
    assert canonical_query(raw) == canonical


def test_secret_is_not_in_the_repr() -> None:
    assert CREDENTIALS.secret_access_key not in repr(CREDENTIALS)
