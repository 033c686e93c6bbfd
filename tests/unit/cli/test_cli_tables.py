"""Tables stay whole at 80 columns (cells fold, nothing is cut to "…"), each value sits under its
own header, and byte counts read as KiB/MiB/GiB."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from rich.console import Console
from rich.table import Table

from cli.admin_views import deployments_table, keys_table, models_table, tenants_table
from cli.status_view import status_table
from meridian.admin_api import ApiKeyView, ModelView, Scope, TenantView
from meridian.cli_format import human_bytes, human_params
from meridian.contracts import DeploymentView, NodeLoad, NodeStatus, NodeView, PlacementSpec
from providers.catalog import load_catalog
from providers.catalog_view import gpus_table, sku_offerings_table
from providers.regions import region_catalog

NOW = datetime(2026, 11, 26, 12, 0, tzinfo=UTC)


def columns(table: Table, width: int = 80) -> tuple[str, dict[str, str]]:
    """The rendered text, and each column's cells run together (header → its cells' text, spaces
    dropped): a value folded over several lines reads whole, and only under its own header."""
    console = Console(width=width, record=True, color_system=None)
    console.print(table)
    text = console.export_text()
    lines = text.splitlines()
    head_end = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    head_start = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    body_end = next(i for i, line in enumerate(lines) if line.startswith("└"))

    def split(line: str) -> list[str]:
        return [cell.replace(" ", "") for cell in line[1:-1].replace("┃", "│").split("│")]

    headers = ["".join(parts) for parts in zip(*(split(line) for line in lines[head_start + 1:head_end]), strict=True)]
    cells = ["".join(parts) for parts in zip(*(split(line) for line in lines[head_end + 1:body_end]), strict=True)]
    assert all(len(line) <= width for line in lines)
    return text, dict(zip(headers, cells, strict=True))


def joined(values: list[str]) -> str:
    return "".join(v.replace(" ", "") for v in values)


def test_one_skus_offerings_show_each_value_under_its_header():
    """The bug: the GPU count was printed in the Region column and the region in the GPUs column."""
    catalog = load_catalog()
    offerings = catalog.for_sku("A100-80GB")
    for width in (80, 200):
        text, cols = columns(sku_offerings_table(catalog, "A100-80GB"), width)
        assert "…" not in text
        assert cols["Region"] == joined([o.region for o in offerings])
        assert cols["GPUs"] == joined([str(o.gpu_count) for o in offerings])
        assert cols["Provider"] == joined([o.provider for o in offerings])
        assert cols["Instancetype"] == joined([o.instance_type for o in offerings])


def test_the_sku_table_keeps_every_price_at_80_columns():
    catalog = load_catalog()
    text, cols = columns(gpus_table(catalog))
    assert "…" not in text
    offered = [s.name for s in catalog.skus.values() if s.name in {o.sku for o in catalog.offerings}]
    assert cols["SKU"] == joined(offered)
    assert "awsGPU-h" not in cols and {"aws$/GPU-h", "gcp$/GPU-h", "onprem$/GPU-h"} <= set(cols)


def _node(node_id: str, region: str, status: NodeStatus) -> NodeView:
    return NodeView(
        node_id=node_id, region=region, provider=region.split(":")[0], url="http://h:1",
        models=["meta-llama/Llama-3.1-8B-Instruct"], engine="vllm", version="0.1.0", status=status,
        load=NodeLoad(running=12, waiting=3, kv_cache_usage=0.5, lora_adapters=["support-bot"]),
        registered_at=NOW - timedelta(minutes=5), last_heartbeat=NOW - timedelta(seconds=2),
    )


def test_the_status_table_folds_long_region_and_node_names_at_80_columns():
    nodes = [_node("node-europe-west4-a-0123456789", "gcp:europe-west4", NodeStatus.READY),
             _node("node-ap-southeast-2-b-9876543210", "aws:ap-southeast-2", NodeStatus.DRAINING)]
    text, cols = columns(status_table(list(region_catalog().values()), nodes, now=NOW))
    assert "…" not in text
    assert cols["Region"] == joined(["aws:ap-southeast-2", "gcp:europe-west4"])
    assert cols["Node"] == joined([nodes[1].node_id, nodes[0].node_id])
    assert cols["Health"] == "drainingready"
    assert cols["Models"] == joined(["meta-llama/Llama-3.1-8B-Instruct, +support-bot"] * 2)


def test_the_admin_tables_keep_every_value_at_80_columns():
    key = ApiKeyView(id="key_0123456789abcdef", name="ci-pipeline-europe", tenant="acme-corporation",
                     zone="eu", scopes=[Scope.INFERENCE, Scope.READ_ONLY], models=["tiny-llama"],
                     key_prefix="mrd_abcdef", created_at=NOW, revoked_at=None)
    text, cols = columns(keys_table([key]))
    assert "…" not in text and cols["ID"] == key.id and cols["Tenant"] == key.tenant
    assert cols["Scopes"] == "inference,read-only" and cols["Prefix"] == key.key_prefix
    tenant = TenantView(name="acme-corporation-europe", zone="eu", models=None, requests_per_minute=600,
                        tokens_per_minute=1_000_000, cache_group="acme-shared", priority=-10, weight=0.25,
                        resource_version=3, created_at=NOW, updated_at=NOW)
    text, cols = columns(tenants_table([tenant]))
    assert "…" not in text and cols["Tenant"] == tenant.name and cols["Tokens/min"] == "1,000,000"
    assert cols["Priority"] == "-10" and cols["Weight"] == "0.25"
    model = ModelView(name="meta-llama/Llama-3.1-70B-Instruct", params_b=70.6, layers=80, kv_heads=8,
                      head_dim=128, quantization="fp8", kv_cache_dtype="fp8", attention_heads=64,
                      hidden_size=8192, max_context=131072, target_concurrent_seqs=16,
                      weights_uri="s3://meridian-weights-eu/llama-3.1-70b-instruct", resource_version=1,
                      created_at=NOW, updated_at=NOW)
    text, cols = columns(models_table([model]))
    assert "…" not in text and cols["Model"] == model.name and cols["Weights"] == model.weights_uri
    assert cols["Params"] == "71B" and cols["Context"] == "131,072"
    deployment = DeploymentView(model=model.name, zone="eu", min_replicas=1, max_replicas=4, desired_replicas=2,
                                placement=PlacementSpec(replicas={"gcp:europe-west4": 1, "aws:eu-central-1": 1}),
                                created_at=NOW, updated_at=NOW)
    text, cols = columns(deployments_table([deployment]))
    assert "…" not in text and cols["Model"] == model.name
    assert cols["Regions"] == "aws:eu-central-1×1,gcp:europe-west4×1"


@pytest.mark.parametrize(("n", "text"), [
    (None, "-"), (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (5 * 1024**2 + 1, "5.0 MiB"), (16 * 1024**3, "16.0 GiB"), (3 * 1024**4, "3.0 TiB"), (2 * 1024**6, "2048.0 PiB"),
])
def test_human_bytes(n, text):
    assert human_bytes(n) == text


@pytest.mark.parametrize(("params_b", "text"), [
    (0.134515, "135M"), (8.03, "8B"), (1.24, "1.2B"), (70.6, "71B"), (0.5, "500M"), (0.9996, "1B"),
    (405, "405B"), (1e-6, "1K"), (1.5e-6, "1.5K"), (1200, "1.2T"),
])
def test_parameter_counts_read_as_model_cards_write_them(params_b, text):
    assert human_params(params_b) == text
