"""The admin commands against a real control plane: keys, tenants, models, deployments, status,
their `-o json|yaml`, and their errors (one red line, field errors one per line, no traceback)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from collections.abc import Iterator

import httpx
import pytest
import yaml
from cp_harness import ADMIN_KEY, CLUSTER_TOKEN, stop_process, wait_until_up
from typer.testing import CliRunner

from cli.main import app
from meridian.admin_api import (
    ApiKeyCreated,
    ApiKeyView,
    DeploymentUpsert,
    ModelFitView,
    ModelUpsert,
    TenantView,
)
from meridian.admin_client import AdminClient
from meridian.ports import free_port

runner = CliRunner()


def cli(env: dict[str, str], *args: str):
    return runner.invoke(app, list(args), env=env)


def assert_clean_failure(r, code: int) -> None:
    assert r.exit_code == code, r.output
    assert r.stdout == "" and "Traceback" not in r.output


def test_version_names_the_package_and_python():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0
    assert r.stdout.startswith("meridian 0.1.0 (Python 3.")


def test_tenants_are_created_listed_and_updated(admin_env):
    r = cli(admin_env, "tenants", "create", "acme", "--zone", "eu", "--requests-per-minute", "600")
    assert r.exit_code == 0, r.output
    assert "acme" in r.stdout and "600" in r.stdout
    r = cli(admin_env, "tenants", "update", "acme", "--model", "tiny-llama", "--tokens-per-minute", "9000",
            "-o", "json")
    assert r.exit_code == 0, r.output
    updated = TenantView.model_validate_json(r.stdout)
    assert (updated.zone, updated.models, updated.requests_per_minute, updated.tokens_per_minute) == (
        "eu", ["tiny-llama"], 600, 9000)
    r = cli(admin_env, "tenants", "list", "-o", "json")
    assert r.exit_code == 0, r.output
    listed = {t["name"]: t for t in json.loads(r.stdout)}
    assert listed["acme"]["resource_version"] == updated.resource_version
    r = cli(admin_env, "tenants", "update", "acme", "--all-models", "-o", "yaml")
    assert r.exit_code == 0, r.output
    assert yaml.safe_load(r.stdout)["models"] is None
    r = cli(admin_env, "tenants", "list")
    line = next(line for line in r.stdout.splitlines() if "acme" in line)
    assert "eu" in line and "all" in line and "9,000" in line


def test_a_tenants_priority_and_weight_are_set_shown_and_a_keys_priority_overrides(admin_env):
    r = cli(admin_env, "tenants", "create", "banded", "--zone", "eu", "--priority", "2", "--weight", "1.5",
            "-o", "json")
    assert r.exit_code == 0, r.output
    created = TenantView.model_validate_json(r.stdout)
    assert (created.priority, created.weight) == (2, 1.5)
    r = cli(admin_env, "tenants", "update", "banded", "--priority", "-3", "-o", "json")
    assert r.exit_code == 0, r.output
    updated = TenantView.model_validate_json(r.stdout)
    assert (updated.priority, updated.weight) == (-3, 1.5)
    r = cli(admin_env, "tenants", "update", "banded", "--weight", "0.25")
    assert r.exit_code == 0, r.output
    r = cli(admin_env, "tenants", "list")
    line = next(line for line in r.stdout.splitlines() if "banded" in line)
    assert "-3" in line and "0.25" in line
    r = cli(admin_env, "tenants", "update", "banded", "--priority", "11")
    assert_clean_failure(r, 2)
    assert "  priority: Input should be less than or equal to 10" in r.stderr
    r = cli(admin_env, "tenants", "update", "banded", "--weight", "0")
    assert_clean_failure(r, 2)
    assert "  weight: Input should be greater than 0" in r.stderr
    r = cli(admin_env, "keys", "create", "--tenant", "banded", "--priority", "7", "-o", "json")
    assert r.exit_code == 0, r.output
    assert ApiKeyCreated.model_validate_json(r.stdout).priority == 7
    r = cli(admin_env, "keys", "create", "--tenant", "banded", "--priority", "-11")
    assert_clean_failure(r, 2)
    assert "  priority: Input should be greater than or equal to -10" in r.stderr


def test_a_422_prints_each_field_error_on_its_own_line(admin_env):
    r = cli(admin_env, "tenants", "create", "bad-zone", "--zone", "EU")
    assert_clean_failure(r, 2)
    assert "422 Unprocessable Entity" in r.stderr
    assert "\n  zone: String should match pattern" in r.stderr
    r = cli(admin_env, "tenants", "update", "nobody-here", "--requests-per-minute", "0", "--zone", "EU")
    assert_clean_failure(r, 2)
    assert "  zone: " in r.stderr and "  requests_per_minute: Input should be greater than or equal to 1" in r.stderr


def test_the_control_planes_own_refusals_are_one_line(admin_env):
    r = cli(admin_env, "tenants", "create", "martians", "--zone", "mars")
    assert_clean_failure(r, 1)
    assert "400 Bad Request: unknown zone 'mars'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = cli(admin_env, "tenants", "update", "nobody-here", "--zone", "eu")
    assert_clean_failure(r, 1)
    assert r.stderr.startswith("404 Not Found")
    r = cli(admin_env, "tenants", "update", "acme")
    assert_clean_failure(r, 2)
    assert "nothing to change" in r.stderr and "--priority or --weight" in r.stderr


def test_keys_are_listed_without_secrets_and_revoked(admin_env):
    r = cli(admin_env, "keys", "create", "--tenant", "keyed", "--zone", "us", "--name", "ci", "--create-tenant")
    assert r.exit_code == 0, r.output
    assert "created tenant keyed in zone us" in r.stderr
    secret = r.stdout.strip().splitlines()[-1]
    r = cli(admin_env, "keys", "list", "--tenant", "keyed", "-o", "json")
    assert r.exit_code == 0, r.output
    keys = [ApiKeyView.model_validate(k) for k in json.loads(r.stdout)]
    assert [(k.name, k.zone) for k in keys] == [("ci", "us")] and secret not in r.stdout
    r = cli(admin_env, "keys", "list", "--tenant", "keyed")
    assert keys[0].id in r.stdout and keys[0].key_prefix in r.stdout and secret not in r.stdout
    r = cli(admin_env, "keys", "revoke", keys[0].id)
    assert r.exit_code == 0 and "revoked" in r.stdout
    assert json.loads(cli(admin_env, "keys", "list", "--tenant", "keyed", "-o", "json").stdout) == []
    revoked = json.loads(cli(admin_env, "keys", "list", "--tenant", "keyed", "--include-revoked", "-o", "json").stdout)
    assert [k["id"] for k in revoked] == [keys[0].id] and revoked[0]["revoked_at"]
    r = cli(admin_env, "keys", "revoke", "no-such-key")
    assert_clean_failure(r, 1)
    assert r.stderr.startswith("404 Not Found")


def test_a_key_for_an_unknown_tenant_is_refused_and_nothing_is_created(admin_env):
    assert cli(admin_env, "tenants", "create", "typo-corp", "--zone", "eu").exit_code == 0
    r = cli(admin_env, "keys", "create", "--tenant", "typo-crop")
    assert_clean_failure(r, 1)
    lines = r.stderr.strip().splitlines()
    assert lines[0].startswith("404 Not Found: no tenant 'typo-crop' (did you mean 'typo-corp'?)")
    assert lines[1] == ("  create it with: meridian tenants create typo-crop --zone ZONE, or meridian keys create "
                        "--tenant typo-crop --create-tenant --zone ZONE")
    tenants = {t["name"] for t in json.loads(cli(admin_env, "tenants", "list", "-o", "json").stdout)}
    assert "typo-crop" not in tenants and "typo-corp" in tenants
    assert json.loads(cli(admin_env, "keys", "list", "--tenant", "typo-crop", "-o", "json").stdout) == []
    # Creating the tenant with its key takes a zone: residency is never a default.
    r = cli(admin_env, "keys", "create", "--tenant", "typo-crop", "--create-tenant")
    assert_clean_failure(r, 2)
    assert "--create-tenant needs --zone" in r.stderr


def test_keys_create_as_json_is_the_key_and_its_record(admin_env):
    r = cli(admin_env, "keys", "create", "--tenant", "jsonco", "--zone", "eu", "--create-tenant", "-o", "json")
    assert r.exit_code == 0, r.output
    made = ApiKeyCreated.model_validate_json(r.stdout)  # stdout is the JSON alone
    assert made.key.startswith(made.key_prefix) and (made.tenant, made.zone, made.tenant_created) == ("jsonco", "eu", True)
    assert "created tenant jsonco in zone eu" in r.stderr
    r = cli(admin_env, "keys", "create", "--tenant", "jsonco", "-o", "yaml")
    assert r.exit_code == 0, r.output
    again = yaml.safe_load(r.stdout)
    assert again["tenant_created"] is False and again["key"] != made.key and r.stderr == ""


def test_a_bad_flag_is_refused_before_anything_is_sent():
    # No control plane listens there: the refusal must come from the CLI's own check.
    env = {"MERIDIAN_CONTROL_PLANE_URL": f"http://127.0.0.1:{free_port()}", "MERIDIAN_API_KEY": "k"}
    r = cli(env, "keys", "create", "--tenant", "x", "--scope", "root")
    assert_clean_failure(r, 2)
    assert "  scopes.0: Input should be 'admin', 'operator', 'read-only' or 'inference'" in r.stderr


def test_status_and_models_as_json_are_the_apis_models_and_nothing_else(admin_env):
    r = cli(admin_env, "status", "-o", "json")
    assert r.exit_code == 0, r.output
    status = json.loads(r.stdout)
    assert status["nodes"] == [] and {"name", "zones", "provider"} <= set(status["regions"][0])
    r = cli(admin_env, "models", "-o", "json")
    assert r.exit_code == 0 and isinstance(json.loads(r.stdout), list)
    r = cli(admin_env, "deployments", "list", "-o", "yaml")
    assert r.exit_code == 0 and isinstance(yaml.safe_load(r.stdout), list)


def test_an_unknown_output_format_is_refused(admin_env):
    r = cli(admin_env, "tenants", "list", "-o", "xml")
    assert r.exit_code == 2 and "xml" in r.output


@pytest.mark.parametrize("args", [["status"], ["keys", "list"], ["tenants", "list"], ["models"]])
def test_a_wrong_key_is_one_red_line(control_plane, args):
    r = cli({"MERIDIAN_CONTROL_PLANE_URL": control_plane, "MERIDIAN_API_KEY": "mrd_wrong"}, *args)
    assert_clean_failure(r, 1)
    assert r.stderr.startswith("401 Unauthorized") and len(r.stderr.strip().splitlines()) == 1


def test_admin_key_is_used_as_given(admin_env):
    r = cli({**admin_env, "MERIDIAN_API_KEY": ""}, "tenants", "list", "--api-key", ADMIN_KEY, "-o", "json")
    assert r.exit_code == 0, r.output


def test_plan_as_json_is_the_plan_alone(admin_env):
    r = cli(admin_env, "plan", "--time-limit", "5", "-o", "json")
    assert r.exit_code in (0, 1), r.output
    plan = json.loads(r.stdout)
    assert plan["id"] and plan["status"] in ("preview", "infeasible") and "diff" in plan
    r = cli(admin_env, "plan", "--time-limit", "0")
    assert_clean_failure(r, 2)
    assert "  time_limit_s: Input should be greater than 0" in r.stderr


@pytest.fixture
def router(control_plane: str) -> Iterator[str]:
    """A geo router of the control plane (`meridian router serve`), serving its routing table."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli", "router", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--control-plane-url", control_plane],
        env={**os.environ, "MERIDIAN_CLUSTER_TOKEN": CLUSTER_TOKEN, "MERIDIAN_ROUTER_WORKERS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_until_up(proc, port, timeout_s=60)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(proc)


def test_a_router_given_as_the_control_plane_is_named_as_one(admin_env, router):
    r = cli({**admin_env, "MERIDIAN_CONTROL_PLANE_URL": router, "COLUMNS": "300"}, "tenants", "list")
    assert_clean_failure(r, 1)
    assert r.stderr.startswith(f"{router}: that is a router, not the control plane (")
    assert "--control-plane" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_tenant_is_deleted_only_when_confirmed_and_its_keys_go_with_it(admin_env):
    assert cli(admin_env, "keys", "create", "--tenant", "leaving", "--zone", "eu", "--create-tenant").exit_code == 0
    r = runner.invoke(app, ["tenants", "delete", "leaving"], env=admin_env, input="n\n")
    assert r.exit_code == 1 and "delete tenant leaving (zone eu) and revoke its 1 key(s)?" in r.stderr
    assert "nothing was deleted" in r.stderr
    assert "leaving" in {t["name"] for t in json.loads(cli(admin_env, "tenants", "list", "-o", "json").stdout)}
    r = runner.invoke(app, ["tenants", "delete", "leaving"], env=admin_env, input="y\n")
    assert r.exit_code == 0, r.output
    assert "tenant leaving deleted; its 1 key(s) revoked" in r.stdout
    assert "leaving" not in {t["name"] for t in json.loads(cli(admin_env, "tenants", "list", "-o", "json").stdout)}
    assert json.loads(cli(admin_env, "keys", "list", "--tenant", "leaving", "-o", "json").stdout) == []
    r = cli(admin_env, "tenants", "delete", "leaving", "--yes")
    assert_clean_failure(r, 1)
    assert r.stderr.startswith("404 Not Found: no tenant 'leaving'")


def test_a_model_is_deleted_after_its_deployment(admin_env):
    shape = ModelUpsert(params_b=0.5, layers=2, kv_heads=2, head_dim=16)
    with AdminClient(admin_env["MERIDIAN_CONTROL_PLANE_URL"], ADMIN_KEY) as admin:
        admin.put_model("doomed", shape)
        admin.put_deployment("doomed", DeploymentUpsert(zone="eu"))
    r = cli(admin_env, "models", "delete", "doomed", "--yes")
    assert_clean_failure(r, 1)
    assert r.stderr.startswith("409 Conflict: model 'doomed' has a deployment; delete the deployment first")
    r = runner.invoke(app, ["deployments", "delete", "doomed"], env=admin_env, input="y\n")
    assert r.exit_code == 0, r.output
    assert "delete the deployment of doomed (zone eu, 0–1 replicas)?" in r.stderr
    assert "deployment of doomed deleted" in r.stdout
    assert "doomed" not in {d["model"] for d in json.loads(cli(admin_env, "deployments", "list", "-o", "json").stdout)}
    assert "doomed" in {m["name"] for m in json.loads(cli(admin_env, "models", "-o", "json").stdout)}
    r = cli(admin_env, "models", "delete", "doomed", "-y")
    assert r.exit_code == 0, r.output
    assert "doomed" not in {m["name"] for m in json.loads(cli(admin_env, "models", "list", "-o", "json").stdout)}
    assert_clean_failure(cli(admin_env, "deployments", "delete", "doomed", "--yes"), 1)


def test_a_piped_table_keeps_each_row_on_one_line_whatever_the_terminal(admin_env):
    """`meridian models | grep …` in an 80-column terminal: stdin is that terminal, stdout a pipe."""
    name, uri = "acme/a-model-with-a-rather-long-name-v2", "s3://acme-weights-europe-west/a-model-with-a-long-name-v2"
    with AdminClient(admin_env["MERIDIAN_CONTROL_PLANE_URL"], ADMIN_KEY) as admin:
        admin.put_model(name, ModelUpsert(params_b=0.134515, layers=30, kv_heads=3, head_dim=64, weights_uri=uri))
    terminal, tty = pty.openpty()
    fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in {**os.environ, **admin_env}.items() if k != "COLUMNS"}
    try:
        r = subprocess.run([sys.executable, "-m", "cli", "models"], stdin=tty, capture_output=True, text=True,
                           env=env, timeout=60)
    finally:
        os.close(tty)
        os.close(terminal)
    assert r.returncode == 0, r.stderr
    [row] = [line for line in r.stdout.splitlines() if name in line]
    assert uri in row and "135M" in row
    assert len(row) > 80  # the row's own width, not the terminal's


