"""A drill run against a deployment it did not start: a local fabric stands in for one,
reached only through its URLs, its admin key, the commands of a deployment file and the
journal files its routers and nodes write, as a real deployment would be."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from chaos.deployed import DeployedRunOptions, run_drill_on
from chaos.deployment import load_deployment
from chaos.drill import load_drills
from meridian.localfabric import DEMO_MODEL, FabricInfo, FabricSpec, LocalFabric

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FabricInfo, Path]]:
    """A running fabric shaped like the gray-failure drill's topology, and its journal folder."""
    work = tmp_path_factory.mktemp("deployment")
    spec = FabricSpec(work_dir=work / "fabric", region_nodes={"aws:us-east-1": 2},
                      router_env={"MERIDIAN_ROUTER_READ_TIMEOUT_S": "3"}, journal_dir=work / "journals")
    fabric = LocalFabric(spec)
    info = fabric.start()
    try:
        # An operator's deployment has served traffic before a drill: every node has generated.
        body = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 32}
        for p in fabric.node_processes:
            r = httpx.post(f"{p.url}/v1/chat/completions", json=body, timeout=60,
                           headers={"authorization": f"Bearer {info.cluster_token}"})
            assert r.status_code == 200, r.text
        yield info, work / "journals"
    finally:
        fabric.stop()


def test_gray_failure_against_a_deployment(deployment: tuple[FabricInfo, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    info, journals = deployment
    monkeypatch.setenv("STANDIN_ADMIN_KEY", info.admin_key)
    # `[-]-node-id` matches the node's command line but not the shell running pkill.
    node = "pkill -{signal} -f -- '[-]-node-id {node_id} '"
    path = tmp_path / "standin.yaml"
    path.write_text(yaml.safe_dump({
        "name": "standin",
        "control_plane": info.control_plane_url,
        "routers": info.router_urls,
        "model": DEMO_MODEL,
        "admin_key_env": "STANDIN_ADMIN_KEY",
        # Routers' journals fetched per host by a command (ssh in production), nodes' from files.
        "journals": [{"name": "routers", "command": f"cat {journals}/{{host}}.jsonl",
                      "hosts": sorted(p.stem for p in journals.glob("router*.jsonl"))},
                     {"name": "nodes", "path": f"{journals}/node-*.jsonl"}],
        "actions": {"process_hang": {"type": "command", "inject": node.replace("{signal}", "STOP"),
                                     "heal": node.replace("{signal}", "CONT")}},
        "settle_s": 2,
    }))
    drill = next(d for d in load_drills() if d.name == "gray-failure")

    outcome = run_drill_on(drill, load_deployment(path), DeployedRunOptions(out_dir=tmp_path / "report"))

    report = outcome.report
    failures = [f"{c.name}: {c.measured} vs {c.bound} {c.detail}" for c in report.verdict.failures()]
    assert outcome.passed, (report.aborted, failures, report.not_checked, report.events)
    # The fault was the deployment file's command, on the node the drill's target picked.
    injected = [e.detail for e in report.events if e.action == "inject" and e.detail.startswith("pkill")]
    assert len(injected) == 1 and "-STOP" in injected[0] and "[-]-node-id node-aws-us-east-1-" in injected[0]
    assert report.invariants == {"outlier_ejected": True, "region_ejected": True}
    assert not report.not_checked
    # The history joined the routers' and nodes' journals: every completed request was served.
    result = report.result
    assert result.attempts >= 40 and not result.lost and not result.duplicated
    # Every host's journal was collected, keeping only this run's lines (not the warm-up's).
    kept = {p.name: p for p in (outcome.files.report_json.parent / "journals").glob("*.jsonl")}
    assert sorted(kept) == sorted([f"nodes-{p.stem}.jsonl" for p in journals.glob("node-*.jsonl")]
                                  + ["routers-router.jsonl"])
    run_keys = {json.loads(line)["key"].rsplit("-", 1)[0] for p in kept.values() for line in p.open()}
    assert len(run_keys) == 1 and run_keys.pop().startswith(f"{drill.name}-")
    # The drill's keys are revoked afterwards: nothing is left behind on the deployment.
    keys = httpx.get(f"{info.control_plane_url}/v1/api-keys", timeout=10,
                     headers={"authorization": f"Bearer {info.admin_key}"}).json()
    assert not [k for k in keys if k["name"].startswith(f"chaos-{drill.name}-")]
