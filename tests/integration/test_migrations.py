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
    "router_backlogs",
}
HEAD = "0018"


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


def _insert_key(conn: sa.Connection, key_id: str, tenant: str, zone: str, scopes: str = '["inference"]',
                revoked: bool = False) -> None:
    conn.execute(
        sa.text(
            "INSERT INTO api_keys (id, name, tenant, zone, scopes, models, key_hash, key_prefix, created_at,"
            " revoked_at) VALUES (:id, 'k', :tenant, :zone, :scopes, NULL, :hash, 'mrd_x',"
            " '2026-03-01 00:00:00+00:00', :revoked)"
        ),
        {"id": key_id, "tenant": tenant, "zone": zone, "scopes": scopes, "hash": key_id.encode().hex().ljust(64, "0"),
         "revoked": "2026-04-01 00:00:00+00:00" if revoked else None},
    )


def _insert_tenant(conn: sa.Connection, name: str, zone: str) -> None:
    conn.execute(
        sa.text("INSERT INTO tenants (name, zone, models, resource_version, created_at, updated_at)"
                " VALUES (:name, :zone, NULL, 1, '2026-01-01 00:00:00+00:00', '2026-01-01 00:00:00+00:00')"),
        {"name": name, "zone": zone},
    )


def _columns(url: str, table: str) -> set[str]:
    engine = make_engine(url)
    try:
        return {c["name"] for c in sa.inspect(engine).get_columns(table)}
    finally:
        engine.dispose()


def test_a_tenants_zone_moves_off_its_keys_without_losing_one(database_url: str) -> None:
    """0014: the zone is the tenant's alone. A tenant without a row whose keys serve inference
    (or are zoned) gets one in their zone; the bootstrap operator's global admin key does not
    make one; a revoked key in another zone does not stop it."""
    migrate.upgrade(database_url, "0013")
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            _insert_tenant(conn, "acme", "eu")
            _insert_key(conn, "a1", "acme", "eu")
            _insert_key(conn, "a2", "acme", "us", revoked=True)  # revoked: it serves nothing
            _insert_key(conn, "o1", "orphan", "apac")  # a tenant with keys and no row
            _insert_key(conn, "g1", "ops", "global", scopes='["operator"]')
            _insert_key(conn, "b1", "meridian", "global", scopes='["admin"]')
        migrate.upgrade(database_url)
        assert "zone" not in _columns(database_url, "api_keys")
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT name, zone FROM tenants ORDER BY name")).all()
        assert [tuple(r) for r in rows] == [("acme", "eu"), ("orphan", "apac")]

        # Back down: each key in its tenant's zone, global where its tenant has no row.
        migrate.downgrade(database_url, "0013")
        with engine.connect() as conn:
            keys = dict(conn.execute(sa.text("SELECT id, zone FROM api_keys")).all())  # type: ignore[arg-type]
        assert keys == {"a1": "eu", "a2": "eu", "o1": "apac", "g1": "global", "b1": "global"}
    finally:
        engine.dispose()


@pytest.mark.parametrize("stray", ["key in another zone", "tenantless keys in two zones"])
def test_a_key_whose_zone_contradicts_its_tenants_stops_the_upgrade_and_changes_nothing(
    database_url: str, stray: str
) -> None:
    migrate.upgrade(database_url, "0013")
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            if stray == "key in another zone":
                _insert_tenant(conn, "acme", "eu")
                _insert_key(conn, "a1", "acme", "eu")
                _insert_key(conn, "a2", "acme", "us")
            else:
                _insert_key(conn, "o1", "orphan", "eu")
                _insert_key(conn, "o2", "orphan", "us")
        with pytest.raises(RuntimeError, match="acme|orphan"):
            migrate.upgrade(database_url)
        assert migrate.current(database_url) == "0013"
        assert "zone" in _columns(database_url, "api_keys")
        with engine.connect() as conn:
            zones = sorted(conn.execute(sa.text("SELECT zone FROM api_keys")).scalars())
            tenants = conn.execute(sa.text("SELECT name FROM tenants")).scalars().all()
        assert zones == ["eu", "us"] and tenants == (["acme"] if stray == "key in another zone" else [])
    finally:
        engine.dispose()


def test_tenants_get_the_default_band_and_weight_and_keys_their_tenants(database_url: str) -> None:
    """0017: existing tenants are at band 0 with weight 1 (as everyone was), keys follow their
    tenant's band; a control plane that writes neither column (the previous version, during a
    rolling upgrade) still inserts tenants; down again, the columns go and the rows stay."""
    migrate.upgrade(database_url, "0016")
    engine = make_engine(database_url)
    try:
        with engine.begin() as conn:
            _insert_tenant(conn, "acme", "eu")
            conn.execute(sa.text(
                "INSERT INTO api_keys (id, name, tenant, scopes, models, key_hash, key_prefix, created_at)"
                " VALUES ('a1', 'k', 'acme', '[\"inference\"]', NULL, :hash, 'mrd_x', '2026-03-01 00:00:00+00:00')"
            ), {"hash": "a" * 64})
        migrate.upgrade(database_url)
        with engine.begin() as conn:
            _insert_tenant(conn, "globex", "us")  # as the previous version writes a tenant
            rows = conn.execute(sa.text("SELECT name, priority, weight FROM tenants ORDER BY name")).all()
            assert [tuple(r) for r in rows] == [("acme", 0, 1.0), ("globex", 0, 1.0)]
            assert conn.execute(sa.text("SELECT priority FROM api_keys")).scalars().all() == [None]
            conn.execute(sa.text("UPDATE api_keys SET priority = -5"))
        migrate.downgrade(database_url, "0016")
        assert not {"priority", "weight"} & _columns(database_url, "tenants")
        assert "priority" not in _columns(database_url, "api_keys")
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT name FROM tenants ORDER BY name")).scalars().all() == ["acme", "globex"]
            assert conn.execute(sa.text("SELECT id FROM api_keys")).scalars().all() == ["a1"]
    finally:
        engine.dispose()
