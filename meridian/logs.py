"""Every process's logs in one format: the control plane, the router, nodes, the local fabric.

`configure_logging()` (called by each component's `serve`) sends every record, uvicorn's
included, to stderr in the format of `MERIDIAN_LOG_FORMAT` (or the config file's `log:`):

- text: `2026-01-01T12:00:00.123Z INFO geo_router.forwarding.forwarder: message key=value …`
- json: one object per line, `{"ts", "level", "logger", "msg", …the record's extra fields}`,
  plus `exc` (the formatted traceback) when the record carries one.

A record's extra fields (`log.info("…", extra={"tenant": "acme"})`) are kept as fields in
both formats, so a line is searchable by them either way.

uvicorn is given `log_config=None` (meridian.http_server.limited_config) so that it keeps
its hands off logging; its loggers propagate to the root handler set up here.

Probes and scrapes are not news: uvicorn's access lines for `/metrics`, `/health*` and
`/ready*` are dropped (`ProbeFilter`). Without it 307 of a node's 315 log lines were the
router's `/metrics` probe; the requests that matter are still logged, and the router logs
its own line per routed request (geo_router.observability.access_log, logger `meridian.access`), which
the stderr handler writes in batches (at most 0.1 s late; `_StderrHandler` says why).
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import sys
import threading
import time
import weakref
from typing import Any, TextIO, cast

from meridian.settings import LogFormat, LogSettings

_NEEDS_QUOTES = re.compile(r'[\s"=]')

# Paths whose access lines are dropped: exact, or a prefix when it ends with "*".
PROBE_PATHS = ("/metrics", "/health*", "/ready*")

# Attributes every LogRecord has: anything else on a record came from `extra=`.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
# uvicorn repeats its message with terminal colours as an extra field.
_STANDARD.add("color_message")


# The formatted second of the last timestamp: a busy router logs thousands of lines a second.
_last_second: tuple[int, str] = (-1, "")


def _timestamp(record: logging.LogRecord) -> str:
    global _last_second
    seconds = int(record.created)
    if _last_second[0] != seconds:
        _last_second = (seconds, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)))
    return f"{_last_second[1]}.{int(record.msecs):03d}Z"


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a record was given with `extra=`, in the order given."""
    fields = record.__dict__.get(_FIELDS)
    if fields is not None:  # a FieldsRecord's, kept as they were given
        return cast(dict[str, Any], fields)
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")}


# Where a FieldsRecord keeps its fields as given, and its batching (private: never fields).
_FIELDS = "_meridian_fields"
_BATCHED = "_meridian_batched"
_START_NS = time.time_ns()


class FieldsRecord(logging.LogRecord):
    """A record of `logger` with fields, built directly: for lines written on every request
    (geo_router.observability.access_log), where `Logger.info(..., extra=...)` costs more than the work
    it logs (a caller lookup walking the stack, the process, thread and module looked up,
    each extra field checked against the standard ones when formatted). It has every
    attribute a LogRecord has, and each field as an attribute, as `extra=` gives them;
    the location fields are empty. Handle it with `logger.handle(record)` after checking
    `logger.isEnabledFor(level)`. `batched`: the stderr handler may hold it back a moment to
    write it with others (lines written on every request)."""

    def __init__(self, logger: str, level: int, msg: str, args: tuple[Any, ...], fields: dict[str, Any],
                 *, batched: bool = False) -> None:
        # No super().__init__: this is what it sets, without the lookups.
        now_ns = time.time_ns()
        self.name, self.msg, self.args = logger, msg, args
        self.levelno, self.levelname = level, logging.getLevelName(level)
        self.pathname = self.filename = self.module = self.funcName = ""
        self.lineno = 0
        self.exc_info = self.exc_text = self.stack_info = None
        self.created = now_ns / 1e9
        self.msecs = (now_ns % 1_000_000_000) // 1_000_000 + 0.0
        self.relativeCreated = (now_ns - _START_NS) / 1e6
        self.thread = self.threadName = self.processName = self.process = None
        self.__dict__.update(fields)
        self.__dict__[_FIELDS] = fields
        if batched:  # may be written with others (_StderrHandler)
            self.__dict__[_BATCHED] = True


