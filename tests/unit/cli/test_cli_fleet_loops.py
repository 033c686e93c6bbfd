"""`meridian plan --apply`, `meridian reconciler` and `meridian autoscaler` against a real control
plane process whose fleet loops run (on-prem's driver alone, the default inventory's sites): the
plan places nothing where no driver runs, the reconciler view calls it in force once the hosts are
allocated and says why when they cannot be, and the autoscaler view shows each deployment's counts
and the last decision's reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cp_harness import ADMIN_KEY, poll, spawn_control_plane, stop_process, wait_until_up
from typer.testing import CliRunner

from cli.main import app
from meridian.admin_api import DeploymentUpsert, ModelUpsert, PlacementSpec
from meridian.admin_client import AdminClient
from meridian.ports import free_port

runner = CliRunner()
MODEL = "chat-small"
# Fits one L40S of the default inventory's fra-dc1 site (6 hosts of 4 GPUs).
SHAPE = ModelUpsert(params_b=0.5, layers=24, kv_heads=2, head_dim=64, max_context=2048, target_concurrent_seqs=4)


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    db = Path(tmp_path_factory.mktemp("cp")) / "cp.db"
    port = free_port()
    proc = spawn_control_plane(
        port, f"sqlite:///{db}", MERIDIAN_CP_BOOTSTRAP_ADMIN_KEY=ADMIN_KEY, MERIDIAN_PROVIDER_ENABLED='["onprem"]',
        MERIDIAN_CP_RECONCILE_INTERVAL_S="0.3", MERIDIAN_CP_AUTOSCALE_INTERVAL_S="0.3",
    )
    try:
        wait_until_up(proc, port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def cli(env: dict[str, str], *args: str) -> Any:
    r = runner.invoke(app, list(args), env=env)
    assert r.exit_code == 0, r.output
    return r


def as_json(env: dict[str, str], *args: str) -> Any:
    return json.loads(cli(env, *args, "-o", "json").stdout)


def deploy(control_plane: str, replicas: int) -> None:
    with AdminClient(control_plane, ADMIN_KEY) as admin:
        admin.put_model(MODEL, SHAPE)
        admin.put_deployment(MODEL, DeploymentUpsert(zone="eu", min_replicas=replicas, max_replicas=replicas,
                                                     placement=PlacementSpec(min_regions=1)))


def test_plan_apply_reconciler_and_autoscaler_views(control_plane: str, admin_env: dict[str, str]) -> None:
    before = cli(admin_env, "reconciler")
    assert "no plan" in before.stdout and "no placement applied yet" in before.stdout

    deploy(control_plane, replicas=2)
    r = cli(admin_env, "plan", "--apply", "--yes")
    # The eu zone's aws and gcp regions have no driver here: the plan is on the on-prem site alone.
    assert "onprem:fra-dc1" in r.stdout and "aws:" not in r.stdout and "gcp:" not in r.stdout
    assert "applied" in r.stderr and "meridian reconciler" in r.stderr

    poll(lambda: as_json(admin_env, "reconciler")["state"] == "in_force", 30, "the plan never came in force")
    status = as_json(admin_env, "reconciler")
    (group,) = status["groups"]
    assert (group["region"], group["desired"], group["actual"], group["last_error"]) == ("onprem:fra-dc1", 1, 1, None)
    table = cli(admin_env, "reconciler").stdout
    assert "in force" in table and "every node group at its target" in table and "onprem:fra-dc1" in table

    # The autoscaler keeps the deployment at its bounds and says so.
    poll(lambda: as_json(admin_env, "autoscaler")[0]["last_decision"] is not None, 30, "no decision recorded")
    (pool,) = as_json(admin_env, "autoscaler", "--model", MODEL)
    assert (pool["model"], pool["pool"], pool["desired"], pool["min_replicas"]) == (MODEL, "both", 2, 2)
    assert pool["last_decision"]["reason"].startswith("hold at 2")
    table = cli(admin_env, "autoscaler").stdout
    assert MODEL in table and "hold at 2" in table

    # More replicas than the site has hosts: the reconciler fails, and the view says why.
    deploy(control_plane, replicas=40)
    poll(lambda: as_json(admin_env, "reconciler")["state"] == "failing", 30, "the reconciler never failed")
    table = cli(admin_env, "reconciler").stdout
    assert "failing" in table and "CapacityError" in table
