"""The documented example infrastructure plan (examples/plans/three-clouds.json), made by the
placement solver from an example deployment set, so users can try `meridian iac synth`
without a control plane:

    python -m control_plane.example_plan examples/plans/three-clouds.json

Three deployments over AWS, GCP and the built-in on-prem sites, in two residency zones and
one global: an EU-zoned model served from Frankfurt/the Netherlands and the on-prem Frankfurt
data centre (which runs Kubernetes), a US-zoned one, and a global one with users in the US,
Europe and Tokyo.
"""

from __future__ import annotations

import sys

from control_plane.infra_export import InfraOptions, infra_plan
from control_plane.placement.fit import ModelSpec, fit_model
from control_plane.placement.problem import Deployment, Problem, SolveOptions, shapes_from_fit
from control_plane.placement.solver import solve
from meridian.infra_plan import InfraPlan, KubernetesTarget
from providers.catalog import load_catalog
from providers.onprem.offerings import onprem_capacity
from providers.regions import region_catalog

MODELS = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", params_b=8.0, layers=32, kv_heads=8, head_dim=128,
                              attention_heads=32),
    "mistral-7b-eu": ModelSpec("mistral-7b-eu", params_b=7.2, layers=32, kv_heads=8, head_dim=128,
                               attention_heads=32),
    "qwen-2.5-32b-us": ModelSpec("qwen-2.5-32b-us", params_b=32.5, layers=64, kv_heads=8, head_dim=128,
                                 attention_heads=40),
}
ZONES = {"llama-3.1-8b": "global", "mistral-7b-eu": "eu", "qwen-2.5-32b-us": "us"}
DEMAND = {  # client region -> generated tokens/s
    "llama-3.1-8b": {"aws:us-east-1": 3000.0, "gcp:europe-west4": 2000.0, "onprem:tokyo-1": 1500.0},
    "mistral-7b-eu": {"gcp:europe-west4": 2500.0, "onprem:fra-dc1": 1500.0, "aws:eu-central-1": 2000.0},
    "qwen-2.5-32b-us": {"aws:us-east-1": 1500.0, "gcp:us-central1": 1500.0},
}
OPTIONS = InfraOptions(
    control_plane_url="https://control.meridian.example.com",
    endpoint_domain="api.meridian.example.com",
    dns_zone="meridian.example.com",
    global_region="aws:us-east-1",
    router_addresses=("203.0.113.10", "203.0.113.11"),
    kubernetes_sites={"onprem:fra-dc1": KubernetesTarget(config_context="fra-dc1")},
    weights_uris={
        "llama-3.1-8b": "s3://meridian-weights-example/llama-3.1-8b/",
        "mistral-7b-eu": "gs://meridian-weights-example-eu/mistral-7b-eu/",
        "qwen-2.5-32b-us": "s3://meridian-weights-example/qwen-2.5-32b-us/",
    },
)


def example_plan() -> InfraPlan:
    """Solve the example deployment set and turn the plan into infrastructure."""
    catalog = load_catalog()
    regions = region_catalog()
    deployments = [
        Deployment(name=m, shapes=shapes_from_fit(fit_model(spec, catalog.skus)), zone=ZONES[m],
                   demand_tokens_per_s=DEMAND[m], rtt_objective_ms=80.0)
        for m, spec in sorted(MODELS.items())
    ]
    problem = Problem(deployments=deployments, offerings=catalog.offerings, regions=regions,
                      capacity=onprem_capacity())
    result = solve(problem, SolveOptions(time_limit_s=60.0))
    if not result.feasible:
        raise RuntimeError("the example deployment set has no placement: " + "; ".join(result.explanation))
    return infra_plan(result.assignments, ZONES, regions, catalog, OPTIONS, plan_id="example-three-clouds")


def render(plan: InfraPlan) -> str:
    """The plan as the committed file has it."""
    return plan.model_dump_json(indent=2, by_alias=True) + "\n"


def main() -> None:
    # A file argument, not stdout: HiGHS prints its banner on stdout.
    if len(sys.argv) != 2:
        sys.exit("usage: python -m control_plane.example_plan OUT.json")
    text = render(example_plan())
    with open(sys.argv[1], "w", encoding="utf-8") as f:
        f.write(text)


if __name__ == "__main__":
    main()