def test_nodes_lists_every_node_with_its_state_and_load(admin_env, control_plane):
    internal = {"authorization": f"Bearer {CLUSTER_TOKEN}"}
    node = {"node_id": "node-eu-1", "region": "gcp:europe-west4", "url": "http://10.0.0.5:8000",
            "models": ["tiny-llama"], "status": "ready"}
    assert httpx.post(f"{control_plane}/v1/nodes/register", json=node, headers=internal).status_code == 200
    beat = {"status": "ready", "load": {"running": 3, "waiting": 7, "kv_cache_usage": 0.25, "requests_completed": 1234}}
    assert httpx.post(f"{control_plane}/v1/nodes/node-eu-1/heartbeat", json=beat, headers=internal).status_code == 200
    r = cli(admin_env, "nodes")
    assert r.exit_code == 0, r.output
    [row] = [line for line in r.stdout.splitlines() if "node-eu-1" in line]
    cells = [c.strip() for c in row.strip("│ ").split("│")]
    assert cells[:6] == ["node-eu-1", "gcp:europe-west4", "gcp", "ready", "torch", "tiny-llama"]
    assert cells[6:10] == ["3", "7", "25%", "1,234"]
    r = cli(admin_env, "nodes", "-o", "json")
    assert [(n["node_id"], n["load"]["waiting"]) for n in json.loads(r.stdout)] == [("node-eu-1", 7)]
    assert httpx.delete(f"{control_plane}/v1/nodes/node-eu-1", headers=internal).status_code == 204


