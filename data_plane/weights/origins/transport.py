"""What the HTTP-based origins share: one pooled client per origin, one mapping from
HTTP statuses and transport failures to origin errors, strict checks on ranged
responses, and retries of transient upload failures (their backoff waited out on a
`Clock`, so a test moves time instead of sleeping)."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx

from data_plane.weights.origins.base import (
    OriginDenied,
    OriginError,
    OriginNotFound,
    OriginUnavailable,
    OriginURI,
)
from meridian.backoff import Backoff
from meridian.clock import Clock
from meridian.settings.node import WeightSettings

T = TypeVar("T")

_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_TOTAL_ONLY = re.compile(r"^bytes \*/(\d+)$")


def make_client(
    settings: WeightSettings,
    *,
    follow_redirects: bool = False,
    max_redirects: int = 0,
    on_response: Callable[[httpx.Response], Awaitable[None]] | None = None,
) -> httpx.AsyncClient:
    """A pooled client sized for `settings.concurrency` requests in flight; `on_response`
    sees every answer (a redirect included) before it is acted on."""
    limits = httpx.Limits(
        max_connections=settings.concurrency,
        max_keepalive_connections=settings.concurrency,
    )
    # The pool wait is bounded too: callers keep at most `concurrency` requests in
    # flight, so waiting longer than a read timeout for a connection means trouble.
    timeout = httpx.Timeout(
        connect=settings.connect_timeout_s,
        read=settings.read_timeout_s,
        write=settings.read_timeout_s,
        pool=settings.read_timeout_s,
    )
    # identity: sizes and byte ranges must be those of the stored bytes, never of
    # a compressed representation that httpx would silently decode.
    return httpx.AsyncClient(
        limits=limits,
        timeout=timeout,
        follow_redirects=follow_redirects,
        max_redirects=max_redirects,
        event_hooks={"response": [on_response]} if on_response is not None else None,
        headers={"Accept-Encoding": "identity"},
    )


def status_error(status: int, message: str) -> OriginError:
    """The origin error an HTTP status stands for."""
    if status == 404:
        return OriginNotFound(message)
    if status in (401, 403):
        return OriginDenied(message)
    if status in (408, 429) or status >= 500:
        return OriginUnavailable(message)
    return OriginError(message)


def describe(uri: OriginURI, name: str) -> str:
    return f"{uri.key(name)!r} at {uri}"


def raise_for_status(
    response: httpx.Response, what: str, uri: OriginURI, name: str, detail: str = ""
) -> None:
    """Raise the mapped origin error unless the response is a 2xx."""
    if 200 <= response.status_code < 300:
        return
    extra = f": {detail}" if detail else ""
    raise status_error(
        response.status_code, f"{what} {describe(uri, name)} failed: HTTP {response.status_code}{extra}"
    )


@contextmanager
def transport_errors(what: str, uri: OriginURI, name: str) -> Iterator[None]:
    """Turn httpx failures (connection, timeout, protocol) into origin errors."""
    try:
        yield
    except httpx.TransportError as e:
        raise OriginUnavailable(f"{what} {describe(uri, name)} failed: {type(e).__name__}: {e}") from e
    except httpx.HTTPError as e:
        raise OriginError(f"{what} {describe(uri, name)} failed: {type(e).__name__}: {e}") from e


def check_span(start: int, end: int) -> None:
    if start < 0 or end < start:
        raise ValueError(f"invalid byte range [{start}, {end})")


def range_header(start: int, end: int) -> dict[str, str]:
    """The Range header for bytes [start, end) (end > start)."""
    return {"Range": f"bytes={start}-{end - 1}"}


def ranged_body(response: httpx.Response, start: int, end: int, uri: OriginURI, name: str) -> bytes:
    """The body of a ranged GET, exactly bytes [start, end), or OriginError."""
    body = response.content
    where = f"bytes [{start}, {end}) of {describe(uri, name)}"
    if response.status_code == 200:
        # A server that ignores Range sends the whole object: only right when
        # the range asked for was the whole object.
        if start == 0 and len(body) == end:
            return body
        raise OriginError(f"{where}: the server ignored the Range header (HTTP 200, {len(body)} bytes)")
    if response.status_code != 206:
        raise OriginError(f"{where}: unexpected HTTP {response.status_code} to a ranged GET")
    content_range = response.headers.get("Content-Range", "")
    m = _CONTENT_RANGE.match(content_range.strip())
    if not m or int(m.group(1)) != start or int(m.group(2)) != end - 1:
        raise OriginError(f"{where}: the server answered Content-Range {content_range!r}")
    if len(body) != end - start:
        raise OriginError(f"{where}: got {len(body)} bytes")
    return body


def read_span(path: Path, start: int, end: int) -> bytes:
    """Bytes [start, end) of a local file being uploaded (call it in a worker thread)."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    if len(data) != end - start:
        raise OriginError(f"{path} changed while it was uploaded (short read at byte {start})")
    return data


def content_range_total(response: httpx.Response) -> int | None:
    """The object size a Content-Range header states ("bytes a-b/N" or "bytes */N")."""
    value = response.headers.get("Content-Range", "").strip()
    m = _CONTENT_RANGE.match(value)
    if m and m.group(3) != "*":
        return int(m.group(3))
    m = _TOTAL_ONLY.match(value)
    return int(m.group(1)) if m else None


async def retry_transient(settings: WeightSettings, clock: Clock, attempt: Callable[[], Awaitable[T]]) -> T:
    """Run `attempt`, retrying OriginUnavailable with full-jitter exponential backoff on `clock`."""
    backoff = Backoff(settings.retry_base_s, settings.retry_max_s, full=True)
    for n in range(1, settings.max_attempts + 1):
        try:
            return await attempt()
        except OriginUnavailable:
            if n == settings.max_attempts:
                raise
            await clock.sleep(backoff.delay(n))
    raise AssertionError("unreachable")
