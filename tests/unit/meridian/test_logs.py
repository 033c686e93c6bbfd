"""One log format for every component (text or JSON lines), and no access lines for
probes and scrapes, checked through a real uvicorn listener."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from router_harness import ServerGroup

from meridian.http_server import limited_config
from meridian.logs import configure_logging, is_probe
from meridian.settings import ListenerSettings, LogFormat, LogSettings


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_text_lines_carry_time_level_logger_message_and_extra_fields(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format=LogFormat.TEXT, level="INFO"))
    logging.getLogger("meridian.test").info("node %s up", "n1", extra={"region": "aws:us-east-1", "note": "a b"})
    logging.getLogger("meridian.test").debug("not at INFO")
    [line] = lines(capsys.readouterr().err)
    ts, level, rest = line.split(" ", 2)
    assert ts.endswith("Z") and "T" in ts and level == "INFO"
    assert rest == 'meridian.test: node n1 up region=aws:us-east-1 note="a b"'


def test_json_lines_are_one_object_each_with_the_extra_fields(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format=LogFormat.JSON, level="debug"))
    log = logging.getLogger("meridian.test")
    log.debug("d", extra={"tenant": "acme", "status": 200})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    first, second = (json.loads(line) for line in lines(capsys.readouterr().err))
    assert first["level"] == "DEBUG" and first["logger"] == "meridian.test" and first["msg"] == "d"
    assert first["tenant"] == "acme" and first["status"] == 200 and first["ts"].endswith("Z")
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc"]


def test_configuring_twice_leaves_one_handler(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format=LogFormat.TEXT))
    configure_logging(LogSettings(format=LogFormat.JSON))
    logging.getLogger("meridian.test").warning("once")
    [line] = lines(capsys.readouterr().err)
    assert json.loads(line)["msg"] == "once"


@pytest.mark.parametrize(("path", "probe"), [
    ("/metrics", True), ("/health", True), ("/health/live", True), ("/ready", True), ("/readyz?x=1", True),
    ("/v1/chat/completions", False), ("/metrics-export", False), ("/v1/models", False),
])
def test_probe_paths(path: str, probe: bool) -> None:
    assert is_probe(path) is probe


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("up 1\n")

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("ok")

    @app.post("/v1/chat/completions")
    async def chat() -> PlainTextResponse:
        return PlainTextResponse("{}")

    return app


@contextlib.asynccontextmanager
async def _client() -> AsyncIterator[httpx.AsyncClient]:
    """A client of `_app()` served on a real listener (meridian.http_server)."""
    app, servers = _app(), ServerGroup()
    try:
        url = await servers.start(app, config=limited_config(app, ListenerSettings(), lifespan="on",
                                                             timeout_graceful_shutdown=2))
        async with httpx.AsyncClient(base_url=url) as client:
            yield client
    finally:
        await servers.stop()


async def test_a_scrape_is_not_logged_an_inference_request_is(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(LogSettings(format=LogFormat.JSON))
    async with _client() as client:
        for _ in range(3):
            assert (await client.get("/metrics")).status_code == 200
            assert (await client.get("/health")).status_code == 200
        assert (await client.post("/v1/chat/completions")).status_code == 200
    access = [json.loads(line) for line in lines(capsys.readouterr().err)]
    access = [a for a in access if a["logger"] == "uvicorn.access"]
    assert len(access) == 1 and "POST /v1/chat/completions" in access[0]["msg"]
    assert (access[0]["method"], access[0]["path"], access[0]["status"]) == ("POST", "/v1/chat/completions", 200)


async def test_an_access_line_carries_the_requests_sane_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    # A node's line joins the router's on request_id (the router sends x-request-id); an id
    # that is not a plain token (spaces, quotes, too long) is left out, not logged.
    configure_logging(LogSettings(format=LogFormat.TEXT))
    async with _client() as client:
        for request_id in ("req-7f3a:1", 'a" b=c', "x" * 129, None):
            headers = {"x-request-id": request_id} if request_id else {}
            assert (await client.post("/v1/chat/completions", headers=headers)).status_code == 200
    access = [line for line in lines(capsys.readouterr().err) if "uvicorn.access" in line]
    assert len(access) == 4
    assert access[0].endswith('"POST /v1/chat/completions HTTP/1.1" 200 request_id=req-7f3a:1')
    assert not any("request_id" in line for line in access[1:])


class _Writes:
    """A stderr that keeps each write() between flushes as the system call it becomes."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._buffer = ""

    def write(self, text: str) -> int:
        self._buffer += text
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            self.calls.append(self._buffer)
            self._buffer = ""


def test_batched_lines_reach_a_shared_stderr_in_whole_lines_of_at_most_pipe_buf(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A router's workers share one stderr (a pipe, often): a write longer than PIPE_BUF may be
    interleaved with another process's, so a batch goes out in writes of whole lines that fit."""
    import select

    from meridian.logs import BATCH_LINES, FieldsRecord, flush_logs

    stderr = _Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    configure_logging(LogSettings(format=LogFormat.JSON))
    logger = logging.getLogger("meridian.access")
    lines = BATCH_LINES * 3
    for n in range(lines):
        logger.handle(FieldsRecord("meridian.access", logging.INFO, "/v1/chat/completions %s", (n,),
                                   {"request_id": f"{n:032x}", "tenant": "é" * 40, "pad": "x" * 200}, batched=True))
    flush_logs()
    assert stderr.calls and all(len(c.encode()) <= select.PIPE_BUF and c.endswith("\n") for c in stderr.calls)
    records = [json.loads(line) for call in stderr.calls for line in call.splitlines()]
    assert [r["request_id"] for r in records] == [f"{n:032x}" for n in range(lines)]
    assert len(stderr.calls) < lines  # still batched: several lines a write
