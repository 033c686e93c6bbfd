"""Per-app state of a running control plane: settings, database, region catalog, watchers,
and the one clock every component reads time from (tests pass a ManualClock).

The provider settings say which providers' drivers the reconciler runs; the planner reads the
same ones, so a plan never places a node group no driver here could create."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from control_plane.routing_table import BUMPED
from control_plane.version_watch import VersionWatch
from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import RegionInfo
from meridian.settings import ControlPlaneSettings, ProviderSettings
from providers.catalog import Catalog


@dataclass
class AppContext:
    settings: ControlPlaneSettings
    engine: Engine
    read_sessions: sessionmaker[Session]
    write_sessions: sessionmaker[Session]
    regions: dict[str, RegionInfo]
    watch: VersionWatch
    # GPU offerings of every provider (static data plus the on-prem inventory), loaded at start-up.
    catalog: Catalog
    # The providers whose node-group drivers this control plane runs (MERIDIAN_PROVIDER_ENABLED).
    provider_settings: ProviderSettings
    # Monotonic time for intervals, wall time for records, and the loops' sleeping.
    clock: Clock = SYSTEM_CLOCK

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
        """One transaction, committed at the end or rolled back on error; wakes long-polls
        after a commit that bumped the routing version."""
        with self.write_sessions() as session:
            with session.begin():
                yield session
            if session.info.pop(BUMPED, False):
                self.watch.notify()
