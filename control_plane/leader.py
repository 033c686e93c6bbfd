"""Leader election of the control plane's fleet loops (reconciler, autoscaler), with fencing.

Exactly one control plane acts on the fleet at a time:

- **Postgres** (production, several replicas): the leader is the replica holding a
  session-level `pg_try_advisory_lock` on a dedicated connection. The lock lives as long
  as that database session, so a leader that dies (process killed, connection cut)
  releases it and another replica takes it at its next check, within
  `leader_check_interval_s`. No wall clock is involved, so clock skew between replicas
  cannot make two leaders.
- **SQLite** (embedded default): one control plane only. The leader holds a lease row that
  expires `leader_lease_s` after its last renewal; SQLite runs inside the process, so the
  database's clock is the host's.

Either way every acquisition increments `leadership.epoch` and the leader works under that
epoch (its `Fence`). Every write of the reconciler and autoscaler first checks, in its own
transaction, that the epoch is still the row's (`check_fence`; on Postgres under a share
lock, so a new leader's increment waits for that transaction or is seen by it). A leader
deposed without knowing it yet (a stalled process, a cut connection) therefore has its late
writes refused with `Deposed`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal, TypeVar

from sqlalchemy import Connection, Engine, select, text, update
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from control_plane.context import AppContext
from control_plane.db.engine import make_engine
from control_plane.db.models import Leadership
from meridian.backoff import Backoff
from meridian.clock import event_or_timeout

log = logging.getLogger(__name__)

# The leadership row (and lock) of the fleet loops.
FLEET = "fleet"
# Any constant works as long as every control plane uses the same one (not the migration lock's).
ADVISORY_LOCK_KEY = 0x6D72646E6C656164  # "mrdnlead"
# The dedicated connection notices a dead server within ~keepalives_idle + interval × count seconds.
_LOCK_CONNECT_ARGS = {
    "connect_timeout": 5,
    "keepalives": 1,
    "keepalives_idle": 5,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "options": "-c statement_timeout=5000",
}
_CALL_TIMEOUT_S = 5.0

Backend = Literal["postgres-advisory-lock", "sqlite-lease"]
T = TypeVar("T")


class Deposed(Exception):
    """This replica's epoch is no longer the leadership's: another replica leads now."""


@dataclass(frozen=True, slots=True)
class Fence:
    """The leadership a write is made under; `check_fence` refuses it once a newer one exists."""

    name: str
    epoch: int


def check_fence(session: Session, fence: Fence) -> None:
    """Raise Deposed unless `fence` is still the current leadership (call first in a write transaction)."""
    # FOR SHARE on Postgres: a new leader's epoch increment waits for this transaction to end,
    # or this read waits for the increment and sees it. SQLite writers are serialised anyway.
    current = session.scalar(
        select(Leadership.epoch).where(Leadership.name == fence.name).with_for_update(read=True)
    )
    if current != fence.epoch:
        raise Deposed(f"leadership {fence.name!r} is at epoch {current}, this replica holds {fence.epoch}")


def claim(session: Session, name: str, holder: str, now: datetime, expires_at: datetime | None) -> int:
    """Record `holder` as the new leader in the caller's transaction; returns the incremented epoch."""
    row = session.get(Leadership, name, with_for_update=True)
    if row is None:
        row = Leadership(name=name, holder=holder, epoch=0, acquired_at=now, renewed_at=now)
        session.add(row)
    row.epoch += 1
    row.holder = holder
    row.acquired_at = now
    row.renewed_at = now
    row.expires_at = expires_at
    session.flush()
    return row.epoch


def leadership(session: Session, name: str = FLEET) -> Leadership | None:
    """The leadership row as last recorded (None before any control plane led)."""
    return session.get(Leadership, name)


def default_replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class LeaderElector:
    """Campaigns for leadership until stopped; the fleet loops act only while `fence()` is set."""

    backend: Backend

    def __init__(self, ctx: AppContext, name: str = FLEET, holder: str | None = None) -> None:
        self._ctx = ctx
        self._clock = ctx.clock
        self.name = name
        self.holder = holder or ctx.settings.replica_id or default_replica_id()
        self._interval = ctx.settings.leader_check_interval_s
        self._fence: Fence | None = None
        self._since: datetime | None = None
        # Monotonic deadline after which this replica stops acting without a fresh check.
        self._valid_until = 0.0

    @property
    def is_leader(self) -> bool:
        return self.fence() is not None

    @property
    def epoch(self) -> int | None:
        fence = self.fence()
        return fence.epoch if fence else None

    @property
    def since(self) -> datetime | None:
        return self._since if self.is_leader else None

    def fence(self) -> Fence | None:
        """The fence to write under while this replica leads, else None."""
        if self._fence is None or self._clock.monotonic() >= self._valid_until:
            return None
        return self._fence

    async def run(self, stop: asyncio.Event) -> None:
        """Acquire and keep leadership until `stop` is set; errors step down and are retried."""
        backoff = Backoff(base_s=self._interval, max_s=max(self._interval, 30.0))
        failures = 0
        try:
            while not stop.is_set():
                try:
                    if self._fence is None:
                        await self._acquire()
                    else:
                        await self._keep()
                    failures = 0
                except Exception as e:
                    failures += 1
                    if self._fence is not None:
                        log.warning("leadership %s lost (%s: %s)", self.name, type(e).__name__, e)
                    else:
                        log.warning("leader election failed (%s: %s); retrying", type(e).__name__, e)
                    self._step_down()
                    with contextlib.suppress(Exception):
                        await self._call(self._reset)
                delay = self._interval if failures == 0 else backoff.delay(failures)
                await event_or_timeout(self._clock, stop, delay)
        finally:
            was_leader = self._fence is not None
            fence = self._fence
            self._step_down()
            with contextlib.suppress(Exception):
                await self._call(lambda: self._release(fence))
            if was_leader:
                log.info("leadership %s released", self.name)

    async def _acquire(self) -> None:
        started = self._clock.monotonic()
        epoch = await self._call(self._try_acquire)
        if epoch is None:
            return
        self._fence = Fence(self.name, epoch)
        self._since = self._clock.now()
        self._valid_until = started + self._validity_s()
        log.info("this replica (%s) leads %s at epoch %d [%s]", self.holder, self.name, epoch, self.backend)

    async def _keep(self) -> None:
        fence = self._fence
        assert fence is not None
        started = self._clock.monotonic()
        if await self._call(lambda: self._check(fence)):
            self._valid_until = started + self._validity_s()
            return
        log.warning("leadership %s at epoch %d was taken over; stepping down", self.name, fence.epoch)
        self._step_down()

    def _step_down(self) -> None:
        self._fence = None
        self._since = None
        self._valid_until = 0.0

    async def _call(self, fn: Callable[[], T]) -> T:
        # The thread cannot be cancelled; on timeout it finishes alone and its result is dropped.
        return await asyncio.wait_for(asyncio.to_thread(fn), _CALL_TIMEOUT_S)

    # --- backend hooks (blocking; run in a worker thread) -----------------------------

    def _validity_s(self) -> float:
        raise NotImplementedError

    def _try_acquire(self) -> int | None:
        """Become leader if no one else is: the new epoch, or None."""
        raise NotImplementedError

    def _check(self, fence: Fence) -> bool:
        """Whether this replica still leads under `fence`."""
        raise NotImplementedError

    def _reset(self) -> None:
        """Forget backend state after an error (drop the lock connection)."""

    def _release(self, fence: Fence | None) -> None:
        """Give leadership up on shutdown so another replica need not wait."""


