"""What a plan becomes, before any cdktf: its stacks, resource names, weight locations and replication.

Pure functions of the plan, so names and edges can be read (and tested) without loading the
provider bindings. The names the runtime drivers also use (launch templates, Auto Scaling groups,
instance templates, MIGs, tags and labels) come from `providers.aws.naming` and
`providers.gcp.naming`; the ones only Terraform touches (buckets, roles, networks) are here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from meridian import residency
from meridian.infra_plan import InfraDeployment, InfraGroup, InfraPlan, InfraRegion, OnPremSite
from providers.aws import naming as aws_naming
from providers.gcp import naming as gcp_naming

GLOBAL_STACK = "global"

# The node's OpenAI-compatible HTTP port (NodeSettings.port) and its KV-event sockets (vLLM's
# defaults); routers and the control plane reach nodes on these, nothing else is opened.
NODE_PORT = 8000
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558
NODE_PORTS = (NODE_PORT, KV_EVENTS_PORT, KV_EVENTS_REPLAY_PORT)

# S3 and GCS bucket names: 3-63 lowercase letters, digits and hyphens.
BUCKET_NAME_MAX = 63
IAM_NAME_MAX = 64
GCP_ACCOUNT_ID_MAX = 30
DNS_LABEL_MAX = 63

# Kubernetes label the hosts of one on-prem node group carry (set by the operator, see onprem.py).
NODE_GROUP_LABEL = "meridian.io/node-group"

_NOT_SLUG = re.compile(r"[^a-z0-9]+")


class PlanError(ValueError):
    """A plan that validates but cannot be turned into stacks; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class RegionStack:
    """One provider-region's stack: the region, the groups placed there and (on-prem) its site."""

    name: str
    region: InfraRegion
    groups: tuple[InfraGroup, ...]
    site: OnPremSite | None = None

    @property
    def provider(self) -> str:
        return self.region.provider


@dataclass(frozen=True, slots=True)
class Replication:
    """S3 replication of one deployment's weights prefix from its home bucket to another region's."""

    model: str
    key: str
    source: InfraRegion
    destination: InfraRegion


def slug(text: str) -> str:
    """Lowercase letters, digits and single hyphens: "Llama-3.1 8B" → "llama-3-1-8b"."""
    return _NOT_SLUG.sub("-", text.lower()).strip("-")


def fit(name: str, limit: int) -> str:
    """`name` when it fits in `limit` characters, else cut and suffixed with a hash of the whole name."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:6]
    return f"{name[: limit - 7].rstrip('-')}-{digest}"


def _named(what: str, make: Callable[[], str]) -> str:
    """Call a naming function, turning its ValueError into a PlanError that says what was being named."""
    try:
        return make()
    except ValueError as e:
        raise PlanError(f"{what}: {e}") from None


def tf_literal(text: str) -> str:
    """`text` as a literal Terraform string: "${" and "%{" would otherwise start an expression."""
    return text.replace("${", "$${").replace("%{", "%%{")


def stack_name(region_name: str) -> str:
    """ "aws:us-east-1" → "aws-us-east-1" (a stack name is also a directory name)."""
    return region_name.replace(":", "-")


def _group_order(g: InfraGroup) -> tuple[str, str, bool]:
    return (g.model, g.instance_type, g.spot)


# The providers iac has stacks for (iac.aws, iac.gcp, iac.onprem).
STACK_PROVIDERS = ("aws", "gcp", "onprem")


def region_stacks(plan: InfraPlan) -> list[RegionStack]:
    """The region stacks, by name: every cloud region with a group, the global region (its network
    holds Postgres and Redis) and every on-prem site with Kubernetes. An inventory-only on-prem
    region gets no stack: its hosts are driven by the on-prem driver, not Terraform."""
    sites = {s.region: s for s in plan.onprem_sites}
    used = {g.region for g in plan.groups} | set(sites) | {plan.global_.region}
    out = []
    for region in sorted(plan.regions, key=lambda r: r.name):
        if region.name not in used:
            continue
        if region.provider not in STACK_PROVIDERS:
            # The plan format takes any registered provider; Terraform stacks exist for these alone.
            raise PlanError(f"{region.name}: iac has no stacks for provider {region.provider!r} "
                            f"(it synthesises {', '.join(STACK_PROVIDERS)})")
        site = sites.get(region.name)
        if region.provider == "onprem" and (site is None or site.kubernetes is None):
            continue
        groups = tuple(sorted((g for g in plan.groups if g.region == region.name), key=_group_order))
        _check_distinct_group_names(plan, groups)
        out.append(RegionStack(stack_name(region.name), region, groups, site))
    return out


def _check_distinct_group_names(plan: InfraPlan, groups: tuple[InfraGroup, ...]) -> None:
    """Group names are computed from (prefix, model, instance type, spot) alone, so two groups of a
    region whose models slug alike ("Org/Model-1.0" and "org/model-1-0") would share one; refuse such a
    plan rather than let the drivers adopt one group's instances for the other."""
    seen: dict[str, InfraGroup] = {}
    for g in groups:
        name = group_name(plan, g)
        if name is None:
            continue
        if name in seen:
            other = seen[name]
            raise PlanError(
                f"groups {other.model}/{other.instance_type}{'/spot' if other.spot else ''} and "
                f"{g.model}/{g.instance_type}{'/spot' if g.spot else ''} in {g.region} would share the "
                f"node group name {name}"
            )
        seen[name] = g


