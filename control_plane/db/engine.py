"""Engine and session factories for SQLite (embedded default) and Postgres (psycopg 3)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_MS = 5000
# Execution option read by the SQLite "begin" hook: writers take the write lock up front.
_SQLITE_BEGIN = "meridian_sqlite_begin"


def normalise_url(url: str | URL) -> URL:
    """Parse a database URL; plain postgres URLs are pointed at psycopg 3."""
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def make_engine(url: str | URL, **kwargs: Any) -> Engine:
    """Create an engine with the connection settings Meridian relies on."""
    parsed = normalise_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(parsed, connect_args={"check_same_thread": False}, **kwargs)
        _configure_sqlite(engine)
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(parsed, **kwargs)


def _configure_sqlite(engine: Engine) -> None:
    # pysqlite's own transaction handling defers BEGIN and cannot do BEGIN IMMEDIATE;
    # SQLAlchemy's documented recipe takes it over. A deferred transaction that later
    # writes can fail with SQLITE_BUSY without waiting, so writers begin IMMEDIATE.
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        mode = connection.get_execution_options().get(_SQLITE_BEGIN, "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")


def make_sessionmakers(engine: Engine) -> tuple[sessionmaker[Session], sessionmaker[Session]]:
    """Session factories for reads and for writes (writes lock SQLite at BEGIN)."""
    reads = sessionmaker(bind=engine, expire_on_commit=False)
    writes = sessionmaker(
        bind=engine.execution_options(**{_SQLITE_BEGIN: "IMMEDIATE"}), expire_on_commit=False
    )
    return reads, writes
