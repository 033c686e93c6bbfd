"""`meridian --config FILE` and `meridian config check|example`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.main import app
from meridian.ports import free_port
from meridian.settings import use_config_file

runner = CliRunner()


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ("MERIDIAN_CONFIG", "MERIDIAN_CONTROL_PLANE_URL", "MERIDIAN_API_KEY", "MERIDIAN_CLUSTER_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    yield
    use_config_file(None)


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "meridian.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_command_reads_its_section_of_the_config_file(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    path = write(tmp_path, {"cli": {"control_plane_url": url, "api_key": "mrd_from-the-file"}})
    r = runner.invoke(app, ["--config", str(path), "status"])
    # The key and the URL both came from the file: the CLI went on to call that control plane.
    assert r.exit_code == 1 and "unreachable" in r.output and "API key" not in r.output


def test_the_flag_beats_the_config_file(tmp_path: Path) -> None:
    path = write(tmp_path, {"cli": {"control_plane_url": "http://127.0.0.1:1"}})
    url = f"http://127.0.0.1:{free_port()}"
    r = runner.invoke(app, ["--config", str(path), "status", "--api-key", "k", "--control-plane", url])
    output = " ".join(r.output.split())
    assert r.exit_code == 1 and url in output and "127.0.0.1:1:" not in output


def test_a_servers_settings_come_from_the_file_too(tmp_path: Path) -> None:
    # A weak cluster token in the router's section is refused as it would be from the environment.
    path = write(tmp_path, {"router": {"cluster_token": "aaaaaaaaaaaaaaaaaaaaaaaa"}})
    r = runner.invoke(app, ["--config", str(path), "router", "serve"])
    assert r.exit_code == 2 and "weak secrets in RouterSettings" in r.output


def test_an_invalid_config_file_stops_any_command_with_the_keys_named(tmp_path: Path) -> None:
    path = write(tmp_path, {"router": {"prot": 8080, "port": "eighty"}})
    r = runner.invoke(app, ["--config", str(path), "router", "serve"])
    assert r.exit_code == 2
    assert "router.prot: unknown key (did you mean port?)" in r.output
    assert "router.port: Input should be a valid integer" in r.output
    assert "Traceback" not in r.output


def test_meridian_config_names_the_file_when_no_flag_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MERIDIAN_CONFIG", str(tmp_path / "missing.yaml"))
    # Wide enough for the whole path (an xdist worker's tmp path is longer).
    r = runner.invoke(app, ["status"], env={"COLUMNS": "300"})
    assert r.exit_code == 2 and "missing.yaml" in r.output and "cannot read it" in r.output


def test_config_check_says_ok_or_lists_the_problems(tmp_path: Path) -> None:
    good = write(tmp_path, {"router": {"port": 9000}, "log": {"format": "json"}})
    r = runner.invoke(app, ["config", "check", str(good)])
    assert r.exit_code == 0 and r.output.startswith("OK: ") and "router, log" in r.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("control_plane:\n  node_ttl_s: -1\nrouters: {}\n")
    r = runner.invoke(app, ["config", "check", str(bad)])
    assert r.exit_code == 1
    assert "control_plane.node_ttl_s: Input should be greater than 0" in r.output
    assert "routers: unknown section (did you mean router?)" in r.output


def test_config_example_prints_a_file_that_checks(tmp_path: Path) -> None:
    r = runner.invoke(app, ["config", "example"])
    assert r.exit_code == 0 and "router:" in r.output and "# routing_policy: \"affinity\"" in r.output
    path = tmp_path / "example.yaml"
    path.write_text(r.output)
    assert runner.invoke(app, ["config", "check", str(path)]).exit_code == 0


def test_a_server_started_with_a_config_file_logs_in_its_format(tmp_path: Path) -> None:
    """The control plane started as an operator would: its port, database and log format
    from the file, one JSON object per line from its first line to its last."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import httpx

    port = free_port()
    path = write(tmp_path, {
        "control_plane": {"port": port, "database_url": f"sqlite:///{tmp_path / 'cp.db'}",
                          "cluster_token": "cluster-secret-token-abcdefghijklmnop"},
        "log": {"format": "json"},
    })
    env = {k: v for k, v in os.environ.items() if not k.startswith("MERIDIAN_")}
    proc = subprocess.Popen([sys.executable, "-m", "cli", "--config", str(path), "control-plane", "serve"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    head: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            head.append(line)
            # uvicorn logs this once it listens ("Application startup complete" comes before
            # the socket is bound: a request right after it can be refused on a loaded box).
            if "Uvicorn running on" in line:
                break
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records = [json.loads(line) for line in [*head, *rest.splitlines()] if line.strip()]
    assert proc.returncode == 0 and records
    assert records[-1]["logger"] == "uvicorn.error" and "Finished server process" in records[-1]["msg"]