def prefix(plan: InfraPlan) -> str:
    """The installation's name as resource names use it. The drivers name groups from their own prefix
    (MERIDIAN_PROVIDER_AWS_NAME_PREFIX, MERIDIAN_PROVIDER_GCP_NAME_PREFIX), which must equal the plan's
    name for them to find the launch templates, Auto Scaling groups, instance templates and MIGs."""
    p = slug(plan.name)
    if not p or not p[0].isalpha():
        raise PlanError(f"plan name {plan.name!r} must start with a letter to prefix cloud resource names")
    return p


# --- weights ---------------------------------------------------------------------------


def weights_key(deployment: InfraDeployment) -> str:
    """Where a model's weights live inside a region's bucket: the path of its s3:// or gs://
    weights URI (so a plan that says where they were pushed is honoured), else models/<slug>."""
    if deployment.weights_uri:
        parts = urlsplit(deployment.weights_uri)
        key = parts.path.strip("/")
        if parts.scheme in ("s3", "gs") and key:
            return key
    return f"models/{slug(deployment.model) or hashlib.sha256(deployment.model.encode()).hexdigest()[:12]}"


def bucket_name(plan: InfraPlan, region: InfraRegion) -> str:
    """The weights bucket of a cloud region: "<prefix>-weights-<location>" (bucket names are global,
    so the plan's name must be unique to the installation)."""
    return fit(f"{prefix(plan)}-weights-{region.location}", BUCKET_NAME_MAX)


def bucket_uri(plan: InfraPlan, region: InfraRegion, key: str = "") -> str:
    scheme = {"aws": "s3", "gcp": "gs"}.get(region.provider)
    if scheme is None:
        raise PlanError(f"{region.name}: on-prem regions have no weights bucket")
    return f"{scheme}://{bucket_name(plan, region)}/{key}"


def model_uris(plan: InfraPlan, region: InfraRegion) -> list[tuple[str, str]]:
    """(model, weights URI) of each deployment placed in a cloud region: its key in the region's bucket."""
    models = sorted({g.model for g in plan.groups if g.region == region.name})
    return [(m, bucket_uri(plan, region, weights_key(plan.deployment(m)))) for m in models]


def _may_hold(deployment: InfraDeployment, region: InfraRegion) -> bool:
    return region.admits(deployment.zone)


def replications(plan: InfraPlan) -> list[Replication]:
    """Every S3 replication rule, sorted by source, destination and model.

    A deployment's AWS regions are split into residency clusters: all of them for a zoned
    deployment (the plan keeps them in its zone), and one per set of region zones for a global
    one, so that no bucket ever copies to a bucket in another residency zone. The first region
    of a cluster by name is its home: weights are pushed there and replicated to the others.
    A global deployment placed in two zones is therefore pushed once per zone (see
    `push_targets`), a deliberate cost of keeping every copy path inside one zone.
    """
    out = []
    for deployment in sorted(plan.deployments, key=lambda d: d.model):
        clusters: dict[tuple[str, ...], list[InfraRegion]] = defaultdict(list)
        names = sorted({g.region for g in plan.groups if g.model == deployment.model})
        for region in (plan.region(n) for n in names):
            if region.provider != "aws":
                continue
            zoned = residency.is_bound(deployment.zone)
            clusters[(deployment.zone,) if zoned else tuple(sorted(region.zones))].append(region)
        for members in clusters.values():
            home, *others = members
            for destination in others:
                if not (_may_hold(deployment, home) and _may_hold(deployment, destination)):
                    raise PlanError(
                        f"weights of {deployment.model} (zone {deployment.zone}) would replicate "
                        f"from {home.name} to {destination.name}"
                    )
                out.append(Replication(deployment.model, weights_key(deployment), home, destination))
    return sorted(out, key=lambda r: (r.source.name, r.destination.name, r.model))


