"""s3:// origin against moto's S3 API in server mode: single PUT and multipart upload,
exact ranged reads, not-found, signatures checked by a server that enforces them,
and no object ever visible half-written."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from data_plane.weights.origins import (
    OriginDenied,
    OriginError,
    OriginNotFound,
    OriginURI,
    open_origin,
)
from data_plane.weights.origins.s3 import S3Origin
from data_plane.weights.origins.sigv4 import EMPTY_SHA256, AwsCredentials, sha256_hex, sign_headers
from meridian.settings.node import WeightSettings

MIB = 1024 * 1024


def _settings(**overrides: object) -> WeightSettings:
    # Multipart at S3's 5 MiB minimum so that one ~11 MiB object takes three parts.
    return WeightSettings(multipart_threshold_bytes=5 * MIB, multipart_part_bytes=5 * MIB, **overrides)


@pytest.fixture
async def origin(s3_bucket: str) -> S3Origin:
    o = open_origin(f"s3://{s3_bucket}/models/tiny", _settings())
    assert isinstance(o, S3Origin)
    yield o
    await o.aclose()


def _pending_uploads(endpoint: str, bucket: str) -> list[str]:
    """Keys of multipart uploads started and neither completed nor aborted."""
    url = f"{endpoint}/{bucket}?uploads"
    headers = sign_headers(
        "GET", url, {}, AwsCredentials("testing", "testing"), "us-east-1", payload_sha256=EMPTY_SHA256
    )
    response = httpx.get(url, headers=headers, timeout=10)
    response.raise_for_status()
    return re.findall(r"<Upload>.*?<Key>(.*?)</Key>", response.text, flags=re.S)


async def test_small_object_roundtrip_and_exact_ranges(origin: S3Origin) -> None:
    data = os.urandom(10_000)
    await origin.write_bytes("model.safetensors", data)
    assert await origin.size("model.safetensors") == 10_000
    assert await origin.read("model.safetensors") == data
    assert await origin.read_range("model.safetensors", 0, 4096) == data[:4096]
    # The last range of a file is usually shorter than the others.
    assert await origin.read_range("model.safetensors", 8192, 10_000) == data[8192:]
    assert await origin.read_range("model.safetensors", 100, 100) == b""


async def test_ranges_beyond_the_object_are_errors(origin: S3Origin) -> None:
    await origin.write_bytes("small.bin", b"0123456789")
    # S3 answers a partly satisfiable range with fewer bytes: that is not what was asked.
    with pytest.raises(OriginError, match="Content-Range"):
        await origin.read_range("small.bin", 5, 20)
    with pytest.raises(OriginError, match="416"):
        await origin.read_range("small.bin", 50, 60)


async def test_missing_objects_and_buckets_are_not_found(origin: S3Origin, moto_s3: str) -> None:
    with pytest.raises(OriginNotFound, match="models/tiny/absent.bin"):
        await origin.size("absent.bin")
    with pytest.raises(OriginNotFound, match="NoSuchKey"):
        await origin.read("absent.bin")
    with pytest.raises(OriginNotFound):
        await origin.read_range("absent.bin", 0, 10)
    no_bucket = open_origin("s3://no-such-bucket-here/x", _settings())
    try:
        with pytest.raises(OriginNotFound, match="NoSuchBucket"):
            await no_bucket.read("a.bin")
    finally:
        await no_bucket.aclose()


async def test_keys_with_characters_that_need_encoding(origin: S3Origin) -> None:
    name = "dir with space/w$eights+(1)~=!*'.bin"
    await origin.write_bytes(name, b"payload")
    assert await origin.read(name) == b"payload"
    assert await origin.size(name) == 7


async def test_multipart_upload_of_a_large_file(origin: S3Origin, tmp_path: Path, moto_s3: str) -> None:
    data = os.urandom(11 * MIB + 123)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    progress: list[int] = []
    await origin.write("big.bin", source, progress.append)
    assert sorted(progress) == sorted([5 * MIB, 5 * MIB, MIB + 123])
    assert await origin.size("big.bin") == len(data)
    # Ranges across part boundaries read back exactly.
    assert await origin.read_range("big.bin", 5 * MIB - 10, 5 * MIB + 10) == data[5 * MIB - 10 : 5 * MIB + 10]
    assert await origin.read_range("big.bin", 10 * MIB, len(data)) == data[10 * MIB :]
    assert sha256_hex(await origin.read("big.bin")) == sha256_hex(data)
    assert _pending_uploads(moto_s3, origin.bucket) == []


async def test_an_interrupted_multipart_upload_leaves_no_object_and_no_upload(
    origin: S3Origin, tmp_path: Path, moto_s3: str
) -> None:
    await origin.write_bytes("weights.bin", b"the previous version")
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(11 * MIB))
    # Interrupted mid-upload (Ctrl-C of `meridian model push`, node shutdown), as the
    # first part lands: cancelled there, before the upload can complete, however loaded
    # the machine is (cancelling after an await raced the remaining parts and Complete).
    writing: asyncio.Task[None] = asyncio.create_task(
        origin.write("weights.bin", source, lambda n: writing.cancel())
    )
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(writing, timeout=60)
    assert await origin.read("weights.bin") == b"the previous version"
    assert _pending_uploads(moto_s3, origin.bucket) == []
    with pytest.raises(OriginNotFound):
        await origin.size("never-written.bin")


async def test_an_upload_cancelled_again_while_it_aborts_still_leaves_no_upload(
    origin: S3Origin, tmp_path: Path, moto_s3: str
) -> None:
    """A caller that goes on cancelling (a second Ctrl-C, a shutdown, another part's progress
    after the first cancel) must not cut the abort short and leave billed parts behind."""
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(11 * MIB))
    writing: asyncio.Task[None] = asyncio.create_task(origin.write("again.bin", source, lambda n: None))

    async def keep_cancelling() -> None:
        await asyncio.sleep(0.05)  # the upload has begun
        while not writing.done():
            writing.cancel()
            await asyncio.sleep(0.001)

    canceller = asyncio.create_task(keep_cancelling())
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(writing), timeout=60)
    await canceller
    assert _pending_uploads(moto_s3, origin.bucket) == []
    with pytest.raises(OriginNotFound):
        await origin.size("again.bin")


class _S3Proxy:
    """A loopback HTTP proxy in front of moto that misbehaves as S3 may.

    - `fail_first_abort`: the first AbortMultipartUpload gets S3's 500 InternalError, as S3
      may answer while a part it was still receiving settles (CI saw moto do it when a
      cancelled part was still landing).
    - `hold_create`: a CreateMultipartUpload reaches S3, which creates the upload, and its
      answer waits for `release_create`: the caller can give up with the upload made."""

    def __init__(self, upstream: str, *, fail_first_abort: bool = False, hold_create: bool = False) -> None:
        self.upstream = upstream
        self.fail_first_abort = fail_first_abort
        self.hold_create = hold_create
        self.aborts = 0
        self.create_done = asyncio.Event()
        self.release_create = asyncio.Event()
        self._client = httpx.AsyncClient(timeout=30)

    async def __call__(self, scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        query = scope["query_string"].decode()
        if scope["method"] == "DELETE" and "uploadId=" in query:
            self.aborts += 1
            if self.fail_first_abort and self.aborts == 1:
                error = b"<Error><Code>InternalError</Code><Message>try again</Message></Error>"
                await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"application/xml")]})
                await send({"type": "http.response.body", "body": error})
                return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        url = f"{self.upstream}{scope['raw_path'].decode()}" + (f"?{query}" if query else "")
        answer = await self._client.request(scope["method"], url, headers=headers, content=body)
        if self.hold_create and scope["method"] == "POST" and query == "uploads":
            self.create_done.set()
            await self.release_create.wait()
        drop = {"content-length", "content-encoding", "transfer-encoding", "connection"}
        out = [(k.encode(), v.encode()) for k, v in answer.headers.items() if k.lower() not in drop]
        await send({"type": "http.response.start", "status": answer.status_code, "headers": out})
        await send({"type": "http.response.body", "body": answer.content})


@pytest.fixture
async def s3_proxy(moto_s3: str) -> AsyncIterator[Callable[..., Awaitable[tuple[str, _S3Proxy]]]]:
    """Factory: `await s3_proxy(**behaviour)` starts a proxy in front of moto; its endpoint."""
    running: list[tuple[uvicorn.Server, asyncio.Task[None], _S3Proxy]] = []

    async def start(**behaviour: bool) -> tuple[str, _S3Proxy]:
        proxy = _S3Proxy(moto_s3, **behaviour)
        server = uvicorn.Server(uvicorn.Config(proxy, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
        serving = asyncio.create_task(server.serve())
        running.append((server, serving, proxy))
        while not server.started:
            assert not serving.done(), "the proxy did not start"
            await asyncio.sleep(0.01)
        return f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", proxy

    yield start
    for server, serving, proxy in running:
        proxy.release_create.set()
        server.should_exit = True
        await serving
        await proxy._client.aclose()


async def test_an_abort_answered_with_a_server_error_is_retried(
    s3_proxy: Callable[..., Awaitable[tuple[str, _S3Proxy]]], s3_bucket: str, tmp_path: Path, moto_s3: str
) -> None:
    endpoint, proxy = await s3_proxy(fail_first_abort=True)
    origin = S3Origin(OriginURI.parse(f"s3://{s3_bucket}/models"), _settings(s3_endpoint_url=endpoint, retry_base_s=0.01))
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(11 * MIB))
    try:
        writing: asyncio.Task[None] = asyncio.create_task(
            origin.write("weights.bin", source, lambda n: writing.cancel())
        )
        # The caller sees its own cancellation, not the abort's first answer.
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(writing, timeout=60)
    finally:
        await origin.aclose()
    assert proxy.aborts == 2
    assert _pending_uploads(moto_s3, s3_bucket) == []


async def test_an_upload_cancelled_while_s3_creates_it_leaves_no_upload(
    s3_proxy: Callable[..., Awaitable[tuple[str, _S3Proxy]]], s3_bucket: str, tmp_path: Path, moto_s3: str
) -> None:
    """S3 made the upload; the caller gave up before the answer with its id came back."""
    endpoint, proxy = await s3_proxy(hold_create=True)
    origin = S3Origin(OriginURI.parse(f"s3://{s3_bucket}/models"), _settings(s3_endpoint_url=endpoint))
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(11 * MIB))
    try:
        writing: asyncio.Task[None] = asyncio.create_task(origin.write("weights.bin", source))
        await asyncio.wait_for(proxy.create_done.wait(), timeout=30)
        assert _pending_uploads(moto_s3, s3_bucket) == ["models/weights.bin"]
        writing.cancel()
        await asyncio.sleep(0)
        proxy.release_create.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(writing, timeout=60)
    finally:
        await origin.aclose()
    assert proxy.aborts == 1
    assert _pending_uploads(moto_s3, s3_bucket) == []


async def test_region_is_unknown_behind_a_custom_endpoint(moto_s3: str) -> None:
    uri = OriginURI.parse("s3://bucket/prefix")
    assert S3Origin(uri, _settings()).region is None
    aws = _settings(s3_endpoint_url=None, s3_region="eu-west-1")
    origin = S3Origin(uri, aws)
    assert origin.region == "aws:eu-west-1"
    assert origin.url("a b.bin") == "https://bucket.s3.eu-west-1.amazonaws.com/prefix/a%20b.bin"
    dotted = S3Origin(OriginURI.parse("s3://my.bucket/p"), aws)
    assert dotted.url("x") == "https://s3.eu-west-1.amazonaws.com/my.bucket/p/x"


# --- A moto server that enforces signatures and IAM policies ---------------------------


@dataclass(frozen=True)
class AuthServer:
    endpoint: str
    bucket: str
    user: AwsCredentials
    temporary: AwsCredentials


def _query_api(endpoint: str, service: str, credentials: AwsCredentials, **params: str) -> str:
    body = str(httpx.QueryParams(params)).encode()
    headers = {"Content-Type": "application/x-www-form-urlencoded; charset=utf-8"}
    headers |= sign_headers(
        "POST",
        f"{endpoint}/",
        headers,
        credentials,
        "us-east-1",
        service=service,
        payload_sha256=sha256_hex(body),
    )
    response = httpx.post(f"{endpoint}/", content=body, headers=headers, timeout=10)
    response.raise_for_status()
    return response.text


def _tag(xml: str, tag: str) -> str:
    m = re.search(rf"<{tag}>(.*?)</{tag}>", xml)
    assert m, f"no <{tag}> in {xml[:300]}"
    return m.group(1)


@pytest.fixture(scope="module")
def auth_server(private_moto_server: str) -> AuthServer:
    """A moto server of its own (auth is server-wide) with an IAM user allowed s3:*, and
    a role's temporary credentials, then switched to checking every request's signature."""
    endpoint = private_moto_server
    setup = AwsCredentials("testing", "testing")
    iam = {"Version": "2010-05-08"}
    _query_api(endpoint, "iam", setup, Action="CreateUser", UserName="pusher", **iam)
    key = _query_api(endpoint, "iam", setup, Action="CreateAccessKey", UserName="pusher", **iam)
    user = AwsCredentials(_tag(key, "AccessKeyId"), _tag(key, "SecretAccessKey"))
    allow = (
        '{"Version":"2012-10-17","Statement":'
        '[{"Effect":"Allow","Action":["s3:*","sts:AssumeRole"],"Resource":"*"}]}'
    )
    trust = (
        '{"Version":"2012-10-17","Statement":'
        '[{"Effect":"Allow","Principal":{"AWS":"*"},"Action":"sts:AssumeRole"}]}'
    )
    _query_api(
        endpoint,
        "iam",
        setup,
        Action="PutUserPolicy",
        UserName="pusher",
        PolicyName="s3",
        PolicyDocument=allow,
        **iam,
    )
    role = _query_api(
        endpoint, "iam", setup, Action="CreateRole", RoleName="node", AssumeRolePolicyDocument=trust, **iam
    )
    _query_api(
        endpoint,
        "iam",
        setup,
        Action="PutRolePolicy",
        RoleName="node",
        PolicyName="s3",
        PolicyDocument=allow,
        **iam,
    )
    bucket_url = f"{endpoint}/weights"
    signed = sign_headers("PUT", bucket_url, {}, user, "us-east-1", payload_sha256=EMPTY_SHA256)
    httpx.put(bucket_url, headers=signed, timeout=10).raise_for_status()
    # From here on every request must carry a valid signature of a known key.
    httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"0", timeout=10).raise_for_status()
    session = _query_api(
        endpoint,
        "sts",
        user,
        Action="AssumeRole",
        RoleArn=_tag(role, "Arn"),
        RoleSessionName="node-1",
        Version="2011-06-15",
    )
    temporary = AwsCredentials(
        _tag(session, "AccessKeyId"), _tag(session, "SecretAccessKey"), _tag(session, "SessionToken")
    )
    return AuthServer(endpoint, "weights", user, temporary)


def _auth_origin(server: AuthServer, credentials: AwsCredentials) -> S3Origin:
    settings = _settings(s3_endpoint_url=server.endpoint, s3_region="us-east-1")
    return S3Origin(OriginURI.parse(f"s3://{server.bucket}/signed"), settings, credentials)


async def test_signatures_are_accepted_by_a_server_that_verifies_them(
    auth_server: AuthServer, tmp_path: Path
) -> None:
    origin = _auth_origin(auth_server, auth_server.user)
    try:
        await origin.write_bytes("odd name+$(1).bin", b"signed bytes")
        assert await origin.read_range("odd name+$(1).bin", 7, 12) == b"bytes"
        source = tmp_path / "big.bin"
        source.write_bytes(os.urandom(6 * MIB))
        await origin.write("big.bin", source)
        assert await origin.size("big.bin") == 6 * MIB
    finally:
        await origin.aclose()


async def test_temporary_credentials_with_a_session_token(auth_server: AuthServer) -> None:
    origin = _auth_origin(auth_server, auth_server.temporary)
    try:
        await origin.write_bytes("from-session.bin", b"temporary")
        assert await origin.read("from-session.bin") == b"temporary"
    finally:
        await origin.aclose()
    key = auth_server.temporary
    without_token = _auth_origin(auth_server, AwsCredentials(key.access_key_id, key.secret_access_key))
    try:
        with pytest.raises(OriginDenied):
            await without_token.read("from-session.bin")
    finally:
        await without_token.aclose()


async def test_wrong_credentials_are_denied(auth_server: AuthServer) -> None:
    user = auth_server.user
    wrong_secret = _auth_origin(auth_server, AwsCredentials(user.access_key_id, "x" * 40))
    unknown_key = _auth_origin(auth_server, AwsCredentials("AKIAUNKNOWNKEY000000", user.secret_access_key))
    try:
        with pytest.raises(OriginDenied, match="SignatureDoesNotMatch"):
            await wrong_secret.write_bytes("denied.bin", b"x")
        with pytest.raises(OriginDenied, match="InvalidAccessKeyId"):
            await unknown_key.read("denied.bin")
    finally:
        await wrong_secret.aclose()
        await unknown_key.aclose()
