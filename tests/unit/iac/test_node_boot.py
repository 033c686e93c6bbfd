"""The node boot scripts, run for real under bash with stand-ins for the cloud's metadata and CLIs."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from iac.node_boot import RUN_SCRIPT, VENV, NodeBoot, cloud_init, run_script, startup_script

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")

AWS_BOOT = NodeBoot(
    cloud="aws",
    region="aws:eu-west-1",
    location="eu-west-1",
    control_plane_url="https://cp.example.com",
    agent_package="meridian[vllm]==0.1.0",
    model_uris=(("mistralai/Mistral-7B-Instruct-v0.3", "s3://acme-weights-eu-west-1/models/mistral"),),
    default_uri_prefix="s3://acme-weights-eu-west-1/models/",
    cluster_token_secret="/acme/cluster-token",
)
GCP_BOOT = NodeBoot(
    cloud="gcp",
    region="gcp:europe-west4",
    location="europe-west4",
    control_plane_url="https://cp.example.com",
    agent_package="meridian",
    model_uris=(("Qwen/Qwen2.5-72B-Instruct", "gs://acme-weights-europe-west4/q"),),
    default_uri_prefix="gs://acme-weights-europe-west4/models/",
    cluster_token_secret="acme-cluster-token",
)

# Stand-ins: curl answers the metadata paths, aws/gcloud the secret.
FAKE_CURL = """#!/bin/bash
url="${@: -1}"
case "$url" in
  */api/token) echo imds-token ;;
  */meta-data/instance-id) echo i-0123456789abcdef0 ;;
  */meta-data/local-ipv4) echo 10.0.3.7 ;;
  */meta-data/tags/instance/meridian:model) [ -n "$FAKE_MODEL" ] && echo "$FAKE_MODEL" || exit 22 ;;
  */meta-data/tags/instance/meridian:pd-role) [ -n "$FAKE_PD_ROLE" ] && echo "$FAKE_PD_ROLE" || exit 22 ;;
  */instance/name) echo acme-qwen-5d5a3c5c-x1y2 ;;
  */instance/network-interfaces/0/ip) echo 10.1.0.9 ;;
  */instance/attributes/meridian-model) [ -n "$FAKE_MODEL" ] && echo "$FAKE_MODEL" || exit 22 ;;
  */instance/attributes/meridian-pd-role) [ -n "$FAKE_PD_ROLE" ] && echo "$FAKE_PD_ROLE" || exit 22 ;;
  */project/project-id) echo acme-prod ;;
  *) echo "unexpected url $url" >&2; exit 22 ;;
esac
"""
FAKE_AWS = """#!/bin/bash
case "$1 $2" in
  "ssm get-parameter") echo "s3cret token" ;;
  "configure export-credentials") echo "export AWS_ACCESS_KEY_ID=AKIAEXAMPLE" ;;  # never asked now
  *) exit 1 ;;
