"""gs://bucket/prefix through the GCS JSON API over httpx: object metadata for sizes,
alt=media with Range for bytes, media or resumable uploads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from pathlib import Path
from urllib.parse import quote

import httpx

from data_plane.weights.origins.base import (
    OriginError,
    OriginUnavailable,
    OriginURI,
    Progress,
)
from data_plane.weights.origins.credentials import GcpCredentialChain
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
from meridian.backoff import Backoff
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.settings.node import WeightSettings

PUBLIC_ENDPOINT = "https://storage.googleapis.com"
# Resumable upload chunks must be multiples of 256 KiB (all but the last).
_CHUNK_QUANTUM = 256 * 1024
_PERSISTED = re.compile(r"^bytes=0-(\d+)$")


def _gcs_error_detail(response: httpx.Response) -> str:
    """The message of a GCS JSON error body, when there is one."""
    try:
        error = response.json().get("error", {})
    except (ValueError, AttributeError):
        return ""
    return str(error.get("message", "")) if isinstance(error, dict) else ""


class GcsOrigin:
    """A GCS bucket and object-name prefix; `clock` times the retries of uploads."""

    def __init__(
        self, uri: OriginURI, settings: WeightSettings, *, credentials: GcpCredentialChain | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not uri.authority:
            raise OriginError(f"{uri}: expected gs://bucket/prefix")
        self.uri = uri
        self.bucket = uri.authority
        self._settings = settings
        self._clock = clock
        self._chunk_backoff = Backoff(settings.retry_base_s, settings.retry_max_s, full=True)
        self._endpoint = settings.gcs_endpoint_url.rstrip("/")
        self._client = make_client(settings)
        self._static_token = settings.gcs_token.get_secret_value() if settings.gcs_token else None
        # Application Default Credentials, refreshed ahead of expiry; an emulator (any endpoint
        # but Google's) takes requests without credentials unless some are given.
        self._credentials = credentials
        if credentials is None and self._static_token is None and self._endpoint == PUBLIC_ENDPOINT:
            self._credentials = GcpCredentialChain()

    @property
    def region(self) -> str | None:
        # A bucket's location needs a bucket GET to learn: unknown here.
        return None

    def object_url(self, name: str) -> str:
        """The JSON API URL of object `name` (its metadata; add alt=media for bytes)."""
        return f"{self._endpoint}/storage/v1/b/{quote(self.bucket, safe='')}/o/{quote(self.uri.key(name), safe='')}"

    def _upload_url(self, name: str, upload_type: str) -> str:
        return (
            f"{self._endpoint}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
            f"?uploadType={upload_type}&name={quote(self.uri.key(name), safe='')}"
        )

    async def _auth(self) -> dict[str, str]:
        if self._static_token is not None:
            return {"Authorization": f"Bearer {self._static_token}"}
        if self._credentials is not None:
            return {"Authorization": f"Bearer {await self._credentials.token()}"}
        return {}

    async def _send(
        self,
        method: str,
        url: str,
        name: str,
        what: str,
        *,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
        ok_statuses: frozenset[int] = frozenset(),
    ) -> httpx.Response:
        request_headers = (headers or {}) | await self._auth()
        with transport_errors(what, self.uri, name):
            response = await self._client.request(method, url, headers=request_headers, content=content)
        if response.status_code not in ok_statuses:
            raise_for_status(response, what, self.uri, name, _gcs_error_detail(response))
        return response

    async def size(self, name: str) -> int:
        """Size in bytes from the object's metadata; OriginNotFound if it does not exist."""
        response = await self._send("GET", self.object_url(name), name, "GET metadata of")
        try:
            return int(response.json()["size"])
        except (ValueError, KeyError, TypeError) as e:
            raise OriginError(f"metadata of {describe(self.uri, name)} has no size") from e

    async def read(self, name: str) -> bytes:
        """A whole (small) object."""
        return (await self._send("GET", self.object_url(name) + "?alt=media", name, "GET")).content

    async def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of an object (one ranged GET)."""
        check_span(start, end)
        if start == end:
            return b""
        response = await self._send(
            "GET",
            self.object_url(name) + "?alt=media",
            name,
            f"GET bytes [{start}, {end}) of",
            headers=range_header(start, end),
        )
        return ranged_body(response, start, end, self.uri, name)

    async def write_bytes(self, name: str, data: bytes) -> None:
        """Store a small object with one media upload (visible only once complete)."""
        await retry_transient(
            self._settings,
            self._clock,
            lambda: self._send(
                "POST",
                self._upload_url(name, "media"),
                name,
                "upload",
                headers={"Content-Type": "application/octet-stream"},
                content=data,
            ),
        )

    async def write(self, name: str, source: Path, progress: Progress | None = None) -> None:
        """Store a local file as `name`: a media upload, or a resumable upload in chunks
        above the multipart threshold. GCS publishes the object only when it is complete."""
        size = (await asyncio.to_thread(os.stat, source)).st_size
        if size <= self._settings.multipart_threshold_bytes:
            data = await asyncio.to_thread(source.read_bytes)
            await self.write_bytes(name, data)
            if progress is not None:
                progress(len(data))
            return
        await self._resumable_upload(name, source, size, progress)

    async def _resumable_upload(self, name: str, source: Path, size: int, progress: Progress | None) -> None:
        started = await retry_transient(
            self._settings,
            self._clock,
            lambda: self._send(
                "POST",
                self._upload_url(name, "resumable"),
                name,
                "start resumable upload of",
                headers={
                    "Content-Type": "application/json; charset=UTF-8",
                    "X-Upload-Content-Type": "application/octet-stream",
                    "X-Upload-Content-Length": str(size),
                },
                content=b"{}",
            ),
        )
        session = started.headers.get("Location")
        if not session:
            raise OriginError(f"resumable upload of {describe(self.uri, name)}: no session URI")
        chunk = max(_CHUNK_QUANTUM, self._settings.multipart_part_bytes // _CHUNK_QUANTUM * _CHUNK_QUANTUM)
        try:
            await self._upload_chunks(session, name, source, size, chunk, progress)
        except BaseException:
            # Abandon the session; an incomplete upload never becomes an object.
            with contextlib.suppress(OriginError):
                await self._send("DELETE", session, name, "cancel upload of", ok_statuses=frozenset({499}))
            raise

    async def _upload_chunks(
        self, session: str, name: str, source: Path, size: int, chunk: int, progress: Progress | None
    ) -> None:
        done_statuses = frozenset({200, 201})
        offset, failures, resync = 0, 0, False
        while True:
            if resync:
                # After a failure, ask the session how much it has kept.
                content, content_range = b"", f"bytes */{size}"
            else:
                end = min(size, offset + chunk)
                content = await asyncio.to_thread(read_span, source, offset, end)
                content_range = f"bytes {offset}-{end - 1}/{size}"
            try:
                response = await self._send(
                    "PUT",
                    session,
                    name,
                    "upload chunk of",
                    headers={"Content-Range": content_range},
                    content=content,
                    ok_statuses=frozenset({308}),
                )
            except OriginUnavailable:
                failures += 1
                if failures >= self._settings.max_attempts:
                    raise
                await self._clock.sleep(self._chunk_backoff.delay(failures))
                resync = True
                continue
            was_resync, resync = resync, False
            if response.status_code in done_statuses:
                if progress is not None and size > offset:
                    progress(size - offset)
                return
            m = _PERSISTED.match(response.headers.get("Range", "").strip())
            persisted = int(m.group(1)) + 1 if m else 0
            if persisted > offset or was_resync:
                failures = 0
            else:
                # The session kept nothing of the chunk just sent.
                failures += 1
                if failures >= self._settings.max_attempts:
                    raise OriginError(f"resumable upload of {describe(self.uri, name)} makes no progress")
            if progress is not None and persisted > offset:
                progress(persisted - offset)
            offset = persisted

    async def aclose(self) -> None:
        """Release pooled connections."""
        await self._client.aclose()
