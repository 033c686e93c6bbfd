"""A drill run against a deployment it did not start: a local fabric stands in for one,
reached only through its URLs, its admin key, the commands of a deployment file and the
journal files its routers and nodes write, as a real deployment would be."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import pytest
import yaml

from chaos.deployed import DeployedRunOptions, run_drill_on
from chaos.deployment import load_deployment
from chaos.drill import DRILLS_DIR, Drill, load_drills
from localfabric import DEMO_MODEL, FabricInfo, FabricSpec, LocalFabric, Proc, renice

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


@pytest.fixture(scope="module")
def fabric_of_deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalFabric]:
    """A running fabric shaped like the gray-failure and node-crash drills' topology."""
    work = tmp_path_factory.mktemp("deployment")
    # Nodes drain within the spot-preemption drill's 10 s deadline, as an operator sets them up.
    spec = FabricSpec(work_dir=work / "fabric", region_nodes={"aws:us-east-1": 2}, drain_timeout_s=7.0,
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
        yield fabric
    finally:
        fabric.stop()


@pytest.fixture(scope="module")
def deployment(fabric_of_deployment: LocalFabric) -> tuple[FabricInfo, Path]:
    """What a drill knows of the deployment: its URLs and keys, and where its journals are."""
    spec, info = fabric_of_deployment.spec, fabric_of_deployment.info
    assert info is not None and spec.journal_dir is not None
    return info, spec.journal_dir


def test_gray_failure_against_a_deployment(deployment: tuple[FabricInfo, Path], tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    info, journals = deployment
    monkeypatch.setenv("STANDIN_ADMIN_KEY", info.admin_key)
    monkeypatch.setenv("MERIDIAN_CHAOS_METRICS_TOKEN", info.cluster_token)
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


class Ec2Hosts:
    """Stands in for EC2 hosts under an Auto Scaling group: each node runs under the id of a
    moto instance; when an instance is terminated its node dies with it (SIGKILL), and when
    either goes, a new instance is launched with a node of its own, as the group would."""

    def __init__(self, fabric: LocalFabric, endpoint: str, region: str = "us-east-1") -> None:
        self._fabric, self._region = fabric, region
        self._ec2 = boto3.client("ec2", endpoint_url=endpoint, region_name=region,
                                 aws_access_key_id="testing", aws_secret_access_key="testing")
        self._image = self._ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        self.nodes: dict[str, Proc] = {}
        self.killed: list[str] = []  # nodes that died with their instance
        self.gone: list[str] = []  # and every node replaced
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="ec2-hosts", daemon=True)

    def launch(self) -> str:
        """A new instance and its node, READY; the instance id."""
        iid = self._ec2.run_instances(ImageId=self._image, MinCount=1, MaxCount=1,
                                      InstanceType="p5.48xlarge")["Instances"][0]["InstanceId"]
        # Niced while it cold-starts, as the runner does: two cores serve the drill's load too.
        proc = self._fabric.start_replacement_node(f"aws:{self._region}", niceness=15, node_id=iid)
        self.nodes[iid] = proc
        self._fabric.wait_ready(proc, 120)
        renice(proc.popen.pid, 0)
        return iid

    def __enter__(self) -> Ec2Hosts:
        self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._watcher.join(timeout=150)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            ids = [i for i in self.nodes if i not in self.gone]
            if not ids:
                continue
            answer = self._ec2.describe_instances(InstanceIds=ids)
            for instance in (i for r in answer["Reservations"] for i in r["Instances"]):
                iid, proc = instance["InstanceId"], self.nodes[instance["InstanceId"]]
                if instance["State"]["Name"] in ("shutting-down", "terminated"):
                    proc.popen.kill()
                    proc.popen.wait(10)
                    self.killed.append(iid)
                elif proc.popen.poll() is None:
                    continue
                self.gone.append(iid)
                self.launch()


def test_node_crash_by_terminating_its_instance_through_the_aws_api(
    deployment: tuple[FabricInfo, Path], fabric_of_deployment: LocalFabric, private_moto_server: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    info, journals = deployment
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                        "AWS_EC2_METADATA_DISABLED": "true", "STANDIN_ADMIN_KEY": info.admin_key,
                        "MERIDIAN_CHAOS_METRICS_TOKEN": info.cluster_token,
                        "MERIDIAN_PROVIDER_AWS_ENDPOINT_URL": private_moto_server}.items():
        monkeypatch.setenv(name, value)
    path = tmp_path / "standin.yaml"
    path.write_text(yaml.safe_dump({
        "name": "standin", "control_plane": info.control_plane_url, "routers": info.router_urls,
        # The drill's gRPC clients reach the routers' KServe listeners too.
        "grpc_routers": info.grpc_targets,
        "model": DEMO_MODEL, "admin_key_env": "STANDIN_ADMIN_KEY",
        "journals": [{"name": "fabric", "path": f"{journals}/*.jsonl"}],
        "actions": {"process_crash": {"type": "terminate_instance", "replacement_timeout_s": 60}},
        "settle_s": 2,
    }))
    with Ec2Hosts(fabric_of_deployment, private_moto_server) as hosts:
        victim = hosts.launch()
        # The node-crash drill aimed at the instance's node, with time for its replacement to start.
        data = yaml.safe_load((DRILLS_DIR / "01-node-crash.yaml").read_text())
        data["fault"]["target"] = {"node": victim}
        data["short"].update(duration_s=50, fault_end_s=16)
        drill = Drill.model_validate(data)

        outcome = run_drill_on(drill, load_deployment(path), DeployedRunOptions(out_dir=tmp_path / "report"))

    report = outcome.report
    failures = [f"{c.name}: {c.measured} vs {c.bound} {c.detail}" for c in report.verdict.failures()]
    assert outcome.passed, (report.aborted, failures, report.not_checked, report.events)
    assert [e.detail for e in report.events if e.action == "terminate"] == [
        f"instance {victim} in aws:us-east-1 through the aws API"]
    assert hosts.killed == hosts.gone == [victim]
    # The heal waited for the group's replacement to be READY in the control plane.
    assert report.invariants == {"replacement_node_ready": True}


def test_spot_preemption_by_an_operator_command(
    deployment: tuple[FabricInfo, Path], fabric_of_deployment: LocalFabric, private_moto_server: str,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The preemption notice is the operator's command (SIGTERM on the host); the drill sees the
    node drain out of the control plane's list within the deadline and the group replace it."""
    info, journals = deployment
    monkeypatch.setenv("STANDIN_ADMIN_KEY", info.admin_key)
    monkeypatch.setenv("MERIDIAN_CHAOS_METRICS_TOKEN", info.cluster_token)
    path = tmp_path / "standin.yaml"
    path.write_text(yaml.safe_dump({
        "name": "standin", "control_plane": info.control_plane_url, "routers": info.router_urls,
        "model": DEMO_MODEL, "admin_key_env": "STANDIN_ADMIN_KEY",
        "journals": [{"name": "fabric", "path": f"{journals}/*.jsonl"}],
        "actions": {"spot_preemption": {"type": "command", "inject": "pkill -TERM -f -- '[-]-node-id {node_id} '",
                                        "recovery_timeout_s": 60}},
        "settle_s": 2,
    }))
    with Ec2Hosts(fabric_of_deployment, private_moto_server) as hosts:
        victim = hosts.launch()
        data = yaml.safe_load((DRILLS_DIR / "09-spot-preemption.yaml").read_text())
        data["fault"]["target"] = {"node": victim}
        data["short"].update(duration_s=50)
        drill = Drill.model_validate(data)

        outcome = run_drill_on(drill, load_deployment(path), DeployedRunOptions(out_dir=tmp_path / "report"))

    report = outcome.report
    failures = [f"{c.name}: {c.measured} vs {c.bound} {c.detail}" for c in report.verdict.failures()]
    assert outcome.passed, (report.aborted, failures, report.not_checked, report.events)
    assert hosts.gone == [victim] and not hosts.killed
    assert report.invariants["node_drained_within_deadline"] and report.invariants["replacement_node_ready"]