def test_audit_shows_who_changed_what_a_page_at_a_time(admin_env):
    assert cli(admin_env, "tenants", "create", "audited", "--zone", "eu").exit_code == 0
    assert cli(admin_env, "tenants", "update", "audited", "--zone", "us", "--requests-per-minute", "600").exit_code == 0
    r = cli(admin_env, "audit", "--type", "tenant", "--id", "audited")
    assert r.exit_code == 0, r.output
    rows = [line for line in r.stdout.splitlines() if "tenant audited" in line]
    assert len(rows) == 2 and "update" in rows[0] and "create" in rows[1]  # newest first
    assert "zone: eu → us; requests_per_minute: - → 600" in rows[0] and "bootstrap-admin" in rows[0]
    r = cli(admin_env, "audit", "--type", "tenant", "--id", "audited", "--limit", "1", "-o", "json")
    assert r.exit_code == 0, r.output
    [newest] = json.loads(r.stdout)
    assert (newest["action"], newest["after"]["zone"]) == ("update", "us")
    more = r.stderr.strip()
    assert more.startswith("older entries: meridian audit --limit 1 --type tenant --id audited --cursor ")
    r = cli(admin_env, *more.removeprefix("older entries: meridian ").split(), "-o", "json")
    assert [e["action"] for e in json.loads(r.stdout)] == ["create"] and r.stderr == ""
    r = cli(admin_env, "audit", "--since", "2026-01-01T00:00:00")  # no zone: which instant is it?
    assert_clean_failure(r, 2)
    assert "since: Input should have timezone info" in r.stderr


