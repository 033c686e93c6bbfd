"""One clock for liveness: the database's.

Heartbeats are stamped by whichever control-plane replica receives them and expired by the
reaper of every replica. With each replica reading its own host's clock, one replica a
minute ahead expires every healthy node (and one behind keeps dead ones) as soon as it
compares its "now" with a heartbeat another replica stamped. Postgres's clock is the same
for all of them. SQLite serves a single replica in the same process, so the host's clock
is already the only one.
"""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session


def db_now(session: Session) -> datetime:
    """The current time by the database server's clock (aware, UTC)."""
    if session.get_bind().dialect.name == "postgresql":
        # clock_timestamp(), not now(): the latter is the transaction's start, and a
        # heartbeat's transaction may have waited on a row lock.
        value = session.scalar(select(func.clock_timestamp()))
        if value is not None:
            return value.astimezone(UTC)
    return datetime.now(UTC)
