import re

from typer.testing import CliRunner

from cli.main import app

runner = CliRunner()
WIDE = {"COLUMNS": "220"}


def run(*args, env=None):
    return runner.invoke(app, ["catalog", "gpus", *args], env={**WIDE, **(env or {})})


def test_gpus_table_lists_skus_with_prices_per_provider(monkeypatch):
    monkeypatch.delenv("MERIDIAN_CP_ONPREM_INVENTORY", raising=False)
    r = run()
    assert r.exit_code == 0, r.output
    for sku in ("H200-141GB", "H100-80GB-SXM", "A100-80GB", "A100-40GB", "L40S-48GB", "L4-24GB", "T4-16GB"):
        assert sku in r.output
    assert "aws $/GPU-h" in r.output and "gcp $/GPU-h" in r.output and "onprem $/GPU-h" in r.output
    h100 = next(line for line in r.output.splitlines() if "H100-80GB-SXM" in line)
    assert "1, 2, 4, 8" in h100 and re.search(r"\$\d+\.\d{3}", h100)
    assert "$1.750" in h100  # default inventory: dgx-h100 at 14 $/h over 8 GPUs
    p100 = next(line for line in r.output.splitlines() if "P100-16GB" in line)
    assert " - " in p100  # not offered on AWS


def test_gpus_table_for_one_provider_and_region():
    r = run("--provider", "aws", "--region", "aws:us-east-1")
    assert r.exit_code == 0, r.output
    assert "aws $/GPU-h" in r.output and "gcp $/GPU-h" not in r.output
    assert "P100-16GB" not in r.output and "H100-80GB-SXM" in r.output


def test_one_sku_lists_its_offerings_cheapest_first():
    r = run("a100 80gb")
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if re.search(r"(aws|gcp|onprem):", line)]
    assert any("p4de.24xlarge" in line for line in rows) and any("a2-ultragpu-8g" in line for line in rows)
    assert any("dgx-a100-640" in line for line in rows)
    per_gpu = [float(line.split("$")[-1].split()[0].replace(",", "")) for line in rows]
    assert per_gpu == sorted(per_gpu)


def test_onprem_inventory_option_and_env(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("sites:\n  - {name: lab-1, latitude: 1, longitude: 2, zones: [eu], hosts: "
                   "[{instance_type: b200-box, sku: B200, gpu_count: 8, count: 1, vcpus: 112,"
                   " memory_gib: 2048, price_per_hour: 20}]}\n")
    r = run("B200", "--onprem-inventory", str(inv))
    assert r.exit_code == 0, r.output
    assert "b200-box" in r.output and "onprem:lab-1" in r.output
    assert "$20.000" in r.output and "$2.500" in r.output
    r = run("--provider", "onprem", env={"MERIDIAN_CP_ONPREM_INVENTORY": str(inv)})
    assert r.exit_code == 0 and "B200" in r.output and "H100-80GB-SXM" not in r.output


def test_bad_input_gives_clear_errors(tmp_path):
    r = run("H100")
    assert r.exit_code == 1 and "ambiguous" in r.output and "H100-80GB-SXM" in r.output
    r = run("MI300X")
    assert r.exit_code == 1 and "not a GPU in the catalog" in r.output
    r = run("--provider", "azure")
    assert r.exit_code == 2 and "unknown provider" in r.output
    r = run("--region", "aws:mars-1")
    assert r.exit_code == 2 and "unknown region" in r.output
    r = run("--onprem-inventory", str(tmp_path / "nope.yaml"))
    assert r.exit_code == 1 and "cannot read on-prem inventory" in r.output
    assert "Traceback" not in r.output


def test_sku_not_offered_says_so():
    r = run("P100", "--provider", "aws")
    assert r.exit_code == 0 and "no offerings of P100-16GB" in r.output


def test_gpus_as_json_and_yaml_are_the_rows_alone():
    import json

    import yaml

    r = run("-o", "json")
    assert r.exit_code == 0, r.output
    skus = {row["name"]: row for row in json.loads(r.stdout)}
    assert skus["H100-80GB-SXM"]["gpu_counts"] == [1, 2, 4, 8]
    assert skus["H100-80GB-SXM"]["per_gpu_hour"]["onprem"] == 1.75
    r = run("a100 80gb", "-o", "yaml")
    assert r.exit_code == 0, r.output
    offerings = yaml.safe_load(r.stdout)
    dgx = next(o for o in offerings if o["instance_type"] == "dgx-a100-640")
    assert (dgx["region"], dgx["gpu_count"], dgx["per_gpu_hour"]) == ("onprem:fra-dc1", 8, 1.0)
    r = run("P100", "--provider", "aws", "-o", "json")
    assert r.exit_code == 0 and json.loads(r.stdout) == [] and "no offerings" in r.stderr
