"""What a cloud GPU node runs at boot: install the agent package and keep `meridian node run` running.

One start, rendered two ways: cloud-init for AWS user data, a startup script for GCE metadata.
Launch and instance templates are shared by every model of an instance type, so the model is
read from the instance itself (the tag / metadata key its group sets, see providers.*.naming)
and its weights URI from a table of the region's models, falling back to the bucket's default
key for a model the plan does not list yet (a group the driver created since).

The node's settings are NodeSettings' environment variables (MERIDIAN_NODE_*); the cluster
token comes from the cloud's secret store at each start and never sits in the template. A
prefill or decode group's instances carry their prefill/decode role the same way as their
model (providers.aws.naming.PD_ROLE_TAG, providers.gcp.naming.METADATA_PD_ROLE, set by the
driver), read into MERIDIAN_NODE_ROLE; an instance without one starts co-located, as before.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import yaml

from iac import layout
from iac.layout import KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT, NODE_PORT
from meridian.infra_plan import InfraPlan, InfraRegion
from providers.aws import naming as aws_naming
from providers.driver import ROLE_ENV
from providers.gcp import naming as gcp_naming

RUN_SCRIPT = "/usr/local/sbin/meridian-node-run"
UNIT_NAME = "meridian-node.service"
UNIT_PATH = f"/etc/systemd/system/{UNIT_NAME}"
VENV = "/opt/meridian"
CACHE_DIR = "/var/lib/meridian/weights"
# Upper bound on each metadata / secret-store call the boot makes.
CALL_TIMEOUT_S = 10
_HEREDOC = "MERIDIAN_EOF"

# The same slug as iac.layout.slug, in shell, for models the table does not list.
_SHELL_SLUG = "tr 'A-Z' 'a-z' | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//'"

_UNIT = f"""[Unit]
Description=Meridian GPU node (node agent and runtime)
Wants=network-online.target
After=network-online.target

[Service]
ExecStart={RUN_SCRIPT}
Restart=always
RestartSec=5
# The node drains on SIGTERM (in-flight requests finish, routers stop sending) before it exits.
KillSignal=SIGTERM
TimeoutStopSec=90
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
"""


def node_env(region: str, control_plane_url: str, *, cache_dir: str = CACHE_DIR) -> dict[str, str]:
    """The settings every GPU node gets, whatever runs it (NodeSettings / WeightSettings variables)."""
    return {
        "MERIDIAN_NODE_REGION": region,
        "MERIDIAN_NODE_CONTROL_PLANE_URL": control_plane_url,
        "MERIDIAN_NODE_HOST": "0.0.0.0",
        "MERIDIAN_NODE_PORT": str(NODE_PORT),
        "MERIDIAN_NODE_ENGINE": "vllm",
        "MERIDIAN_NODE_DEVICE": "cuda",
        # Wildcard binds: the agent advertises them with the advertise URL's host.
        "MERIDIAN_NODE_KV_EVENTS_ENDPOINT": f"tcp://*:{KV_EVENTS_PORT}",
        "MERIDIAN_NODE_KV_EVENTS_REPLAY_ENDPOINT": f"tcp://*:{KV_EVENTS_REPLAY_PORT}",
        "MERIDIAN_WEIGHTS_CACHE_DIR": cache_dir,
    }


@dataclass(frozen=True, slots=True)
class NodeBoot:
    """Everything a cloud node's boot needs to know at synth time."""

    cloud: Literal["aws", "gcp"]
    region: str  # Meridian's region name, "aws:us-east-1"
    location: str  # the cloud's, "us-east-1"
    control_plane_url: str
    agent_package: str
    model_uris: tuple[tuple[str, str], ...]  # (model, weights URI) of the models placed in the region
    default_uri_prefix: str  # "s3://<bucket>/models/": a listed model's URI is elsewhere
    cluster_token_secret: str  # SSM parameter name (AWS) or Secret Manager secret id (GCP)

    @classmethod
    def of(cls, plan: InfraPlan, region: InfraRegion, cloud: Literal["aws", "gcp"]) -> NodeBoot:
        """The boot of the plan's nodes in a cloud region: the region's models in its weights
        bucket, the cloud's cluster-token secret."""
        return cls(
            cloud=cloud,
            region=region.name,
            location=region.location,
            control_plane_url=plan.control_plane_url,
            agent_package=plan.agent_package,
            model_uris=tuple(layout.model_uris(plan, region)),
            default_uri_prefix=layout.bucket_uri(plan, region, "models/"),
            cluster_token_secret=layout.cluster_token_name(plan, cloud),
        )

    def env(self) -> dict[str, str]:
        env = node_env(self.region, self.control_plane_url)
        if self.cloud == "aws":
            env["MERIDIAN_WEIGHTS_S3_REGION"] = self.location
        return env


def _exports(env: Mapping[str, str]) -> list[str]:
    return [f"export {k}={shlex.quote(v)}" for k, v in sorted(env.items())]