def push_targets(plan: InfraPlan) -> list[tuple[str, str]]:
    """(model, URI) pairs to push each model's weights to: every GCS bucket that serves it, and the
    home bucket of each of its S3 replication clusters (the other S3 buckets receive copies)."""
    replicated = {(r.model, r.destination.name) for r in replications(plan)}
    out = set()
    for g in plan.groups:
        region = plan.region(g.region)
        if region.provider == "onprem" or (g.model, region.name) in replicated:
            continue
        out.add((g.model, bucket_uri(plan, region, weights_key(plan.deployment(g.model)))))
    return sorted(out)


def dns_records(addresses: list[str]) -> list[tuple[str, list[str]]]:
    """(record type, values) for the endpoint's name: A and/or AAAA for router addresses, or one
    CNAME when the plan gives a single host name (a load balancer's); sorted, so output is stable."""
    v4, v6, names = [], [], []
    for a in addresses:
        try:
            ip = ipaddress.ip_address(a)
        except ValueError:
            names.append(a)
            continue
        (v4 if ip.version == 4 else v6).append(str(ip))
    if names and (v4 or v6 or len(names) > 1):
        raise PlanError(f"global.router_addresses {addresses}: a host name (CNAME) must be the only address")
    if names:
        return [("CNAME", names)]
    return [(kind, sorted(values)) for kind, values in (("A", v4), ("AAAA", v6)) if values]


# --- names Terraform alone uses -----------------------------------------------------------


def resource_name(plan: InfraPlan, *parts: str, limit: int = IAM_NAME_MAX) -> str:
    """ "<prefix>-<part>-<part>…", fitted to `limit` characters."""
    return fit("-".join([prefix(plan), *(slug(p) for p in parts)]), limit)


def cluster_token_name(plan: InfraPlan, where: str) -> str:
    """Where nodes find MERIDIAN_CLUSTER_TOKEN: the SSM SecureString parameter (aws), Secret Manager
    secret (gcp) or Kubernetes Secret (onprem, key "token") the operator creates before applying."""
    return f"/{prefix(plan)}/cluster-token" if where == "aws" else f"{prefix(plan)}-cluster-token"


def gcp_account_id(plan: InfraPlan, region: InfraRegion) -> str:
    """The node service account's id (6-30 characters, starting with a letter)."""
    return fit(f"{prefix(plan)}-node-{region.location}", GCP_ACCOUNT_ID_MAX)


def dns_label(*parts: str) -> str:
    """A Kubernetes object name / label value (DNS-1123 label) from parts."""
    return fit("-".join(p for p in (slug(x) for x in parts) if p), DNS_LABEL_MAX).strip("-") or "node"


def tf_id(*parts: str) -> str:
    """A Terraform resource name (construct id) from parts: letters, digits and underscores."""
    return re.sub(r"[^a-z0-9]+", "_", "_".join(parts).lower()).strip("_")


# --- names shared with the runtime drivers ------------------------------------------------


def launch_template_name(plan: InfraPlan, instance_type: str, spot: bool) -> str:
    return _named(
        f"launch template for {instance_type}",
        lambda: aws_naming.launch_template_name(prefix(plan), instance_type, spot),
    )


def auto_scaling_group_name(plan: InfraPlan, group: InfraGroup) -> str:
    return _named(
        f"Auto Scaling group for {group.model}@{group.region}",
        lambda: aws_naming.auto_scaling_group_name(
            prefix(plan), group.model, group.instance_type, group.spot
        ),
    )


def instance_template_name(plan: InfraPlan, machine_type: str, spot: bool) -> str:
    return _named(
        f"instance template for {machine_type}",
        lambda: gcp_naming.instance_template_name(prefix(plan), machine_type, spot),
    )


def mig_name(plan: InfraPlan, group: InfraGroup) -> str:
    return _named(
        f"MIG for {group.model}@{group.region}",
        lambda: gcp_naming.mig_name(prefix(plan), group.model, group.instance_type, group.spot),
    )


def base_instance_name(plan: InfraPlan, group: InfraGroup) -> str:
    return _named(
        f"MIG for {group.model}@{group.region}",
        lambda: gcp_naming.base_instance_name(prefix(plan), group.model, group.region, group.instance_type, group.spot),
    )


def group_name(plan: InfraPlan, group: InfraGroup) -> str | None:
    """The cloud node group a plan group becomes (Auto Scaling group or MIG); None on-prem."""
    provider = plan.region(group.region).provider
    if provider == "aws":
        return auto_scaling_group_name(plan, group)
    if provider == "gcp":
        return mig_name(plan, group)
    return None


def templates(groups: tuple[InfraGroup, ...]) -> list[tuple[str, bool]]:
    """The (instance type, spot) pairs a region's groups need one launch / instance template each for."""
    return sorted({(g.instance_type, g.spot) for g in groups})