class TextFormatter(logging.Formatter):
    """`ts LEVEL logger: message key=value …` (extra fields appended)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        extras = extra_fields(record)
        if extras:
            line += " " + " ".join([f"{k}={_text(v)}" for k, v in extras.items()])
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


# Strings as written (quoted or not), for the values lines repeat: tenant, model, region, node.
_TEXTS: dict[str, str] = {}
_TEXTS_MAX = 4096


def _text(value: Any) -> str:
    if isinstance(value, str):
        text = _TEXTS.get(value)
        if text is None:
            text = _quoted(value)
            if len(_TEXTS) >= _TEXTS_MAX:  # unique values (request ids) must not grow it for ever
                _TEXTS.clear()
            _TEXTS[value] = text
        return text
    if isinstance(value, int | float):  # bool too: the common fields, cheaply
        return str(value)
    return _quoted("" if value is None else str(value))


def _quoted(text: str) -> str:
    # Quoted when it would not read back as one token.
    return json.dumps(text) if (not text or _NEEDS_QUOTES.search(text)) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, the extra fields, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": _timestamp(record), "level": record.levelname, "logger": record.name,
                               "msg": record.getMessage()}
        for key, value in extra_fields(record).items():
            out.setdefault(key, value)
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            # uvicorn's access line as fields too: client, method, path, HTTP version, status.
            out.update(zip(("client", "method", "path", "http_version", "status"), record.args, strict=True))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def is_probe(path: str) -> bool:
    """Whether a request path is a health probe or a metrics scrape."""
    path = path.split("?", 1)[0]
    return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in PROBE_PATHS)


class ProbeFilter(logging.Filter):
    """Drops uvicorn's access lines for probes and scrapes (its args: client, method, path,
    HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str) and is_probe(args[2]))


# The most one write() to a pipe carries without another writer's bytes in between (POSIX).
_ATOMIC_BYTES = getattr(select, "PIPE_BUF", 512)


class _StderrHandler(logging.StreamHandler[TextIO]):
    """Writes to whatever sys.stderr is at the time (a test runner may swap it).

    Batched records (FieldsRecord(..., batched=True): a router's access lines, one per
    request) are written together, at most BATCH_S after the first of them, or sooner when
    BATCH_LINES gathered or any other record is written (which keeps the lines in order), and
    by `flush_logs()` (the router's shutdown). A write to stderr is a system call that cost a
    router more CPU than the rest of the line; the price is that a process killed outright
    loses the last BATCH_S of access lines, never an error or warning.
    """

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self._pending: list[str] = []
        self._flusher: threading.Thread | None = None
        self._closed = threading.Event()
        _HANDLERS.add(self)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _value: TextIO) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:  # called with the handler's lock held
        try:
            line = self.format(record) + self.terminator
            if record.__dict__.get(_BATCHED) and not self._closed.is_set():
                self._pending.append(line)
                if len(self._pending) >= BATCH_LINES:
                    self._write()
                elif self._flusher is None:
                    self._flusher = threading.Thread(target=self._flush_every, name="log-batches", daemon=True)
                    self._flusher.start()
                return
            self._pending.append(line)
            self._write()
        except RecursionError:
            raise
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write()

    def close(self) -> None:
        self._closed.set()
        self.flush()
        super().close()

    def _write(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        stream = self.stream
        # Several processes may share this stderr (the router's workers, a supervisor's
        # pipe to journald): a write of at most PIPE_BUF bytes to a pipe is never mixed with
        # another's, a larger one may be. So lines go out in writes of whole lines of at most
        # PIPE_BUF bytes each (a longer line alone), never cut mid-line.
        chunk: list[str] = []
        size = 0
        for line in pending:
            n = len(line.encode("utf-8", "surrogateescape")) if not line.isascii() else len(line)
            if chunk and size + n > _ATOMIC_BYTES:
                stream.write("".join(chunk))
                stream.flush()
                chunk, size = [], 0
            chunk.append(line)
            size += n
        stream.write("".join(chunk))
        stream.flush()

    def _flush_every(self) -> None:
        while not self._closed.wait(BATCH_S):
            self.flush()


# A forked child has no flusher thread: the next batched line starts one.
_HANDLERS: weakref.WeakSet[_StderrHandler] = weakref.WeakSet()


def _forked() -> None:
    for handler in _HANDLERS:
        handler._flusher = None


os.register_at_fork(after_in_child=_forked)

# Batched lines wait at most this long, and at most this many of them.
BATCH_S = 0.1
BATCH_LINES = 64


def flush_logs() -> None:
    """Write what the root handlers hold back (batched lines) now."""
    for handler in logging.getLogger().handlers:
        handler.flush()


_PROBE_FILTER = ProbeFilter()


def formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt is LogFormat.JSON else TextFormatter()


def configure_logging(settings: LogSettings | None = None) -> None:
    """Set up the process's logging (idempotent): one stderr handler on the root logger in
    the chosen format and level, probe access lines dropped, chatty clients quietened."""
    settings = settings if settings is not None else LogSettings()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(handler)
        handler.close()  # its batched lines written, its flusher stopped
    handler = _StderrHandler()
    handler.setFormatter(formatter(settings.format))
    root.addHandler(handler)
    root.setLevel(settings.level.upper())
    access = logging.getLogger("uvicorn.access")
    if _PROBE_FILTER not in access.filters:
        access.addFilter(_PROBE_FILTER)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        # Whatever a previous uvicorn config did: through the root handler, in our format.
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
        logger.setLevel(logging.NOTSET)
    # Python's warnings too, in the same format instead of bare lines on stderr.
    logging.captureWarnings(True)
    # Health probes and metric scrapes of a vLLM child run every second: not news.
    logging.getLogger("httpx").setLevel(logging.WARNING)
