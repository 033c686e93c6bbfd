"""The control plane's settings (`meridian control-plane serve`, `MERIDIAN_CP_*`, section
`control_plane:`)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from meridian.settings.base import CLUSTER_TOKEN_FIELD, ListenerSettings


class ControlPlaneSettings(ListenerSettings):
    """Settings of `meridian control-plane serve`."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_CP_", extra="ignore")
    config_section: ClassVar[str] = "control_plane"

    host: str = "127.0.0.1"
    port: int = Field(8081, ge=0, le=65535)
    database_url: str = "sqlite:///./meridian-state.db"
    cluster_token: SecretStr = CLUSTER_TOKEN_FIELD
    # GET /metrics answers a bearer of this token, of the cluster token, or of an API key
    # with the admin, operator or read-only scope (a Prometheus scrape config's credentials).
    metrics_token: SecretStr | None = None
    # Hash of this key is ensured at start-up as an admin-scoped key, so a fresh
    # deployment can create its first tenants. Unset in steady state.
    bootstrap_admin_key: SecretStr | None = None
    heartbeat_interval_s: float = Field(2.0, gt=0)
    # A node whose last heartbeat is older than this is marked lost and leaves the table.
    node_ttl_s: float = Field(10.0, gt=0)
    # The heartbeat rate the control plane is sized to take (all replicas together; None: no
    # limit). A larger fleet is told a longer interval, live nodes / this, and its TTL grows
    # in proportion (control_plane.heartbeat_pacing). A heartbeat costs ~2 ms of control-plane
    # CPU (bench/heartbeats, 2-core box): 250 a second is half a core, and 10,000 nodes are
    # told 40 s (TTL 200 s).
    max_heartbeats_per_s: float | None = Field(250.0, gt=0)
    # Registrations in flight at once per process (control_plane.registration_gate); the rest
    # are answered 429 with a Retry-After at once. A registration is ~6-8 ms of CPU and waits
    # for its version bump besides: on an idle 2-core box 8 at a time register 158 a second and
    # 32 at a time 112 (contention). In the fleet simulator at 3,000 nodes joining at 100 a
    # second, 8 admitted ~21 a second and reaped no live node; 16 and 64 admitted faster and
    # starved the heartbeats (33 and 9 live nodes reaped). None: no limit.
    max_concurrent_registrations: int | None = Field(8, ge=1)
    # The database pool of the API's threads (Postgres; SQLite has one writer anyway). Sized
    # to what runs at once, so that a burst does not open and close a connection per request
    # past the pool (a Postgres backend's start is milliseconds of CPU).
    db_pool_size: int = Field(20, ge=1)
    db_max_overflow: int = Field(10, ge=0)
    # Lost nodes are forgotten after this long.
    lost_node_retention_s: float = Field(3600.0, gt=0)
    reaper_interval_s: float = Field(1.0, gt=0)
    # After the control plane starts, or its database comes back, no node is expired for this
    # long: nobody could record heartbeats meanwhile. Default: the TTL plus the longest
    # heartbeat retry backoff of a node (meridian.contracts.HEARTBEAT_RETRY_MAX_S).
    reaper_grace_s: float | None = Field(None, ge=0)
    # Static stability (control_plane.reaper): the control plane's own lag never expires a
    # healthy fleet. A reaper pass that starts more than reaper_interval_s + this after the
    # previous one means the control plane itself stalled (paused, starved of CPU, blocked)
    # and heard no heartbeat meanwhile: the grace above restarts. Default: the heartbeat interval.
    reaper_stall_s: float | None = Field(None, gt=0)
    # While nodes are silent past the TTL, expire none ("hold") if the newest heartbeat of any
    # node is older than this (nobody's heartbeat is being recorded: the control plane is
    # behind). Default: two heartbeat intervals.
    reaper_heartbeats_behind_s: float | None = Field(None, gt=0)
    # Hold too while more than this share of the fleet is silent past the TTL at once (1: never).
    reaper_max_silent_share: float = Field(0.5, gt=0, le=1)
    # The holds apply to fleets of at least this many nodes: a lone node's death is reaped.
    reaper_hold_min_nodes: int = Field(2, ge=1)
    # A pass expires at most this share of a region's nodes (lost ones included; at least
    # one), longest silent first: a region that goes silent is taken out over 1/share passes.
    reaper_region_share_per_pass: float = Field(0.2, gt=0, le=1)
    max_long_poll_s: float = Field(30.0, gt=0)
    # Routing tables this process built and keeps to answer "changes since version V" with a
    # delta (control_plane.table_stream): at most this many versions and about this many bytes
    # (the serialized size of each, an upper bound on what they hold). A router further behind
    # gets the full table.
    routing_history_versions: int = Field(64, ge=1)
    routing_history_bytes: int = Field(64 * 1024 * 1024, ge=0)
    # Routing-table builds are at least this far apart: a storm of changes (a fleet
    # registering at once) costs one build per interval, each covering every change committed
    # before it, rather than one per version (at 10,000 nodes a build is ~0.2 s of CPU, and
    # builds back to back starved the heartbeats). A change reaches routers at most this later.
    routing_build_min_interval_s: float = Field(0.25, ge=0)
    # And at least the last build's CPU time times (1 / share - 1) apart: table builds take at
    # most this share of a core however large the fleet (control_plane.table_stream).
    routing_build_max_cpu_share: float = Field(0.25, gt=0, le=1)
    max_request_bytes: int = Field(1_000_000, gt=0)
    onprem_inventory: Path | None = None
    # Reported by GET /health, so a client can tell this control plane from another that later
    # answers on the same address: the local fabric sets one and records it in its fabric.json.
    instance_id: str | None = Field(None, max_length=64, pattern=r"^[A-Za-z0-9._-]+$")
    # Chaos drill reports the web console lists (`meridian chaos run --out DIR` writes
    # DIR/<drill>/report.json and timeline.png); None: the console shows none.
    drill_reports_dir: Path | None = None
    # --- fleet loops: leader election, reconciler, autoscaler ---------------------------
    # One control plane leads the reconciler and autoscaler: on Postgres the holder of an
    # advisory lock (checked this often); on SQLite (one control plane only) a lease row.
    reconciler_enabled: bool = True
    autoscaler_enabled: bool = True
    leader_check_interval_s: float = Field(1.0, gt=0)
    leader_lease_s: float = Field(10.0, gt=0)
    # Shown as the leader's name; defaults to "<hostname>:<pid>".
    replica_id: str | None = Field(None, max_length=120)
    reconcile_interval_s: float = Field(2.0, gt=0)
    # A failed reconcile step is retried after base * 2**(n-1) seconds (±20% jitter), capped.
    reconcile_backoff_base_s: float = Field(1.0, gt=0)
    reconcile_backoff_max_s: float = Field(300.0, gt=0)
    # A node being removed is drained (routers stop sending) until its heartbeat shows no
    # running or waiting request, or this long at most.
    reconcile_drain_timeout_s: float = Field(120.0, ge=0)
    # Upper bound on one provider driver call.
    driver_timeout_s: float = Field(60.0, gt=0)
    autoscale_interval_s: float = Field(2.0, gt=0)
    # A router's flow-control backlog report (RouterBacklog) counts for the autoscaler and the
    # console this long after it was made: routers report every flow_backlog_report_s while
    # anything waits, so a report this old is of a router that stopped (gone or cut off).
    router_backlog_ttl_s: float = Field(15.0, gt=0)
    # A decision that keeps the replica count is recorded at most this often per deployment.
    autoscale_hold_record_s: float = Field(60.0, gt=0)
