"""Alembic migrations go up and down cleanly and match the models, on SQLite and Postgres."""

from __future__ import annotations

from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from control_plane.db import migrate
from control_plane.db.engine import make_engine
from control_plane.db.models import Base

TABLES = {
    "nodes", "api_keys", "routing_state", "deployments", "weight_replicas",
    "models", "capacity", "placement_plans", "tenants", "audit_log",
    "leadership", "node_groups", "node_drains", "reconcile_steps", "autoscaler_decisions",
}
HEAD = "0013"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'migrations.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


def _tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_then_downgrade_round_trips(database_url: str) -> None:
    assert migrate.current(database_url) is None

    migrate.upgrade(database_url)
    assert migrate.current(database_url) == HEAD
    assert _tables(database_url) == TABLES

    # Running it again (every start-up does) is a no-op.
    migrate.upgrade(database_url)
    assert migrate.current(database_url) == HEAD

    migrate.downgrade(database_url)
    assert migrate.current(database_url) is None
    assert _tables(database_url) == set()

    migrate.upgrade(database_url, "head")
    assert _tables(database_url) == TABLES


def test_migrations_match_the_models(database_url: str) -> None:
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
            rows = conn.execute(sa.text("SELECT id, version FROM routing_state")).all()
            assert [tuple(r) for r in rows] == [(1, 0)]
    finally:
        engine.dispose()


def test_keys_made_before_tenants_existed_get_their_tenant(database_url: str) -> None:
    migrate.upgrade(database_url, "0003")
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            for i, (tenant, zone, at) in enumerate(
                [("acme", "eu", "2026-01-01"), ("acme", "eu", "2026-02-01"), ("globex", "us", "2026-01-05")]
            ):
                conn.execute(
                    sa.text(
                        "INSERT INTO api_keys (id, name, tenant, zone, scopes, models, key_hash, key_prefix,"
                        " created_at) VALUES (:id, 'k', :tenant, :zone, '[\"inference\"]', NULL, :hash, 'mrd_x',"
                        " :at)"
                    ),
                    {"id": f"k{i}", "tenant": tenant, "zone": zone, "hash": f"{i:064x}", "at": f"{at} 00:00:00+00:00"},
                )
        migrate.upgrade(database_url)
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT name, zone FROM tenants ORDER BY name")).all()
        assert [tuple(r) for r in rows] == [("acme", "eu"), ("globex", "us")]
    finally:
        engine.dispose()


def _insert_group(conn: sa.Connection, group_id: str, role: str | None = None) -> None:
    role_column, role_value = (", role", ", :role") if role is not None else ("", "")
    conn.execute(
        sa.text(
            f"INSERT INTO node_groups (id, model, provider, region, instance_type, sku, spot{role_column},"
            " gpus_per_node, desired_size, current_size, nodes, state, failures, resource_version, created_at,"
            f" updated_at) VALUES (:id, 'm', 'onprem', 'onprem:lab-1', 'l4-box', 'L4-24GB', false{role_value},"
            " 1, 1, 0, '[]', 'ready', 0, 1, '2026-01-01 00:00:00+00:00', '2026-01-01 00:00:00+00:00')"
        ),
        {"id": group_id, "role": role},
    )


def test_node_groups_made_before_roles_are_co_located_and_pools_are_groups_of_their_own(database_url: str) -> None:
    migrate.upgrade(database_url, "0010")
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            _insert_group(conn, "old")
        migrate.upgrade(database_url)
        with engine.begin() as conn:
            assert conn.execute(sa.text("SELECT role FROM node_groups WHERE id = 'old'")).scalar_one() == "both"
            # The same model, place and machine in another role is another group ...
            _insert_group(conn, "pre", "prefill")
            _insert_group(conn, "dec", "decode")
        # ... but one role still has one group there.
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            _insert_group(conn, "dec2", "decode")
        # Going back keeps the co-located group, the one row the older key allows.
        migrate.downgrade(database_url, "0010")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT id FROM node_groups")).scalars().all() == ["old"]
    finally:
        engine.dispose()
