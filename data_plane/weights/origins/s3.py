"""s3://bucket/prefix on any S3 API (AWS, MinIO, R2, moto), spoken directly over
httpx with SigV4: HEAD for sizes, ranged GETs, PUT or multipart upload."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx

from data_plane.weights.errors import first_error
from data_plane.weights.origins.base import (
    OriginError,
    OriginURI,
    Progress,
)
from data_plane.weights.origins.credentials import (
    AwsCredentialChain,
    AwsCredentialSource,
    StaticAwsCredentials,
)
from data_plane.weights.origins.sigv4 import (
    EMPTY_SHA256,
    AwsCredentials,
    sha256_hex,
    sign_headers,
    uri_encode,
)
from data_plane.weights.origins.transport import (
    check_span,
    describe,
    make_client,
    raise_for_status,
    range_header,
    ranged_body,
    read_span,
    retry_transient,
    transport_errors,
)
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.node import WeightSettings

_log = logging.getLogger(__name__)

# S3 allows at most this many parts per multipart upload.
MAX_PARTS = 10_000
# Parts are held in memory while they upload: this bounds that memory to a few parts.
MAX_PARTS_IN_FLIGHT = 4


def credentials_from_settings(settings: WeightSettings) -> AwsCredentialSource:
    """An access key given in the settings (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
    AWS_SESSION_TOKEN) as it is; else botocore's chain, which refreshes what it finds
    (instance role, web identity, container credentials, profiles)."""
    if not settings.s3_access_key_id or settings.s3_secret_access_key is None:
        return AwsCredentialChain()
    token = settings.s3_session_token.get_secret_value() if settings.s3_session_token else None
    return StaticAwsCredentials(
        AwsCredentials(settings.s3_access_key_id, settings.s3_secret_access_key.get_secret_value(), token))


def _s3_error_detail(response: httpx.Response) -> str:
    """'Code: Message' from an S3 XML error body, when there is one."""
    hint = ""
    if response.status_code in (301, 307, 400) and (other := response.headers.get("x-amz-bucket-region")):
        hint = f" (the bucket is in {other}; set MERIDIAN_WEIGHTS_S3_REGION)"
    if not response.content:
        return hint.strip()
    try:
        root = ET.fromstring(response.content)
    except ET.ParseError:
        return hint.strip()
    code, message = root.findtext("Code") or "", root.findtext("Message") or ""
    return f"{code}: {message}{hint}".strip(": ")


def _xml(response: httpx.Response, what: str, uri: OriginURI, name: str) -> ET.Element:
    try:
        return ET.fromstring(response.content)
    except ET.ParseError as e:
        raise OriginError(f"{what} {describe(uri, name)}: the answer is not XML ({e})") from e


def _child(root: ET.Element, tag: str) -> str | None:
    # S3 answers in its namespace; moto and some S3 APIs answer without one.
    for el in root.iter():
        if el.tag == tag or el.tag.endswith("}" + tag):
            return el.text
    return None


class S3Origin:
    """An S3 bucket and key prefix; `clock` times the retries of uploads."""

    def __init__(
        self, uri: OriginURI, settings: WeightSettings,
        credentials: AwsCredentials | AwsCredentialSource | None = None,
        *, clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not uri.authority:
            raise OriginError(f"{uri}: expected s3://bucket/prefix")
        self.uri = uri
        self.bucket = uri.authority
        self._settings = settings
        self._clock = clock
        if credentials is None:
            self._credentials = credentials_from_settings(settings)
        elif isinstance(credentials, AwsCredentials):
            self._credentials = StaticAwsCredentials(credentials)
        else:
            self._credentials = credentials
        self._sign_region = settings.s3_region
        if settings.s3_endpoint_url:
            # MinIO, moto and most S3 APIs outside AWS want path-style addressing.
            self._base = f"{settings.s3_endpoint_url.rstrip('/')}/{self.bucket}"
        elif "." in self.bucket:
            # A dotted bucket name breaks the *.s3 TLS wildcard: path style instead.
            self._base = f"https://s3.{settings.s3_region}.amazonaws.com/{self.bucket}"
        else:
            self._base = f"https://{self.bucket}.s3.{settings.s3_region}.amazonaws.com"
        self._client = make_client(settings)

    @property
    def region(self) -> str | None:
        # With a custom endpoint the bucket could be anywhere.
        return None if self._settings.s3_endpoint_url else f"aws:{self._settings.s3_region}"

    def url(self, name: str, query: str = "") -> str:
        """The URL of object `name`, its key percent-encoded the way S3 signs it."""
        url = f"{self._base}/{uri_encode(self.uri.key(name), keep_slash=True)}"
        return f"{url}?{query}" if query else url

    async def _send(
        self,
        method: str,
        name: str,
        *,
        query: str = "",
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
        payload_sha256: str | None = None,
        what: str | None = None,
    ) -> httpx.Response:
        """Send one signed request; map failures to origin errors."""
        url = self.url(name, query)
        what = what or method
        request_headers = dict(headers or {})
        credentials = await self._credentials.get()  # refreshed ahead of expiry
        if credentials is not None:
            digest = payload_sha256 or (EMPTY_SHA256 if not content else sha256_hex(content))
            request_headers |= sign_headers(
                method, url, request_headers, credentials, self._sign_region, payload_sha256=digest
            )
        with transport_errors(what, self.uri, name):
            response = await self._client.request(method, url, headers=request_headers, content=content)
        raise_for_status(response, what, self.uri, name, _s3_error_detail(response))
        return response

    async def size(self, name: str) -> int:
        """Size in bytes of an object (HEAD); OriginNotFound if it does not exist."""
        response = await self._send("HEAD", name)
        length = response.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise OriginError(f"HEAD {describe(self.uri, name)}: no Content-Length")
        return int(length)

    async def read(self, name: str) -> bytes:
        """A whole (small) object."""
        return (await self._send("GET", name)).content

    async def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (one ranged GET)."""
        check_span(start, end)
        if start == end:
            return b""
        response = await self._send(
            "GET", name, headers=range_header(start, end), what=f"GET bytes [{start}, {end}) of"
        )
        return ranged_body(response, start, end, self.uri, name)

    async def write_bytes(self, name: str, data: bytes) -> None:
        """Store a small object with one PUT."""
        digest = await asyncio.to_thread(sha256_hex, data) if len(data) > 1 << 20 else sha256_hex(data)
        await retry_transient(
            self._settings,
            self._clock,
            lambda: self._send("PUT", name, content=data, payload_sha256=digest, what="PUT"),
        )

    async def write(self, name: str, source: Path, progress: Progress | None = None) -> None:
        """Store a local file as `name`: one PUT, or a multipart upload above the threshold.
        S3 makes the object visible only when the PUT or the upload completes."""
        size = (await asyncio.to_thread(os.stat, source)).st_size
        if size <= self._settings.multipart_threshold_bytes:
            data = await asyncio.to_thread(source.read_bytes)
            await self.write_bytes(name, data)
            if progress is not None:
                progress(len(data))
            return
        await self._multipart_upload(name, source, size, progress)

    async def _multipart_upload(self, name: str, source: Path, size: int, progress: Progress | None) -> None:
        part_bytes = max(self._settings.multipart_part_bytes, -(-size // MAX_PARTS))
        spans = [(off, min(size, off + part_bytes)) for off in range(0, size, part_bytes)]
        create = asyncio.ensure_future(retry_transient(
            self._settings,
            self._clock,
            lambda: self._send("POST", name, query="uploads", what="CreateMultipartUpload"),
        ))
        try:
            created = await asyncio.shield(create)
        except asyncio.CancelledError:
            # S3 may have created the upload before the caller gave up; its id is in the
            # answer, and without an abort it would stay behind (CI saw a caller under load
            # cancel while the create was still on its way).
            await _outlast_cancellation(create)
            if not create.cancelled() and create.exception() is None:
                with contextlib.suppress(OriginError):
                    await self._abort(name, self._upload_id(create.result(), name))
            raise
        upload_id = self._upload_id(created, name)
        upload_query = f"uploadId={uri_encode(upload_id, keep_slash=False)}"
        in_flight = asyncio.Semaphore(max(1, min(self._settings.concurrency, MAX_PARTS_IN_FLIGHT)))

        async def upload_part(number: int, start: int, end: int) -> str:
            async with in_flight:
                data = await asyncio.to_thread(read_span, source, start, end)
                digest = await asyncio.to_thread(sha256_hex, data)
                response = await retry_transient(
                    self._settings,
                    self._clock,
                    lambda: self._send(
                        "PUT",
                        name,
                        query=f"partNumber={number}&{upload_query}",
                        content=data,
                        payload_sha256=digest,
                        what=f"UploadPart {number} of",
                    ),
                )
            etag = response.headers.get("ETag")
            if not etag:
                raise OriginError(f"UploadPart {number} of {describe(self.uri, name)}: no ETag in the answer")
            if progress is not None:
                progress(end - start)
            return etag

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(upload_part(i + 1, s, e)) for i, (s, e) in enumerate(spans)]
            body = _complete_body([t.result() for t in tasks])
            completed = await retry_transient(
                self._settings,
                self._clock,
                lambda: self._send(
                    "POST",
                    name,
                    query=upload_query,
                    content=body,
                    headers={"Content-Type": "application/xml"},
                    what="CompleteMultipartUpload",
                ),
            )
            # S3 may answer 200 and still report an error in the body.
            root = _xml(completed, "CompleteMultipartUpload", self.uri, name)
            if root.tag == "Error" or root.tag.endswith("}Error"):
                raise OriginError(
                    f"CompleteMultipartUpload {describe(self.uri, name)} failed: "
                    f"{_child(root, 'Code')}: {_child(root, 'Message')}"
                )
        except BaseException as failure:
            # Uploaded parts are billed until aborted; the object itself never appeared.
            await self._abort(name, upload_id)
            # Parts fail for one cause (credentials, network): report the first.
            if isinstance(failure, BaseExceptionGroup):
                raise first_error(failure) from failure
            raise

    def _upload_id(self, created: httpx.Response, name: str) -> str:
        upload_id = _child(_xml(created, "CreateMultipartUpload", self.uri, name), "UploadId")
        if not upload_id:
            raise OriginError(f"CreateMultipartUpload {describe(self.uri, name)}: no UploadId in the answer")
        return upload_id

    async def _abort(self, name: str, upload_id: str) -> None:
        """Abort a multipart upload, to its end even when the caller cancels again meanwhile
        (a second Ctrl-C, a shutdown, a part finishing after the first cancel): cut short, it
        would leave the upload and its parts behind. S3 may answer a 5xx while a part it was
        still receiving settles (the client cut the part short, the server had not): the
        abort is retried like any other call. It never raises: the caller's own failure stays
        the one reported, and a left-behind upload is logged so an operator can abort it (or
        a lifecycle rule reaps it)."""
        query = f"uploadId={uri_encode(upload_id, keep_slash=False)}"
        abort = asyncio.ensure_future(
            retry_transient(
                self._settings,
                self._clock,
                lambda: self._send("DELETE", name, query=query, what="AbortMultipartUpload"),
            )
        )
        await _outlast_cancellation(abort)
        if not abort.cancelled() and (error := abort.exception()) is not None:
            _log.warning("multipart upload %s of %s left behind: %s", upload_id, describe(self.uri, name), error)

    async def aclose(self) -> None:
        """Release pooled connections."""
        await self._client.aclose()


async def _outlast_cancellation(task: asyncio.Future[object]) -> None:
    """Wait until `task` has ended, however often the caller is cancelled meanwhile; what it
    ended with is the caller's to read."""
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.shield(task)


def _complete_body(etags: list[str]) -> bytes:
    root = ET.Element("CompleteMultipartUpload", xmlns="http://s3.amazonaws.com/doc/2006-03-01/")
    for number, etag in enumerate(etags, start=1):
        part = ET.SubElement(root, "Part")
        ET.SubElement(part, "PartNumber").text = str(number)
        ET.SubElement(part, "ETag").text = etag
    return ET.tostring(root, xml_declaration=True, encoding="utf-8")
