"""Postgres's CPU per heartbeat renewal: a HOT update (migration 0013) against the schema
before it (0012: `nodes.last_heartbeat` indexed, so every renewal rewrote all four indexes).

Each side gets a fresh database migrated to its revision and a fleet of N registered nodes
(control_plane.node_registry, as registrations write them). Then T threads renew the nodes
in turn with control_plane.node_lease.renew (the fast path's one statement, autocommit)
for `seconds`. The figure is the CPU (user + system, /proc) of that database's backends over
the window, divided by the renewals; the Python side is not counted. The two schemas run one
after the other, alternated over rounds, and the medians compare. Also reported: the share
of renewals Postgres counted as HOT, and how the cost moves from the first window to the
last (dead versions pile up where they cannot be pruned in place).

Autovacuum on the benchmark's server is whatever its configuration says (this project's
test server runs with it off); the figures say which.

    python -m bench.lease_writes [--nodes 10000] [--threads 4] [--seconds 20] [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime

import psycopg
from sqlalchemy import Engine, text

from bench.common import Figure, median
from chaos.scale.stack import cpu_seconds, scratch_database
from control_plane import node_lease, node_registry
from control_plane.db.engine import make_engine
from control_plane.db.migrate import upgrade
from control_plane.db.models import RoutingState
from meridian.contracts import NodeHeartbeat, NodeLoad, NodeRegistration, NodeStatus, RegionInfo

BENCH = "lease_writes"
POSTGRES = os.environ.get("MERIDIAN_BENCH_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres")
OURS, BASELINE = "0013", "0012"
REGION = RegionInfo(name="aws:us-east-1", provider="aws", location="us-east-1", zones=["us"],
                    latitude=38.9, longitude=-77.4)
MODELS = ["tiny-llama"]
WEIGHTS = ["a" * 64]
# Nodes registered (and heartbeating) before the rest of the fleet joins.
FIRST_NODES = 20


@dataclass(frozen=True)
class Measured:
    revision: str
    renewals: int
    cpu_s: float
    hot_share: float
    first_ms: float  # CPU per renewal over the first fifth of the window
    last_ms: float  # and over the last fifth

    @property
    def cpu_ms_per_renewal(self) -> float:
        return self.cpu_s * 1000 / max(self.renewals, 1)


def log(msg: str) -> None:
    print(f"[{BENCH}] {msg}", flush=True)


@contextmanager
def _database(revision: str) -> Iterator[str]:
    """A scratch database (the fleet simulator's) migrated to `revision`."""
    with scratch_database(POSTGRES) as url:
        upgrade(url, revision)
        yield url


def _register(engine: Engine, nodes: list[str]) -> None:
    """The fleet as registrations and first heartbeats leave it (a digest to renew against)."""
    from sqlalchemy.orm import Session

    with Session(engine) as session, session.begin():
        session.merge(RoutingState(id=1, version=1))
        now = datetime.now(UTC)
        for node_id in nodes:
            reg = NodeRegistration(node_id=node_id, region=REGION.name, url=f"http://{node_id}:8000",
                                   models=MODELS, engine="torch", version="bench", status=NodeStatus.READY)
            node_registry.register(session, reg, {REGION.name: REGION}, now)
        session.flush()
        session.execute(text("UPDATE nodes SET report_digest = :d"), {"d": node_lease.report_digest(MODELS, WEIGHTS)})


def _warm(engine: Engine, nodes: list[str], hb: NodeHeartbeat, threads: int) -> None:
    """Every pooled connection renews a few times: psycopg prepares the statement after 5
    executions on a connection, and Postgres picks its generic plan a few executions later."""
    held = [engine.connect() for _ in range(threads)]
    for conn in held:
        conn.close()  # back to the pool: each of the `threads` connections now exists

    def renew_some() -> None:
        for i in range(12):
            node_lease.renew(engine, nodes[i % len(nodes)], hb)

    workers = [threading.Thread(target=renew_some) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _backend_cpu_s(engine: Engine) -> float:
    with engine.connect() as conn:
        pids = conn.execute(text("SELECT pid FROM pg_stat_activity WHERE datname = current_database()")).scalars()
        total = 0.0
        for pid in pids:
            with contextlib.suppress(OSError):  # a backend that ended meanwhile
                total += cpu_seconds(pid)
    return total


def _hot(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        conn.execute(text("SELECT pg_stat_clear_snapshot()"))
        row = conn.execute(text("SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'nodes'")).one()
    return int(row[0]), int(row[1])


def _measure(revision: str, nodes: int, threads: int, seconds: float) -> Measured:
    with _database(revision) as url:
        # One connection per thread, as the control plane's lease pool; the readings on their own.
        engine = make_engine(url, pool_size=threads, max_overflow=0)
        watch = make_engine(url, pool_size=1, max_overflow=0)
        try:
            ids = [f"node-{i:05d}" for i in range(nodes)]
            hb = NodeHeartbeat(status=NodeStatus.READY, models=MODELS, weights=WEIGHTS,
                               load=NodeLoad(running=1, waiting=0, kv_cache_usage=0.5))
            # A fleet coming up: the first nodes heartbeat while the rest register, so each
            # connection prepares the renewal (and Postgres settles its plan) on a small table.
            _register(engine, ids[:FIRST_NODES])
            _warm(engine, ids[:FIRST_NODES], hb, threads)
            _register(engine, ids[FIRST_NODES:])
            done = [0] * threads
            stop = threading.Event()

            def renew(t: int) -> None:
                i = t
                while not stop.is_set():
                    if node_lease.renew(engine, ids[i % nodes], hb) is None:
                        raise RuntimeError(f"{ids[i % nodes]} was not renewed")
                    done[t] += 1
                    i += threads

            workers = [threading.Thread(target=renew, args=(t,), daemon=True) for t in range(threads)]
            upd0, hot0 = _hot(watch)
            cpu0 = _backend_cpu_s(watch)
            for w in workers:
                w.start()
            fifth = seconds / 5
            marks: list[tuple[int, float]] = []
            for _ in range(5):
                time.sleep(fifth)
                marks.append((sum(done), _backend_cpu_s(watch)))
            stop.set()
            for w in workers:
                w.join()
            time.sleep(1.5)  # Postgres flushes a backend's table counts at most once a second
            upd1, hot1 = _hot(watch)
        finally:
            engine.dispose()
            watch.dispose()
    renewals, cpu1 = marks[-1]
    first = marks[0][1] - cpu0, marks[0][0]
    last = marks[-1][1] - marks[-2][1], marks[-1][0] - marks[-2][0]
    return Measured(revision, renewals, cpu1 - cpu0, (hot1 - hot0) / max(upd1 - upd0, 1),
                    first[0] * 1000 / max(first[1], 1), last[0] * 1000 / max(last[1], 1))


def _autovacuum() -> str:
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        row = conn.execute("SHOW autovacuum").fetchone()
    return str(row[0]) if row else "?"


def run(nodes: int = 2000, threads: int = 4, seconds: float = 10.0, rounds: int = 1) -> list[Figure]:
    autovacuum = _autovacuum()
    runs: dict[str, list[Measured]] = {OURS: [], BASELINE: []}
    for r in range(rounds):
        for revision in (BASELINE, OURS) if r % 2 == 0 else (OURS, BASELINE):
            m = _measure(revision, nodes, threads, seconds)
            log(f"round {r + 1} schema {revision}: {m.renewals} renewals, Postgres {m.cpu_ms_per_renewal:.3f} ms CPU "
                f"each (first fifth {m.first_ms:.3f}, last {m.last_ms:.3f}), HOT {m.hot_share:.0%}")
            runs[revision].append(m)
    ours, base = runs[OURS], runs[BASELINE]
    goal = f"{nodes} nodes, {threads} threads, {seconds:g} s, autovacuum {autovacuum}"
    return [
        Figure(BENCH, "postgres_cpu_ms_per_renewal", median([m.cpu_ms_per_renewal for m in ours]),
               median([m.cpu_ms_per_renewal for m in base]), f"schema {BASELINE}", f"lower; {goal}", "ms"),
        Figure(BENCH, "postgres_cpu_ms_per_renewal_last_fifth", median([m.last_ms for m in ours]),
               median([m.last_ms for m in base]), f"schema {BASELINE}", f"flat over the window; {goal}", "ms"),
        Figure(BENCH, "hot_update_share", median([m.hot_share for m in ours]), median([m.hot_share for m in base]),
               f"schema {BASELINE}", "1.0: every renewal a HOT update", "share"),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=10_000)
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for fig in run(args.nodes, args.threads, args.seconds, args.rounds):
        print(fig.json_line(), flush=True)


if __name__ == "__main__":
    main()
