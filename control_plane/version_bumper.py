"""The routing version, bumped after the node writes that change what routers see: one bump
transaction at a time per process, shared by every write that committed before it began.

The contract routers rely on: every write they must see is followed by a version bump that
commits after it. A build reads the version first and the rows after (routing_table), so a
table labelled V holds every write committed before bump V; a router at V-1 moves to V and
finds it.

Bumping inside the writer's own transaction (routing_table.bump_version) keeps that contract,
but its UPDATE row-locks routing_state until the writer commits: every such write in the
fleet queues on one row, each for the length of its commit (an fsync) plus whatever delays
its thread. A registration storm on a starved CPU made that queue grow without bound (issue
34: 800 of 10,000 simulated nodes registered, then heartbeats stopped).

So node lifecycle writes (registration, a heartbeat that changes a node's routing fields,
deregistration) commit without touching the version (`mark_changed`), and the writer then
calls `bump`: it waits for a bump transaction that *began after its commit*. One runs at a
time; the writes that commit while it runs are all covered by the next one (group commit), so
a storm costs one version row update per commit round, not one lock wait per write. The
caller's answer (a heartbeat ack's routing version) still names a version that includes its
write. Nothing more is needed across replicas: each bumps after its own writes.

Admin writes and the reaper's and reconciler's passes are rare and keep bumping inside their
transaction; both kinds update the same row, so they mix safely.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from sqlalchemy.orm import Session

# Set on a session whose transaction changed what routers see without bumping the version:
# AppContext.write calls the bumper once the transaction has committed.
CHANGED = "meridian_routing_changed"


def mark_changed(session: Session) -> None:
    """Record that this transaction changed a routing field; the version follows its commit."""
    session.info[CHANGED] = True


class VersionBumper:
    """Single-flight, coalescing version bumps. `bump_once` runs one bump transaction and
    returns the new version (it is called from one thread at a time)."""

    def __init__(self, bump_once: Callable[[], int]) -> None:
        self._bump_once = bump_once
        self._cond = threading.Condition()
        self._requested = 0  # tickets handed out: one per call of bump()
        self._covered = 0  # every ticket up to this one is covered by a committed bump
        self._version = 0  # the version that bump committed
        self._running = False
        self.bumps = 0  # bump transactions run (counted for tests and the scale bench)

    @property
    def version(self) -> int:
        """The version the latest bump committed (0 before the first)."""
        with self._cond:
            return self._version

    def bump(self) -> int:
        """Block until a bump that began after this call has committed; its version.

        Call it after the write's commit. A bump failure is raised to the thread that ran it;
        the threads waiting on it take their turn and try again themselves.
        """
        with self._cond:
            self._requested += 1
            ticket = self._requested
            while self._covered < ticket:
                if not self._running:
                    self._running = True
                    break
                self._cond.wait()
            else:
                return self._version
            covers = self._requested  # every ticket handed out before this bump begins
        try:
            version = self._bump_once()
        except BaseException:
            with self._cond:
                self._running = False
                self._cond.notify_all()
            raise
        with self._cond:
            self._running = False
            self._covered, self._version = covers, version
            self.bumps += 1
            self._cond.notify_all()
        return version
