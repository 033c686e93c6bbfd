"""What the runner decides before it starts anything: which drills it can run, which nodes
a fault hits, and how `meridian chaos run` reports drills it cannot run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from chaos.drill import Drill, Target, load_drills
from chaos.environment import DrillEnvironment, InjectionError
from chaos.faults import injector
from chaos.faults.injector import NotRunnable, create_injector, supported_kinds
from chaos.observe import busiest
from chaos.runner import runnable
from chaos.suite import pick
from cli.main import app
from localfabric import FabricInfo, FabricSpec, LocalFabric, Proc
from meridian.registry import UnknownName

DRILLS = {d.name: d for d in load_drills()}


def test_the_local_runner_injects_process_network_and_service_faults():
    kinds = set(supported_kinds())
    assert {"process_crash", "process_hang", "spot_preemption", "region_outage", "provider_outage",
            "control_plane_outage", "redis_outage", "proxy_blackhole", "proxy_latency"} <= kinds


def test_a_drill_without_an_injector_or_with_an_unsupported_topology_is_not_runnable(monkeypatch):
    crash = DRILLS["node-crash"]
    assert runnable(crash) is None
    data = crash.model_dump(by_alias=True)
    data["topology"]["control_plane_replicas"] = 2
    assert "several control-plane replicas" in (runnable(Drill.model_validate(data)) or "")
    _without_injector(monkeypatch, "process_crash")
    assert "no local injector for 'process_crash'" in (runnable(crash) or "")


def test_create_injector_names_what_is_missing(tmp_path: Path, monkeypatch):
    _without_injector(monkeypatch, "process_crash")
    with pytest.raises(NotRunnable, match="process_crash"):
        create_injector(DRILLS["node-crash"].fault, _env(tmp_path, []))
    with pytest.raises(UnknownName, match="unknown fault injector 'process_crash'; known: .*process_hang"):
        create_injector(DRILLS["node-crash"].fault, _env(tmp_path, []))


def test_every_built_in_injector_loads_with_its_hooks():
    for kind in supported_kinds():
        factory = injector.INJECTORS.get(kind)
        assert callable(factory), kind
    assert injector.unavailable("no_such_kind") is None


def _without_injector(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """The process-wide registry, for this test only, without `kind`'s injector."""
    monkeypatch.setattr(injector, "INJECTORS", injector.INJECTORS.copy())
    injector.INJECTORS.unregister(kind)


def _proc(name: str, region: str) -> Proc:
    popen = subprocess.Popen(["sleep", "30"])
    return Proc(name=name, popen=popen, url="http://127.0.0.1:1", log=Path("/dev/null"),
                region=region, node_id=name, model="tiny-llama")


def _env(tmp_path: Path, procs: list[Proc], seed: int = 0) -> DrillEnvironment:
    fabric = LocalFabric(FabricSpec(work_dir=tmp_path))
    fabric._procs.extend(procs)  # a fabric as the runner sees it once started
    info = FabricInfo(router_url="http://r", control_plane_url="http://cp", admin_key="k", cluster_token="t", keys={})
    return DrillEnvironment(fabric=fabric, info=info, clock_start=0.0, seed=seed)


async def test_targets_pick_nodes_by_region_provider_and_any(tmp_path: Path):
    procs = [_proc("us-1", "aws:us-east-1"), _proc("us-2", "aws:us-east-1"), _proc("eu-1", "aws:eu-west-1"),
             _proc("gcp-1", "gcp:europe-west4")]
    try:
        env = _env(tmp_path, procs)
        assert [p.name for p in await env.nodes(Target(provider="aws"))] == ["eu-1", "us-1", "us-2"]
        assert [p.name for p in await env.nodes(Target(region="aws:us-east-1"))] == ["us-1", "us-2"]
        # No router answers its metrics here: every node is as busy as the next.
        one = await env.nodes(Target(region="aws:us-east-1", node="any"))
        assert len(one) == 1 and one[0].region == "aws:us-east-1"
        # The same seed picks the same node, so a run can be repeated.
        assert await env.nodes(Target(region="aws:us-east-1", node="any")) == one
        procs[3].popen.kill()
        procs[3].popen.wait()
        with pytest.raises(InjectionError, match="no live node"):
            await env.nodes(Target(provider="gcp"))
    finally:
        for p in procs:
            p.popen.kill()
            p.popen.wait()


def test_pick_refuses_unknown_drills():
    drills = list(DRILLS.values())
    assert pick(drills, ["all"]) == drills
    assert [d.name for d in pick(drills, ["redis-down", "node-crash"])] == ["redis-down", "node-crash"]
    with pytest.raises(ValueError, match="unknown drill no-such"):
        pick(drills, ["no-such"])


def test_chaos_run_of_an_unknown_drill_is_a_one_line_error(tmp_path: Path):
    result = CliRunner().invoke(app, ["chaos", "run", "no-such-drill", "--out", str(tmp_path)])
    assert result.exit_code == 2
    assert "unknown drill no-such-drill" in result.output and "Traceback" not in result.output


def test_chaos_run_fails_a_drill_it_cannot_run_without_starting_anything(tmp_path: Path):
    # Two control-plane replicas on SQLite: a topology the local runner cannot start.
    data = DRILLS["node-crash"].model_dump(by_alias=True, mode="json")
    data["name"] = "two-replicas-on-sqlite"
    data["topology"]["control_plane_replicas"] = 2
    drills, out = tmp_path / "drills", tmp_path / "out"
    drills.mkdir()
    (drills / "d.yaml").write_text(yaml.safe_dump(data))
    result = CliRunner().invoke(app, ["chaos", "run", "all", "--short", "--dir", str(drills), "--out", str(out)],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert "NOT RUN" in result.output and "two-replicas-on-sqlite" in result.output and "SQLite" in result.output
    assert not out.exists() or not any(out.iterdir())


def test_cache_consistency_finds_a_published_blob_that_is_not_what_its_name_says(tmp_path: Path):
    import hashlib
    import json

    from chaos.faults.weights import cache_consistent

    blobs, model = tmp_path / "blobs", tmp_path / "models" / "m1"
    blobs.mkdir(parents=True)
    model.mkdir(parents=True)
    good = b"weights"
    digest = hashlib.sha256(good).hexdigest()
    (blobs / digest).write_bytes(good)
    (model / "meridian-manifest.json").write_text(json.dumps({"files": [{"path": "w.safetensors", "sha256": digest}]}))
    assert cache_consistent(tmp_path) == (True, "every blob verified")
    # Half a download published under the final name: what a crash mid-write must never leave.
    (blobs / digest).write_bytes(good[:3])
    ok, why = cache_consistent(tmp_path)
    assert not ok and "does not hash to its name" in why
    (blobs / digest).unlink()
    ok, why = cache_consistent(tmp_path)
    assert not ok and "has no published blob" in why


def test_any_picks_the_node_the_routers_sent_the_most_requests():
    nodes = ["us-1", "us-2", "us-3"]
    assert busiest(nodes, str, {"us-1": 10, "us-2": 250, "us-3": 40, "eu-1": 999}, seed=0) == "us-2"
    # Ties (no traffic seen yet): a seeded choice among the tied, the same for the same seed.
    tied = {busiest(nodes, str, {"us-3": 5, "us-1": 5}, seed=s) for s in range(20)}
    assert tied == {"us-1", "us-3"}
    assert busiest(nodes, str, {}, seed=7) == busiest(nodes, str, {}, seed=7)
