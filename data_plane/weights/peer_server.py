"""The node's side of peer sharing: same-region nodes read its cached blobs and model
files over HTTP with Range, including chunks of a download still in progress.

A peer asking for a blob this node is about to download waits for it, for at most
`wait_s` of the cache's `Clock` (the node's), then hears 503 and tries another source."""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response

from data_plane.weights.cache import NodeCache, PartialBlob

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_START_POLL_S = 0.05


def _parse_range(header: str | None, size: int, limit: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=a-b` range; None for the whole object."""
    if header is None:
        return None
    match = _RANGE.match(header.strip())
    if not match:
        raise HTTPException(416, "only one range of the form bytes=start-end is served")
    start = int(match[1])
    end = min(size, int(match[2]) + 1) if match[2] else size
    if start >= size or end <= start:
        raise HTTPException(416, f"range not satisfiable for {size} bytes",
                            headers={"Content-Range": f"bytes */{size}"})
    if end - start > limit:
        raise HTTPException(416, f"ranges are served up to {limit} bytes")
    return start, end


def _read(path: Path, start: int, end: int) -> bytes:
    with open(path, "rb") as f:
        return os.pread(f.fileno(), end - start, start)


async def _serve(path: Path, size: int, request: Request, limit: int) -> Response:
    span = _parse_range(request.headers.get("range"), size, limit)
    headers = {"Accept-Ranges": "bytes"}
    if request.method == "HEAD":
        return Response(status_code=200, headers={**headers, "Content-Length": str(size)})
    if span is None:
        if size > limit:
            raise HTTPException(416, f"objects above {limit} bytes are served in ranges")
        span = (0, size)
        status = 200
    else:
        status = 206
        headers["Content-Range"] = f"bytes {span[0]}-{span[1] - 1}/{size}"
    body = await asyncio.to_thread(_read, path, *span)
    return Response(body, status_code=status, headers=headers, media_type="application/octet-stream")


def _read_partial(partial: PartialBlob, blob: Path, start: int, end: int) -> bytes:
    # By path, not the downloader's fd: it may be published (renamed) and closed meanwhile,
    # and a closed fd number can already name another file.
    try:
        return _read(partial.path, start, end)
    except FileNotFoundError:
        return _read(blob, start, end)


async def _serve_partial(
    partial: PartialBlob, cache_blob: Path, request: Request, limit: int, wait_s: float
) -> Response:
    file = partial.file
    span = _parse_range(request.headers.get("range"), file.size, limit) or (0, file.size)
    if request.method == "HEAD":
        return Response(status_code=200, headers={"Content-Length": str(file.size), "Accept-Ranges": "bytes"})
    first, last = span[0] // file.chunk_size, (span[1] - 1) // file.chunk_size
    try:
        await partial.wait_chunks(list(range(first, last + 1)), wait_s)
    except TimeoutError:
        raise HTTPException(503, "those bytes have not arrived here yet; try another source") from None
    try:
        body = await asyncio.to_thread(_read_partial, partial, cache_blob, *span)
    except FileNotFoundError:
        raise HTTPException(503, "this node's download stopped; try another source") from None
    headers = {"Accept-Ranges": "bytes", "Content-Range": f"bytes {span[0]}-{span[1] - 1}/{file.size}"}
    return Response(body, status_code=206, headers=headers, media_type="application/octet-stream")


def weights_router(cache: NodeCache, *, max_range_bytes: int, wait_s: float) -> APIRouter:
    """Routes under /v1/weights; the app adds the cluster-token dependency."""
    router = APIRouter(prefix="/v1/weights")

    @router.api_route("/blobs/{sha256}", methods=["GET", "HEAD"])
    async def blob(sha256: str, request: Request) -> Response:
        if not _SHA256.match(sha256):
            raise HTTPException(404, "no such blob")
        path = cache.blob_path(sha256)
        clock = cache.clock
        deadline = clock.monotonic() + wait_s
        while True:
            try:
                return await _serve(path, path.stat().st_size, request, max_range_bytes)
            except FileNotFoundError:
                pass
            partial = cache.download_in_progress(sha256)
            if partial is not None:
                return await _serve_partial(partial, path, request, max_range_bytes, deadline - clock.monotonic())
            if not cache.expecting(sha256):
                raise HTTPException(404, "this node has no such blob")
            if clock.monotonic() >= deadline:
                raise HTTPException(503, "this node has not started that download yet; try another source")
            # Its pull is between reading the manifest and opening the download.
            await clock.sleep(_START_POLL_S)

    @router.api_route("/models/{digest}/{name:path}", methods=["GET", "HEAD"])
    async def model_file(digest: str, name: str, request: Request) -> Response:
        if not _SHA256.match(digest):
            raise HTTPException(404, "no such model")
        root = cache.model_path(digest).resolve()
        path = (root / name).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise HTTPException(404, "this node has no such model file")
        return await _serve(path, path.stat().st_size, request, max_range_bytes)

    return router