def _instance_facts(boot: NodeBoot) -> list[str]:
    """Shell lines that set NODE_ID, ADDR, MODEL, PD_ROLE (empty: co-located) and CLUSTER_TOKEN from
    the cloud's metadata and secrets."""
    t = CALL_TIMEOUT_S
    if boot.cloud == "aws":
        return [
            "IMDS=http://169.254.169.254/latest",
            f'IMDS_TOKEN="$(curl -fsS -m {t} --retry 5 -X PUT -H "X-aws-ec2-metadata-token-ttl-seconds: 300" '
            '"$IMDS/api/token")"',
            f'imds() {{ curl -fsS -m {t} --retry 5 -H "X-aws-ec2-metadata-token: $IMDS_TOKEN" '
            '"$IMDS/meta-data/$1"; }',
            'NODE_ID="$(imds instance-id)"',
            'ADDR="$(imds local-ipv4)"',
            # Instance tags are in the metadata (the launch template enables it); the group sets this one.
            f'MODEL="$(imds tags/instance/{aws_naming.MODEL_TAG} || true)"',
            f'PD_ROLE="$(imds tags/instance/{aws_naming.PD_ROLE_TAG} || true)"',
            f'CLUSTER_TOKEN="$(timeout {t * 6} aws ssm get-parameter --region {shlex.quote(boot.location)} '
            f"--name {shlex.quote(boot.cluster_token_secret)} --with-decryption "
            '--query Parameter.Value --output text)"',
            # No AWS keys are exported: the node takes the instance role's from IMDSv2 through
            # botocore's chain, which refreshes them (exported once, they died hours later).
        ]
    return [
        f"md() {{ curl -fsS -m {t} --retry 5 -H 'Metadata-Flavor: Google' "
        '"http://metadata.google.internal/computeMetadata/v1/$1"; }',
        'NODE_ID="$(md instance/name)"',
        'ADDR="$(md instance/network-interfaces/0/ip)"',
        f'MODEL="$(md instance/attributes/{gcp_naming.METADATA_MODEL} || true)"',
        f'PD_ROLE="$(md instance/attributes/{gcp_naming.METADATA_PD_ROLE} || true)"',
        f'CLUSTER_TOKEN="$(timeout {t * 6} gcloud secrets versions access latest '
        f'--secret={shlex.quote(boot.cluster_token_secret)} --project="$(md project/project-id)")"',
    ]


def run_script(boot: NodeBoot) -> str:
    """The script systemd runs: the node's settings, then exec `meridian node run`."""
    cases = [f"  {shlex.quote(model)}) MODEL_URI={shlex.quote(uri)} ;;" for model, uri in boot.model_uris]
    cases.append(
        f'  *) MODEL_URI={shlex.quote(boot.default_uri_prefix)}"$(printf %s "$MODEL" | {_SHELL_SLUG})" ;;'
    )
    lines = [
        "#!/bin/bash",
        "# Written by Meridian's iac: this node's settings, then `meridian node run` (systemd restarts it).",
        "set -euo pipefail",
        *_exports(boot.env()),
        *_instance_facts(boot),
        'if [ -z "$MODEL" ]; then echo "meridian: this instance has no model tag; it was not started by a '
        'Meridian node group" >&2; exit 1; fi',
        'case "$MODEL" in',
        *cases,
        "esac",
        'export MERIDIAN_NODE_NODE_ID="$NODE_ID" MERIDIAN_NODE_MODEL_NAME="$MODEL"',
        'export MERIDIAN_NODE_MODEL_URI="$MODEL_URI" MERIDIAN_CLUSTER_TOKEN="$CLUSTER_TOKEN"',
        f'export MERIDIAN_NODE_ADVERTISE_URL="http://$ADDR:{NODE_PORT}"',
        # A prefill or decode group's node (providers.driver.role_env); co-located without the tag.
        f'if [ -n "$PD_ROLE" ]; then export {ROLE_ENV}="$PD_ROLE"; fi',
        f"exec {VENV}/bin/meridian node run",
        "",
    ]
    return "\n".join(lines)


def _install_commands(boot: NodeBoot) -> list[list[str]]:
    return [
        ["mkdir", "-p", CACHE_DIR],
        ["python3", "-m", "venv", VENV],
        [f"{VENV}/bin/pip", "install", "--no-cache-dir", "--timeout", "60", boot.agent_package],
        ["systemctl", "daemon-reload"],
        ["systemctl", "enable", "--now", UNIT_NAME],
    ]


def cloud_init(boot: NodeBoot) -> str:
    """#cloud-config user data (AWS): write the run script and unit, install the agent, start it."""
    config = {
        "package_update": True,
        "packages": ["python3-venv"],
        "write_files": [
            {"path": RUN_SCRIPT, "permissions": "0755", "owner": "root:root", "content": run_script(boot)},
            {"path": UNIT_PATH, "permissions": "0644", "owner": "root:root", "content": _UNIT},
        ],
        "runcmd": _install_commands(boot),
    }
    return "#cloud-config\n" + yaml.safe_dump(
        config, sort_keys=True, default_flow_style=False, width=1_000_000
    )


def startup_script(boot: NodeBoot) -> str:
    """GCE startup script: the same files and start; runs at every boot, so it installs only once."""
    files = [(RUN_SCRIPT, "0755", run_script(boot)), (UNIT_PATH, "0644", _UNIT)]
    lines = [
        "#!/bin/bash",
        "# Written by Meridian's iac: install and start the Meridian node.",
        "set -euo pipefail",
    ]
    for path, mode, content in files:
        if f"\n{_HEREDOC}\n" in f"\n{content}":
            raise ValueError(f"{path} contains the heredoc terminator {_HEREDOC}")
        lines += [f"cat > {path} <<'{_HEREDOC}'", content.rstrip("\n"), _HEREDOC, f"chmod {mode} {path}"]
    install = [" ".join(shlex.quote(a) for a in cmd) for cmd in _install_commands(boot)]
    lines += [
        f"if [ ! -x {VENV}/bin/meridian ]; then",
        "  apt-get update -q && apt-get install -y -q python3-venv",
        *(f"  {c}" for c in install[:3]),
        "fi",
        *install[3:],
        "",
    ]
    return "\n".join(lines)
