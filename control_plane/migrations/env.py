"""Alembic environment: runs from control_plane.db.migrate or `alembic -c <this dir>/alembic.ini`."""

from __future__ import annotations

import logging.config
import os

from alembic import context
from sqlalchemy import Connection, text

from control_plane.db.engine import make_engine, normalise_url
from control_plane.db.models import Base

# Any constant works; it only has to be the same in every control-plane process.
_MIGRATION_LOCK_ID = 0x6D6572696469616E  # "meridian"

config = context.config
if config.config_file_name is not None and config.get_main_option("configure_logging") == "true":
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _database_url() -> str:
    url = config.attributes.get("database_url") or context.get_x_argument(as_dictionary=True).get("url")
    url = url or os.environ.get("MERIDIAN_CP_DATABASE_URL")
    if not url:
        raise RuntimeError("no database URL: pass -x url=... or set MERIDIAN_CP_DATABASE_URL")
    return str(url)


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Several control planes may start at once on one database.
            connection.execute(text("SELECT pg_advisory_xact_lock(:id)"), {"id": _MIGRATION_LOCK_ID})
        context.run_migrations()


def run_migrations_offline() -> None:
    url = normalise_url(_database_url())
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=url.get_backend_name() == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_database_url())
    try:
        with engine.connect() as conn:
            _run(conn)
            conn.commit()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