class PostgresLeaderElector(LeaderElector):
    """Leadership = a session-level advisory lock held on a connection of its own."""

    backend: Backend = "postgres-advisory-lock"

    def __init__(self, ctx: AppContext, name: str = FLEET, holder: str | None = None) -> None:
        super().__init__(ctx, name, holder)
        self._lock_engine: Engine = make_engine(
            ctx.settings.database_url, poolclass=NullPool, connect_args=_LOCK_CONNECT_ARGS
        )
        self._conn: Connection | None = None

    def _validity_s(self) -> float:
        # The lock needs no renewal; a leader that cannot check for this long stops acting.
        return max(3 * self._interval, _CALL_TIMEOUT_S) + _CALL_TIMEOUT_S

    def _connection(self) -> Connection:
        if self._conn is None:
            # Autocommit: the session holds the lock, never an idle open transaction.
            self._conn = self._lock_engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return self._conn

    def _try_acquire(self) -> int | None:
        conn = self._connection()
        if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": ADVISORY_LOCK_KEY}).scalar():
            return None
        try:
            with self._ctx.write() as session:
                return claim(session, self.name, self.holder, self._clock.now(), None)
        except Exception:
            self._reset()
            raise

    def _check(self, fence: Fence) -> bool:
        held = self._connection().execute(
            text(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND pid = pg_backend_pid() AND objsubid = 1"
                " AND ((classid::bigint << 32) | objid::bigint) = :k"
            ),
            {"k": ADVISORY_LOCK_KEY},
        ).scalar()
        if not held:
            return False
        with self._ctx.write() as session:
            renewed = session.execute(
                update(Leadership)
                .where(Leadership.name == fence.name, Leadership.epoch == fence.epoch)
                .values(renewed_at=self._clock.now())
                .execution_options(synchronize_session=False)
            )
            return bool(renewed.rowcount)

    def _reset(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            # Closing the session releases the lock on the server.
            with contextlib.suppress(Exception):
                conn.invalidate()
            with contextlib.suppress(Exception):
                conn.close()

    def _release(self, fence: Fence | None) -> None:
        # Ending the session releases the lock; the next replica's check takes it.
        self._reset()
        self._lock_engine.dispose()


class SqliteLeaderElector(LeaderElector):
    """Leadership = a lease row renewed every check; for the embedded, single-replica control plane."""

    backend: Backend = "sqlite-lease"

    def _validity_s(self) -> float:
        return self._ctx.settings.leader_lease_s

    def _lease(self, now: datetime) -> datetime:
        return now + timedelta(seconds=self._ctx.settings.leader_lease_s)

    def _try_acquire(self) -> int | None:
        now = self._clock.now()
        # BEGIN IMMEDIATE: two processes on one file cannot both see the lease free.
        with self._ctx.write() as session:
            row = leadership(session, self.name)
            if row is not None and row.holder != self.holder and row.expires_at is not None and row.expires_at > now:
                return None
            return claim(session, self.name, self.holder, now, self._lease(now))

    def _check(self, fence: Fence) -> bool:
        now = self._clock.now()
        with self._ctx.write() as session:
            row = leadership(session, self.name)
            if row is None or row.epoch != fence.epoch or row.holder != self.holder:
                return False
            row.renewed_at = now
            row.expires_at = self._lease(now)
            return True

    def _release(self, fence: Fence | None) -> None:
        if fence is None:
            return
        with self._ctx.write() as session:
            row = leadership(session, self.name)
            if row is not None and row.epoch == fence.epoch and row.holder == self.holder:
                row.expires_at = self._clock.now()


def make_elector(ctx: AppContext, name: str = FLEET, holder: str | None = None) -> LeaderElector:
    """The elector that suits the control plane's database."""
    if ctx.engine.dialect.name == "postgresql":
        return PostgresLeaderElector(ctx, name, holder)
    return SqliteLeaderElector(ctx, name, holder)
