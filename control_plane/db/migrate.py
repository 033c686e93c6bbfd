"""Apply the control plane's Alembic migrations programmatically (no alembic.ini needed).

`python -m control_plane.db.migrate upgrade [REV] --url URL` does the same from a shell;
the URL defaults to MERIDIAN_CP_DATABASE_URL.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext

from control_plane.db.engine import make_engine

MIGRATIONS_DIR = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    """An Alembic configuration pointing at the packaged migrations and this database."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    # Kept out of the ini options: configparser would interpolate '%' in passwords.
    cfg.attributes["database_url"] = url
    return cfg


def upgrade(url: str, rev: str = "head") -> None:
    """Migrate the database up to `rev`."""
    command.upgrade(alembic_config(url), rev)


def downgrade(url: str, rev: str = "base") -> None:
    """Migrate the database down to `rev`."""
    command.downgrade(alembic_config(url), rev)


def current(url: str) -> str | None:
    """The revision the database is at, None when it was never migrated."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m control_plane.db.migrate")
    parser.add_argument("action", choices=["upgrade", "downgrade", "current"])
    parser.add_argument("rev", nargs="?")
    parser.add_argument("--url", default=os.environ.get("MERIDIAN_CP_DATABASE_URL"))
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("--url or MERIDIAN_CP_DATABASE_URL is required")
    if args.action == "upgrade":
        upgrade(args.url, args.rev or "head")
    elif args.action == "downgrade":
        downgrade(args.url, args.rev or "base")
    print(current(args.url) or "base")


if __name__ == "__main__":
    main()
