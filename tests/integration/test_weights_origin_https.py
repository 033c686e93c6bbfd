"""http(s):// origin against real web servers: nginx (HEAD, Range, 404, access log),
a server that refuses HEAD, and one that ignores Range."""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from bench.nginx import NginxServer
from data_plane.weights.origins import (
    OriginError,
    OriginNotFound,
    OriginReadOnly,
    open_origin,
)
from data_plane.weights.origins.http import HttpOrigin, redirect_refusal
from meridian.settings.node import WeightSettings


@pytest.fixture
def served(tmp_path: Path, nginx_server: Callable[..., NginxServer]) -> tuple[Path, NginxServer]:
    root = tmp_path / "www"
    (root / "models" / "tiny").mkdir(parents=True)
    return root, nginx_server(root)


async def test_size_by_head_and_one_ranged_get_per_range(served: tuple[Path, NginxServer]) -> None:
    root, nginx = served
    data = os.urandom(10_000)
    (root / "models" / "tiny" / "model.safetensors").write_bytes(data)
    origin = open_origin(f"{nginx.url}/models/tiny", WeightSettings())
    assert isinstance(origin, HttpOrigin)
    try:
        assert await origin.size("model.safetensors") == 10_000
        assert await origin.read_range("model.safetensors", 4096, 8192) == data[4096:8192]
        assert await origin.read_range("model.safetensors", 8192, 10_000) == data[8192:]
        assert await origin.read("model.safetensors") == data
    finally:
        await origin.aclose()
    logged = nginx.wait_for_records(4)
    records = [(r.method, r.path, r.status, r.range_start, r.range_end, r.body_bytes_sent) for r in logged]
    path = "/models/tiny/model.safetensors"
    assert records == [
        ("HEAD", path, 200, None, None, 0),
        ("GET", path, 206, 4096, 8192, 4096),
        ("GET", path, 206, 8192, 10_000, 1808),
        ("GET", path, 200, None, None, 10_000),
    ]
    # One pooled keep-alive connection served them all, and nothing is still in flight.
    assert len({r.connection for r in logged}) == 1
    assert nginx.wait_idle() == logged


async def test_missing_files_are_not_found(served: tuple[Path, NginxServer]) -> None:
    _, nginx = served
    origin = open_origin(f"{nginx.url}/models/tiny", WeightSettings())
    try:
        with pytest.raises(OriginNotFound, match="absent.bin"):
            await origin.size("absent.bin")
        with pytest.raises(OriginNotFound):
            await origin.read("absent.bin")
        with pytest.raises(OriginNotFound):
            await origin.read_range("absent.bin", 0, 10)
    finally:
        await origin.aclose()


async def test_ranges_beyond_the_file_are_errors(served: tuple[Path, NginxServer]) -> None:
    root, nginx = served
    (root / "small.bin").write_bytes(b"0123456789")
    origin = open_origin(nginx.url, WeightSettings())
    try:
        with pytest.raises(OriginError, match="Content-Range"):
            await origin.read_range("small.bin", 5, 20)
        with pytest.raises(OriginError, match="416"):
            await origin.read_range("small.bin", 50, 60)
    finally:
        await origin.aclose()


async def test_names_are_url_encoded_and_empty_files_have_size_zero(served: tuple[Path, NginxServer]) -> None:
    root, nginx = served
    (root / "models" / "tiny" / "with space+plus.json").write_bytes(b"{}")
    (root / "models" / "tiny" / "empty.txt").write_bytes(b"")
    origin = open_origin(f"{nginx.url}/models/tiny", WeightSettings())
    try:
        assert await origin.read("with space+plus.json") == b"{}"
        assert await origin.size("empty.txt") == 0
        assert await origin.read_range("empty.txt", 0, 0) == b""
    finally:
        await origin.aclose()


async def test_https_origins_are_read_only(served: tuple[Path, NginxServer], tmp_path: Path) -> None:
    _, nginx = served
    origin = open_origin(nginx.url, WeightSettings())
    source = tmp_path / "x.bin"
    source.write_bytes(b"x")
    try:
        with pytest.raises(OriginReadOnly):
            await origin.write("x.bin", source)
        with pytest.raises(OriginReadOnly):
            await origin.write_bytes("meridian-manifest.json", b"{}")
    finally:
        await origin.aclose()


