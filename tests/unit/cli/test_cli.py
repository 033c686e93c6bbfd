from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console
from typer.testing import CliRunner

from cli.main import app
from cli.status_view import status_table
from meridian.contracts import KVConnector, KVTransferInfo, NodeLoad, NodeRole, NodeStatus, NodeView
from meridian.ports import free_port
from providers.regions import region_catalog

runner = CliRunner()


def test_status_needs_an_api_key(monkeypatch, tmp_path):
    monkeypatch.delenv("MERIDIAN_API_KEY", raising=False)
    monkeypatch.chdir(tmp_path)  # no demo's fabric.json here
    r = runner.invoke(app, ["status"])
    assert r.exit_code == 2
    assert "API key" in r.output


def test_status_reports_unreachable_control_plane():
    url = f"http://127.0.0.1:{free_port()}"
    r = runner.invoke(app, ["status", "--api-key", "k", "--control-plane", url], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    assert "Traceback" not in r.output
    # No status in front: there was no answer, so no "0".
    assert r.stderr.startswith(f"control plane unreachable: {url}: ")


def test_invalid_flag_value_is_a_clear_error():
    r = runner.invoke(app, ["control-plane", "serve", "--port", "70000"])
    assert r.exit_code == 2
    assert "port" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize(("command", "env"), [
    (["control-plane", "serve"], {"MERIDIAN_CLUSTER_TOKEN": "t"}),
    (["control-plane", "serve"], {"MERIDIAN_CLUSTER_TOKEN": "a-long-enough-cluster-token",
                                  "MERIDIAN_CP_BOOTSTRAP_ADMIN_KEY": "changeme"}),
    (["router", "serve"], {"MERIDIAN_CLUSTER_TOKEN": "aaaaaaaaaaaaaaaaaaaaaaaa"}),
    (["node", "run", "--model-dir", "/nonexistent"], {"MERIDIAN_CLUSTER_TOKEN": "secret"}),
])
def test_a_weak_shared_secret_refuses_to_start(monkeypatch, command, env):
    """Issue 18: any string was accepted as the cluster token or the bootstrap admin key."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    r = runner.invoke(app, command)
    assert r.exit_code == 2
    assert "weak secrets" in r.output and "Traceback" not in r.output
    assert all(value not in r.output for value in env.values() if len(value) > 8)


def _node(node_id: str, region: str, status: NodeStatus, age_s: float, now: datetime) -> NodeView:
    return NodeView(
        node_id=node_id, region=region, provider=region.split(":")[0], url="http://h:1",
        models=["tiny-llama"], engine="torch", version="0.1.0", status=status,
        load=NodeLoad(running=2, waiting=1, kv_cache_usage=0.25),
        registered_at=now - timedelta(minutes=5), last_heartbeat=now - timedelta(seconds=age_s),
    )


def test_status_table_shows_region_zone_health_model():
    now = datetime.now(UTC)
    nodes = [_node("n-eu", "gcp:europe-west4", NodeStatus.READY, 1, now),
             _node("n-us", "aws:us-east-1", NodeStatus.LOST, 42, now)]
    console = Console(width=200, record=True)
    console.print(status_table(list(region_catalog().values()), nodes, now=now))
    text = console.export_text()
    eu_line = next(line for line in text.splitlines() if "n-eu" in line)
    us_line = next(line for line in text.splitlines() if "n-us" in line)
    assert "gcp:europe-west4" in eu_line and "eu" in eu_line and "ready" in eu_line
    assert "tiny-llama" in eu_line and "25%" in eu_line
    assert "lost" in us_line and "42s ago" in us_line


def test_status_table_lists_resident_lora_adapters_with_the_model():
    now = datetime.now(UTC)
    node = _node("n-eu", "gcp:europe-west4", NodeStatus.READY, 1, now)
    node = node.model_copy(update={"load": NodeLoad(running=1, lora_adapters=["support", "legal"])})
    console = Console(width=200, record=True)
    console.print(status_table(list(region_catalog().values()), [node], now=now))
    line = next(line for line in console.export_text().splitlines() if "n-eu" in line)
    assert "tiny-llama, +support, +legal" in line


def test_status_table_shows_a_disaggregated_nodes_role():
    now = datetime.now(UTC)
    transfer = KVTransferInfo(connector=KVConnector.NIXL, endpoint="10.0.0.7:5600", lease_s=30)
    prefill = _node("n-p", "gcp:europe-west4", NodeStatus.READY, 1, now).model_copy(
        update={"role": NodeRole.PREFILL, "kv_transfer": transfer})
    both = _node("n-c", "gcp:europe-west4", NodeStatus.READY, 1, now)
    console = Console(width=200, record=True)
    console.print(status_table(list(region_catalog().values()), [prefill, both], now=now))
    lines = console.export_text().splitlines()
    assert "n-p (prefill)" in next(line for line in lines if "n-p" in line)
    assert "(" not in next(line for line in lines if "n-c" in line).split("ready")[0]


def test_status_table_with_no_nodes_says_so():
    console = Console(width=200, record=True)
    console.print(status_table([], []))
    assert "no nodes registered" in console.export_text()


def test_make_tiny_refuses_to_clobber_without_overwrite(tmp_path):
    out = tmp_path / "tiny"
    assert runner.invoke(app, ["model", "make-tiny", str(out), "--seed", "1"]).exit_code == 0
    before = (out / "model.safetensors").read_bytes()
    r = runner.invoke(app, ["model", "make-tiny", str(out), "--seed", "2"])
    assert r.exit_code == 1 and "--overwrite" in r.output
    assert (out / "model.safetensors").read_bytes() == before
    r = runner.invoke(app, ["model", "make-tiny", str(out), "--seed", "2", "--overwrite"])
    assert r.exit_code == 0 and (out / "model.safetensors").read_bytes() != before


def test_demo_on_vllm_says_how_to_install_it_when_it_is_missing(monkeypatch, tmp_path):
    import sys

    from data_plane.engine.vllm import command

    monkeypatch.setattr(command, "default_vllm_python", lambda: sys.executable)
    r = runner.invoke(app, ["demo", "--engine", "vllm", "--work-dir", str(tmp_path)])
    assert r.exit_code == 2 and "make vllm" in r.output
    assert not any(tmp_path.iterdir()), "nothing was started"


def test_the_cli_starts_without_the_servers_engines_or_databases():
    """Parsing a command must not import torch, FastAPI, SQLAlchemy, uvicorn or the cloud SDKs:
    every command imports what it runs when it runs."""
    import subprocess
    import sys

    heavy = ("torch", "fastapi", "sqlalchemy", "uvicorn", "starlette", "numpy", "safetensors", "boto3",
             "botocore", "google", "cdktf", "yaml", "highspy", "transformers")
    code = ("import sys; import cli.main; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({heavy!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
