"""Deployment files: what a drill needs to run against a running fabric, checked before
any request is sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from chaos.deployed import _own_lines, runnable_on
from chaos.deployed_environment import DeployedNode
from chaos.deployment import CommandAction, DeploymentError, load_deployment
from chaos.drill import load_drills
from chaos.faults.deployed import _render

DRILLS = {d.name: d for d in load_drills()}

VALID = {
    "name": "staging",
    "control_plane": "https://cp.staging.example.com/",
    "routers": ["https://eu.staging.example.com", "http://10.0.0.5:8080"],
    "model": "llama-3-8b",
    "journals": [
        {"name": "routers", "command": "ssh {host} cat /var/lib/meridian/router.jsonl", "hosts": ["r1", "r2"]},
        {"name": "nodes", "path": "/mnt/journals/*.jsonl"},
    ],
    "actions": {
        "process_hang": {"type": "command", "inject": "ssh {host} sudo systemctl kill -s STOP meridian-node",
                         "heal": "ssh {host} sudo systemctl kill -s CONT meridian-node"},
        "control_plane_outage": {"type": "command", "inject": "kubectl scale deploy/cp --replicas 0",
                                 "heal": "kubectl scale deploy/cp --replicas 3"},
        "process_crash": {"type": "terminate_instance", "replacement_timeout_s": 900},
    },
}


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_valid_file_loads_with_urls_normalised(tmp_path: Path) -> None:
    d = load_deployment(_write(tmp_path, VALID))
    assert d.control_plane == "https://cp.staging.example.com"
    assert d.actions["process_crash"].type == "terminate_instance"
    assert isinstance(d.actions["process_hang"], CommandAction) and d.actions["process_hang"].per_node()
    assert not d.actions["control_plane_outage"].per_node()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"journals": []}, "journals"),
        ({"routers": ["ftp://x"]}, "not an http(s) URL"),
        ({"actions": {"process_hang": {"type": "command", "inject": "kill {pid}"}}}, "unknown field {pid}"),
        ({"actions": {"process_hang": {"type": "command", "inject": "echo {"}}}, "malformed template"),
        ({"actions": {"no_such_fault": {"type": "command", "inject": "true"}}}, "no_such_fault"),
        ({"actions": {"process_hang": {"type": "reboot"}}}, "type"),
        ({"journals": [{"name": "x", "path": "/a", "command": "cat /a"}]}, "either a path or a command"),
        ({"journals": [{"name": "x", "command": "ssh {host} cat /a"}]}, "needs hosts"),
        ({"journals": [{"name": "x", "path": "/a"}, {"name": "x", "path": "/b"}]}, "unique"),
        ({"admin_key": "sk-secret"}, "admin_key"),  # a secret never goes in the file
    ],
)
def test_a_bad_file_names_the_field(tmp_path: Path, change: dict[str, object], message: str) -> None:
    with pytest.raises(DeploymentError, match="deployment.yaml") as err:
        load_deployment(_write(tmp_path, VALID | change))
    assert message in str(err.value)


def test_an_unreadable_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DeploymentError, match="cannot read"):
        load_deployment(tmp_path / "missing.yaml")
    with pytest.raises(DeploymentError, match="mapping"):
        load_deployment(_write(tmp_path, ["a", "list"]))


def test_the_admin_key_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = load_deployment(_write(tmp_path, VALID | {"admin_key_env": "STAGING_ADMIN_KEY"}))
    monkeypatch.delenv("STAGING_ADMIN_KEY", raising=False)
    with pytest.raises(DeploymentError, match="set STAGING_ADMIN_KEY"):
        d.admin_key()
    monkeypatch.setenv("STAGING_ADMIN_KEY", "mk-admin")
    assert d.admin_key() == "mk-admin"


def test_a_drill_without_an_action_for_its_fault_cannot_run(tmp_path: Path) -> None:
    d = load_deployment(_write(tmp_path, VALID))
    assert runnable_on(DRILLS["gray-failure"], d) is None
    assert runnable_on(DRILLS["control-plane-down"], d) is None
    why = runnable_on(DRILLS["redis-down"], d)
    assert why is not None and "no action for fault kind redis_outage" in why


def test_a_per_node_command_needs_a_drill_that_targets_nodes(tmp_path: Path) -> None:
    actions = {"control_plane_outage": {"type": "command", "inject": "ssh {host} systemctl stop meridian-cp"}}
    d = load_deployment(_write(tmp_path, VALID | {"actions": actions}))
    why = runnable_on(DRILLS["control-plane-down"], d)
    assert why is not None and "targets the control_plane service" in why


def test_node_fields_are_shell_quoted_into_commands() -> None:
    node = DeployedNode(node_id="n1", region="aws:us-east-1", provider="aws", url="http://10.0.0.7:8000",
                        models=("m",), status="ready")
    assert _render("ssh {host} kill -STOP {node_id}", node.fields()) == "ssh 10.0.0.7 kill -STOP n1"
    # A value from the control plane never becomes shell syntax.
    assert _render("echo {model}", {"model": "x; rm -rf /"}) == "echo 'x; rm -rf /'"


def test_only_the_runs_own_journal_lines_are_kept() -> None:
    lines = [
        json.dumps({"type": "routed", "key": "gray-failure-ab12-000001", "node": "n", "region": "r",
                    "attempt": 1}) + "\n",
        json.dumps({"type": "routed", "key": "prod-traffic-1", "node": "n", "region": "r", "attempt": 1}) + "\n",
        # Another run whose id starts with this one's.
        json.dumps({"type": "served", "key": "gray-failure-ab123-000001", "node": "n", "completed": True}) + "\n",
        json.dumps({"type": "served", "key": "gray-failure-ab12-000001", "node": "n", "completed": True}),
        '{"type": "served", "key": "gray-fail',  # torn: the journal was being written
    ]
    kept, unreadable = _own_lines(lines, "gray-failure-ab12")
    assert [json.loads(x)["type"] for x in kept] == ["routed", "served"]
    assert all(x.endswith("\n") for x in kept)
    assert unreadable == 1


def test_the_example_deployment_file_is_valid_and_runs_the_drills_it_has_actions_for() -> None:
    d = load_deployment(Path(__file__).parents[3] / "examples" / "chaos" / "deployment.yaml")
    runnable = sorted(name for name, drill in DRILLS.items() if runnable_on(drill, d) is None)
    assert runnable == ["control-plane-down", "gray-failure", "node-crash", "redis-down", "region-outage",
                        "spot-preemption"]