async def test_size_falls_back_to_a_ranged_get_when_head_is_refused(
    gcs_bucket: str, gcs_emulator: str
) -> None:
    # The GCS emulator's public download URLs honour Range but answer HEAD with 501.
    gs = open_origin(f"gs://{gcs_bucket}/m", WeightSettings())
    await gs.write_bytes("weights.bin", b"0123456789abcdef")
    await gs.aclose()
    origin = open_origin(f"{gcs_emulator}/{gcs_bucket}/m", WeightSettings())
    try:
        assert await origin.size("weights.bin") == 16
        assert await origin.read_range("weights.bin", 10, 16) == b"abcdef"
    finally:
        await origin.aclose()


@contextlib.contextmanager
def _serving(root: Path, handler: type[SimpleHTTPRequestHandler]) -> Iterator[str]:
    """A real threaded http.server with `handler` over `root`; yields its URL."""
    root.mkdir()
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def no_range_server(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """Python's http.server: a real server that ignores Range and always answers 200."""
    with _serving(tmp_path / "plain", SimpleHTTPRequestHandler) as url:
        yield tmp_path / "plain", url


async def test_a_server_that_ignores_range_only_serves_whole_object_ranges(
    no_range_server: tuple[Path, str],
) -> None:
    root, url = no_range_server
    (root / "weights.bin").write_bytes(b"0123456789")
    origin = open_origin(url, WeightSettings())
    try:
        assert await origin.size("weights.bin") == 10
        assert await origin.read_range("weights.bin", 0, 10) == b"0123456789"
        with pytest.raises(OriginError, match="ignored the Range header"):
            await origin.read_range("weights.bin", 2, 5)
    finally:
        await origin.aclose()


class _Redirector(SimpleHTTPRequestHandler):
    """Serves its directory, and redirects /go?<url-path-and-target> as told."""

    def do_GET(self) -> None:
        if self.path.startswith("/go/"):
            self.send_response(302)
            self.send_header("Location", self.path.removeprefix("/go/").replace("__", "://", 1))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()

    do_HEAD = do_GET

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def redirector(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    with _serving(tmp_path / "redir", _Redirector) as url:
        yield tmp_path / "redir", url


async def test_redirects_are_followed_only_where_a_node_may_go(redirector: tuple[Path, str]) -> None:
    """Issue 18: redirects were followed anywhere, plain http and internal addresses included."""
    root, url = redirector
    (root / "weights.bin").write_bytes(b"0123456789")
    origin = open_origin(url, WeightSettings())
    try:
        # On the origin's own host: followed (a hub's path rewrite).
        assert await origin.read("go//weights.bin") == b"0123456789"
        # Elsewhere on the node's own network, or to plain http: never.
        for target in ("http__169.254.169.254/latest/meta-data/iam/", "https__169.254.169.254/x",
                       "https__127.0.0.2/weights.bin", "https__10.0.0.7/weights.bin", "http__example.com/w"):
            with pytest.raises(OriginError, match="not following the redirect"):
                await origin.read(f"go/{target}")
    finally:
        await origin.aclose()


@pytest.mark.parametrize(("origin", "target", "addresses", "refused"), [
    ("https://hub.example/", "https://cdn.example/f", ["93.184.216.34"], None),
    ("https://hub.example/", "http://cdn.example/f", ["93.184.216.34"], "leaves https"),
    ("https://hub.example/", "http://hub.example/f", [], "leaves https"),
    ("http://10.0.0.5/", "http://10.0.0.5/other", [], None),
    ("https://hub.example/", "https://cdn.example/f", ["93.184.216.34", "10.1.2.3"], "non-public"),
    ("https://hub.example/", "https://cdn.example/f", ["::1"], "non-public"),
    ("https://hub.example/", "https://cdn.example/f", ["fe80::1%eth0"], "non-public"),
])
def test_the_redirect_policy(origin: str, target: str, addresses: list[str], refused: str | None) -> None:
    why = redirect_refusal(httpx.URL(origin), httpx.URL(target), addresses)
    assert (why is None) if refused is None else (why is not None and refused in why)
