"""Per-app state of a running control plane: settings, database, region catalog, watchers,
and the one clock every component reads time from (tests pass a ManualClock).

The provider settings say which providers' drivers the reconciler runs; the planner reads the
same ones, so a plan never places a node group no driver here could create."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from control_plane.heartbeat_pacing import HeartbeatPacer, PacingPolicy
from control_plane.registration_gate import RegistrationGate
from control_plane.routing_table import BUMPED, bump_version
from control_plane.table_stream import TableStream
from control_plane.version_bumper import CHANGED, VersionBumper
from control_plane.version_watch import VersionWatch
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import RegionInfo
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.providers import ProviderSettings
from providers.catalog import Catalog

# Threads (and, on Postgres, pooled connections) that renew leases: one renewal is one
# statement of ~1 ms, so four take thousands a second, more than the CPU allows anyway.
LEASE_THREADS = 4


@dataclass
class AppContext:
    settings: ControlPlaneSettings
    engine: Engine
    read_sessions: sessionmaker[Session]
    write_sessions: sessionmaker[Session]
    regions: dict[str, RegionInfo]
    watch: VersionWatch
    # The routing tables this process built: the newest (one build per version) and deltas.
    tables: TableStream
    # GPU offerings of every provider (static data plus the on-prem inventory), loaded at start-up.
    catalog: Catalog
    # The providers whose node-group drivers this control plane runs (MERIDIAN_PROVIDER_ENABLED).
    provider_settings: ProviderSettings
    # Monotonic time for intervals, wall time for records, and the loops' sleeping.
    clock: Clock = SYSTEM_CLOCK
    # Lease renewals (control_plane.node_lease) have connections and threads of their own, a
    # bulkhead: a storm of writes that bump the routing version (registrations, drains) queue
    # on that version's row lock and hold the shared pool's connections and the thread pool
    # meanwhile; heartbeats waiting behind them would go silent and be reaped. None: the shared
    # engine (SQLite, one writer at a time whatever the pool).
    lease_engine: Engine | None = None
    # The heartbeat interval handed out by fleet size, and the TTL the reaper holds nodes to.
    pacer: HeartbeatPacer = field(init=False)
    lease_threads: ThreadPoolExecutor = field(init=False)
    # Version bumps after node writes, one transaction at a time (control_plane.version_bumper).
    versions: VersionBumper = field(init=False)
    # Registrations in flight, and when to tell the rest to retry (control_plane.registration_gate).
    registrations: RegistrationGate = field(init=False)

    def __post_init__(self) -> None:
        self.pacer = HeartbeatPacer(PacingPolicy.of(self.settings), self.clock)
        self.lease_threads = ThreadPoolExecutor(LEASE_THREADS, thread_name_prefix="meridian-lease")
        self.versions = VersionBumper(self._bump_once)
        self.registrations = RegistrationGate(self.settings.max_concurrent_registrations, self.clock)

    def _bump_once(self) -> int:
        with self.write_sessions() as session, session.begin():
            return bump_version(session)

    @property
    def leases(self) -> Engine:
        """The engine lease renewals use."""
        return self.lease_engine if self.lease_engine is not None else self.engine

    def close(self) -> None:
        """Release the lease bulkhead (the shared engine is the app's to dispose)."""
        self.lease_threads.shutdown(wait=False, cancel_futures=True)
        if self.lease_engine is not None:
            self.lease_engine.dispose()

    @property
    def enabled_providers(self) -> frozenset[str]:
        """Providers whose node groups this control plane can create: placement plans only these."""
        return frozenset(self.provider_settings.enabled)

    @contextmanager
    def read(self) -> Iterator[Session]:
        """A session for reads; its transaction is rolled back when it closes."""
        with self.read_sessions() as session:
            yield session

    @contextmanager
    def write(self) -> Iterator[Session]:
        """One transaction, committed at the end or rolled back on error. After a commit that
        changed what routers see (version_bumper.mark_changed) it waits for the version bump
        that covers it; after one that changed or bumped, it wakes long-polls."""
        with self.write_sessions() as session:
            with session.begin():
                yield session
            changed = session.info.pop(CHANGED, False)
            if changed:
                self.versions.bump()
            if session.info.pop(BUMPED, False) or changed:
                self.watch.notify()
