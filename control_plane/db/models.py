"""SQLAlchemy 2 models of the control plane's state (portable across SQLite and Postgres)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, CheckConstraint, DateTime, ForeignKey, Integer, MetaData, String
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

# Named constraints let Alembic's batch mode (SQLite) and autogenerate address them.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    SQLite keeps no offset, so values are normalised to UTC on the way in and tagged as
    UTC on the way out; Postgres returns them in the session's zone, converted back here.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous; pass an aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Node(Base):
    """A data-plane node as last registered / heard from."""

    __tablename__ = "nodes"

    node_id: Mapped[str] = mapped_column(String(63), primary_key=True)
    region: Mapped[str] = mapped_column(String(80), index=True)
    provider: Mapped[str] = mapped_column(String(16))
    url: Mapped[str] = mapped_column(String(2048))
    models: Mapped[list[str]] = mapped_column(JSON)
    engine: Mapped[str] = mapped_column(String(16))
    version: Mapped[str] = mapped_column(String(64))
    # A meridian.contracts.NodeStatus value; a plain string keeps both backends alike.
    status: Mapped[str] = mapped_column(String(16), index=True)
    load: Mapped[dict[str, Any]] = mapped_column(JSON)
    registered_at: Mapped[datetime] = mapped_column(UTCDateTime())
    last_heartbeat: Mapped[datetime] = mapped_column(UTCDateTime(), index=True)
    # meridian.contracts.ColdStart of the node's last start, as it reported it.
    cold_start: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)


class ApiKey(Base):
    """An API key; only its SHA-256 is stored."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    name: Mapped[str] = mapped_column(String(200))
    tenant: Mapped[str] = mapped_column(String(200), index=True)
    zone: Mapped[str] = mapped_column(String(32))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    # None means every model.
    models: Mapped[list[str] | None] = mapped_column(JSON, nullable=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    key_prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)


class RoutingState(Base):
    """The single row holding the routing table's version."""

    __tablename__ = "routing_state"
    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    version: Mapped[int] = mapped_column(BigInteger, default=0)


class Deployment(Base):
    """A model the fabric serves, where its replicas may run and how many it should have.

    `desired_replicas` is what the fabric is asked to run; actuators (the local scaler,
    later the reconciler and autoscaler) move the fleet towards it.
    """

    __tablename__ = "deployments"
    __table_args__ = (
        CheckConstraint("min_replicas >= 0", name="min_replicas_non_negative"),
        CheckConstraint("max_replicas >= 1", name="max_replicas_positive"),
        CheckConstraint("min_replicas <= max_replicas", name="min_le_max"),
        CheckConstraint("desired_replicas >= 0 AND desired_replicas <= max_replicas", name="desired_in_range"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    model: Mapped[str] = mapped_column(String(200), unique=True, index=True)
    zone: Mapped[str] = mapped_column(String(32))
    min_replicas: Mapped[int] = mapped_column(Integer)
    max_replicas: Mapped[int] = mapped_column(Integer)
    desired_replicas: Mapped[int] = mapped_column(Integer)
    last_scale_request_at: Mapped[datetime | None] = mapped_column(UTCDateTime(), nullable=True)
    last_scale_reason: Mapped[str | None] = mapped_column(String(200), nullable=True)
    last_scale_region: Mapped[str | None] = mapped_column(String(80), nullable=True)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime())
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())


class WeightReplica(Base):
    """A node that holds (cached) or is downloading (fetching) a model's weights; peers
    of its region fetch from it. Rows go with their node."""

    __tablename__ = "weight_replicas"

    digest: Mapped[str] = mapped_column(String(64), primary_key=True)
    node_id: Mapped[str] = mapped_column(
        String(63), ForeignKey("nodes.node_id", ondelete="CASCADE"), primary_key=True, index=True
    )
    # "cached" or "fetching"
    state: Mapped[str] = mapped_column(String(16))
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime())