esac
"""
FAKE_GCLOUD = """#!/bin/bash
[ "$1 $2 $3" = "secrets versions access" ] && echo "gcp-token" || exit 1
"""


def _run(boot: NodeBoot, tmp_path: Path, model: str, pd_role: str = "") -> dict[str, str]:
    """Run the boot's run script up to its exec (which prints the environment instead)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("curl", FAKE_CURL), ("aws", FAKE_AWS), ("gcloud", FAKE_GCLOUD)):
        path = bin_dir / name
        path.write_text(body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    script = run_script(boot).replace(f"exec {VENV}/bin/meridian node run", "exec env")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_MODEL": model, "FAKE_PD_ROLE": pd_role}
    done = subprocess.run([BASH, "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def test_aws_node_gets_its_settings_from_metadata_and_ssm(tmp_path):
    env = _run(AWS_BOOT, tmp_path, "mistralai/Mistral-7B-Instruct-v0.3")
    assert env["MERIDIAN_NODE_REGION"] == "aws:eu-west-1"
    assert env["MERIDIAN_NODE_CONTROL_PLANE_URL"] == "https://cp.example.com"
    assert env["MERIDIAN_NODE_NODE_ID"] == "i-0123456789abcdef0"
    assert env["MERIDIAN_NODE_ADVERTISE_URL"] == "http://10.0.3.7:8000"
    assert env["MERIDIAN_NODE_MODEL_NAME"] == "mistralai/Mistral-7B-Instruct-v0.3"
    assert env["MERIDIAN_NODE_MODEL_URI"] == "s3://acme-weights-eu-west-1/models/mistral"
    assert env["MERIDIAN_CLUSTER_TOKEN"] == "s3cret token"
    assert env["MERIDIAN_WEIGHTS_S3_REGION"] == "eu-west-1"
    # Never frozen into the environment: the node's credential chain reads the instance role
    # from IMDSv2 and refreshes it (exported keys expired hours after boot).
    assert not any(k.startswith("AWS_") for k in env)
    assert env["MERIDIAN_NODE_ENGINE"] == "vllm" and env["MERIDIAN_NODE_KV_EVENTS_ENDPOINT"] == "tcp://*:5557"
    # No prefill/decode role tag: co-located, as every node was before P/D.
    assert "MERIDIAN_NODE_ROLE" not in env


@pytest.mark.parametrize("boot", [AWS_BOOT, GCP_BOOT], ids=["aws", "gcp"])
def test_a_prefill_or_decode_groups_node_starts_in_its_role(tmp_path, boot):
    for role in ("prefill", "decode"):
        assert _run(boot, tmp_path, "m", pd_role=role)["MERIDIAN_NODE_ROLE"] == role


def test_a_model_the_plan_does_not_list_reads_the_default_key(tmp_path):
    env = _run(AWS_BOOT, tmp_path, "Some Org/New-Model 2.0")
    assert env["MERIDIAN_NODE_MODEL_URI"] == "s3://acme-weights-eu-west-1/models/some-org-new-model-2-0"


def test_an_instance_without_a_model_tag_refuses_to_start(tmp_path):
    bin_dir = tmp_path / "bin"
    _run(AWS_BOOT, tmp_path, "x")  # writes the stand-ins
    done = subprocess.run(
        [BASH, "-c", run_script(AWS_BOOT)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_MODEL": ""},
    )
    assert done.returncode == 1
    assert "no model tag" in done.stderr


def test_gcp_node_gets_its_settings_from_the_metadata_server(tmp_path):
    env = _run(GCP_BOOT, tmp_path, "Qwen/Qwen2.5-72B-Instruct")
    assert env["MERIDIAN_NODE_REGION"] == "gcp:europe-west4"
    assert env["MERIDIAN_NODE_NODE_ID"] == "acme-qwen-5d5a3c5c-x1y2"
    assert env["MERIDIAN_NODE_ADVERTISE_URL"] == "http://10.1.0.9:8000"
    assert env["MERIDIAN_NODE_MODEL_URI"] == "gs://acme-weights-europe-west4/q"
    assert env["MERIDIAN_CLUSTER_TOKEN"] == "gcp-token"
    assert "MERIDIAN_WEIGHTS_S3_REGION" not in env


def test_cloud_init_writes_the_run_script_and_starts_the_unit():
    text = cloud_init(AWS_BOOT)
    assert text.startswith("#cloud-config\n")
    config = yaml.safe_load(text)
    files = {f["path"]: f for f in config["write_files"]}
    assert files[RUN_SCRIPT]["content"] == run_script(AWS_BOOT)
    assert files[RUN_SCRIPT]["permissions"] == "0755"
    commands = config["runcmd"]
    assert [
        f"{VENV}/bin/pip",
        "install",
        "--no-cache-dir",
        "--timeout",
        "60",
        "meridian[vllm]==0.1.0",
    ] in commands
    assert commands[-1] == ["systemctl", "enable", "--now", "meridian-node.service"]


def test_startup_script_is_valid_bash_and_installs_once():
    script = startup_script(GCP_BOOT)
    done = subprocess.run([BASH, "-n", "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert f"if [ ! -x {VENV}/bin/meridian ]; then" in script
    assert run_script(GCP_BOOT).rstrip("\n") in script