def test_fit_says_which_skus_a_model_fits_and_at_what_price(admin_env):
    with AdminClient(admin_env["MERIDIAN_CONTROL_PLANE_URL"], ADMIN_KEY) as admin:
        admin.put_model("llama-70b", ModelUpsert(params_b=70.6, layers=80, kv_heads=8, head_dim=128,
                                                 attention_heads=64, hidden_size=8192))
    r = cli(admin_env, "fit", "llama-70b", "-o", "json")
    assert r.exit_code == 0, r.output
    fit = ModelFitView.model_validate_json(r.stdout)
    assert fit.fits and fit.does_not_fit and all(f.tensor_parallel > 1 for f in fit.fits)
    cheapest = fit.fits[0]
    r = cli(admin_env, "fit", "llama-70b")
    assert r.exit_code == 0, r.output
    [row] = [line for line in r.stdout.splitlines() if f"│ {cheapest.sku} " in line]
    assert cheapest.cheapest is not None and cheapest.cheapest.instance_type in row
    assert f"does not fit: {', '.join(fit.does_not_fit)}" in " ".join(r.stdout.split())
    r = cli(admin_env, "fit", "no-such-model")
    assert_clean_failure(r, 1)
    assert r.stderr.startswith("404 Not Found: no model 'no-such-model'")
