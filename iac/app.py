"""The cdktf app: one stack per provider-region of the plan plus the global stack, written as Terraform JSON.

    synth(plan, Path("cdktf.out"))  ->  [cdktf.out/stacks/aws-us-east-1/cdk.tf.json, ...]

Ownership: Terraform owns the long-lived infrastructure (networks, buckets, roles, launch and instance
templates, the global stack) and creates one Auto Scaling group (AWS) or regional managed instance
group (GCP) per plan group, i.e. per (model, region, instance type, spot), at the plan's `instances`.
After that the control plane's reconciler and autoscaler own each group's size: the groups carry
`lifecycle.ignore_changes` on `desired_capacity` (ASG) and `target_size` (MIG), so a later apply never
undoes a runtime resize, and changing a group's `instances` in the plan only affects a group created
afresh. The ASG also ignores `max_size` (the AWS driver raises MaxSize when asked for more, and AWS
answers a lower MaxSize by scaling the group in) and `tag` (the driver adds its group-id tag).

Group names are computed from (prefix, model, instance type, spot) alone by providers.aws.naming and
providers.gcp.naming, never from the control plane's group ids, which Terraform does not know; the
drivers find these groups by name and adopt them. Their prefixes (MERIDIAN_PROVIDER_AWS_NAME_PREFIX,
MERIDIAN_PROVIDER_GCP_NAME_PREFIX) must therefore equal the plan's `name`.

Output is byte-identical for the same plan: stacks and resources are built in sorted order from
the plan alone (no clock, no random ids), resource ids are given explicitly, the backend path is
relative, and every JSON file written is re-serialised with sorted keys. The cdktf CLI's environment
variables that would change what is written (CDKTF_CONTEXT_JSON, CDKTF_TARGET_STACK_ID,
SYNTH_HCL_OUTPUT) are refused.

State: each stack uses a local backend (`terraform.<stack>.tfstate` in its own directory), so
`terraform -chdir=cdktf.out/stacks/<stack> init && terraform apply` works as is. A team adds its
remote state in `_backend` (an S3Backend with a DynamoDB lock table, or a GcsBackend), keyed by
the stack name. Apply order: the stacks a stack depends on (manifest.json `dependencies`) first.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from cdktf import App, LocalBackend, TerraformLocal, TerraformStack

from iac import layout
from iac.aws import AwsRegionStack
from iac.gcp import GcpRegionStack
from iac.global_stack import GlobalStack
from iac.layout import PlanError, RegionStack
from iac.onprem import OnPremStack
from meridian.infra_plan import InfraPlan

MANIFEST = "manifest.json"
STACKS_DIR = "stacks"
STACK_FILE = "cdk.tf.json"
# cdktf CLI variables the library reads from the environment (cdktf/lib/app.js, terraform-stack.js).
_CDKTF_ENV = (
    "CDKTF_CONTEXT_JSON",
    "CDKTF_TARGET_STACK_ID",
    "SYNTH_HCL_OUTPUT",
    "CDKTF_CONTINUE_SYNTH_ON_ERROR_ANNOTATIONS",
)

OnStack = Callable[[str], None]


def _backend(stack: TerraformStack, name: str) -> None:
    """Where a stack keeps its state. A relative path keeps the output free of this machine's paths."""
    LocalBackend(stack, path=f"terraform.{name}.tfstate")


def _mark(stack: TerraformStack, region: str, zones: list[str]) -> None:
    """Locals naming the stack's Meridian region and residency zones, for readers and checks of the JSON."""
    TerraformLocal(stack, "meridian_region", region)
    TerraformLocal(stack, "meridian_zones", sorted(zones))


def _region_stack(app: App, plan: InfraPlan, rs: RegionStack) -> TerraformStack:
    if rs.provider == "aws":
        return AwsRegionStack(app, plan, rs)
    if rs.provider == "gcp":
        return GcpRegionStack(app, plan, rs)
    return OnPremStack(app, plan, rs)


def build_app(
    plan: InfraPlan, outdir: Path | None = None, on_stack: OnStack | None = None
) -> tuple[App, dict[str, TerraformStack]]:
    """The app and its stacks by name, not yet synthesised; `on_stack(name)` runs after each stack is built.

    Without `outdir` the app gets a new temporary directory: cdktf creates its output directory at
    once, and building an app (as tests do) should not leave a cdktf.out in the working directory.
    """
    set_env = [v for v in _CDKTF_ENV if os.environ.get(v)]
    if set_env:
        raise PlanError(f"unset {', '.join(set_env)}: cdktf would change what is synthesised")
    if outdir is None:
        outdir = Path(tempfile.mkdtemp(prefix="meridian-iac-"))
    app = App(outdir=str(outdir), stack_traces=False, skip_validation=False)
    stacks: dict[str, TerraformStack] = {}
    for rs in layout.region_stacks(plan):
        stack = _region_stack(app, plan, rs)
        _backend(stack, rs.name)
        _mark(stack, rs.region.name, rs.region.zones)
        stacks[rs.name] = stack
        if on_stack:
            on_stack(rs.name)
    global_stack = GlobalStack(app, plan)
    _backend(global_stack, layout.GLOBAL_STACK)
    _mark(global_stack, plan.global_.region, plan.zones_of(plan.global_.region))
    stacks[layout.GLOBAL_STACK] = global_stack
    if on_stack:
        on_stack(layout.GLOBAL_STACK)
    # Apply order: a replication source after its destination buckets; the global stack after the
    # region stack whose network it uses. Replication always runs from the lower region name to a
    # higher one (layout.replications), so these dependencies never form a cycle.
    global_stack.add_dependency(stacks[layout.stack_name(plan.global_.region)])
    for rep in layout.replications(plan):
        source, destination = (
            stacks[layout.stack_name(rep.source.name)],
            stacks[layout.stack_name(rep.destination.name)],
        )
        if destination not in source.dependencies:
            source.add_dependency(destination)
    return app, stacks


def _prepare(out_dir: Path) -> None:
    """An empty output directory, or the previous synth's (whose stacks are removed first)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise PlanError(f"{out_dir} exists and is not a directory")
    if out_dir.is_dir() and any(out_dir.iterdir()):
        if not (out_dir / MANIFEST).is_file():
            raise PlanError(
                f"{out_dir} is not empty and holds no previous synth output ({MANIFEST}); "
                "pick an empty or new directory"
            )
        shutil.rmtree(out_dir / STACKS_DIR, ignore_errors=True)
        (out_dir / MANIFEST).unlink()
    out_dir.mkdir(parents=True, exist_ok=True)


def _normalise(out_dir: Path) -> None:
    """Rewrite every JSON file with sorted keys and a final newline, so bytes depend on content only."""
    for path in sorted(out_dir.rglob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(
            json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def stack_paths(out_dir: Path) -> list[Path]:
    """The stack JSON files of a synth output, in stack-name order (from its manifest)."""
    manifest = json.loads((out_dir / MANIFEST).read_text(encoding="utf-8"))
    return [out_dir / s["synthesizedStackPath"] for _, s in sorted(manifest["stacks"].items())]


def synth(plan: InfraPlan, out_dir: Path, on_stack: OnStack | None = None) -> list[Path]:
    """Synthesise the plan's stacks into `out_dir`; returns the stack JSON paths, sorted by stack name."""
    out_dir = Path(out_dir)
    _prepare(out_dir)
    app, _ = build_app(plan, out_dir, on_stack)
    app.synth()
    _normalise(out_dir)
    return stack_paths(out_dir)
