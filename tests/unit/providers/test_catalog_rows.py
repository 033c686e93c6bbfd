"""Every row of the real AWS/GCP catalog data maps to the right SKU and GPU count.

Expectations are written out by hand here (instance family, or accelerator name + memory,
to SKU), not derived from the normaliser under test.
"""

import csv
import io
import re
from pathlib import Path

import pytest

import providers.aws.offerings as aws
import providers.gcp.offerings as gcp

REPO = Path(__file__).resolve().parents[3]
SHARED_DATA = REPO / ".." / "shared" / "data"
VENDORED = {
    "aws_gpu_vms_p_family.csv": REPO / "providers" / "aws" / "data",
    "aws_gpu_vms_g_family.csv": REPO / "providers" / "aws" / "data",
    "gcp_gpu_attachable.csv": REPO / "providers" / "gcp" / "data",
    "gcp_host_vms.csv": REPO / "providers" / "gcp" / "data",
}
# Row counts as documented in shared/data/README.md.
README_ROWS = {"aws_gpu_vms_p_family.csv": 174, "aws_gpu_vms_g_family.csv": 678,
               "gcp_gpu_attachable.csv": 715, "gcp_host_vms.csv": 359}

# AWS instance family → (SKU, GPU memory in MiB that EC2 reports for it).
AWS_FAMILY = {
    "p3": ("V100-16GB", 16384),
    "p3dn": ("V100-32GB", 32768),
    "p4d": ("A100-40GB", 40960),
    "p4de": ("A100-80GB", 81920),
    "p5": ("H100-80GB-SXM", 81920),
    "p5e": ("H200-141GB", 144384),
    "p5en": ("H200-141GB", 144384),
    "g4dn": ("T4-16GB", 16384),
    "g5": ("A10G-24GB", 22888),
    "g5g": ("T4G-16GB", 16384),
    "g6": ("L4-24GB", 22888),
    "g6e": ("L40S-48GB", 45776),
}
# GCP attachable GPU (accelerator name, MiB) → SKU.
GCP_ACCELERATOR = {
    ("A100", 40960): "A100-40GB",
    ("A100-80GB", 81920): "A100-80GB",
    ("B200", 184320): "B200",
    ("H100", 81920): "H100-80GB-SXM",
    ("H100-MEGA", 81920): "H100-80GB-SXM",
    ("H200", 144384): "H200-141GB",
    ("L4", 24576): "L4-24GB",
    ("P100", 16384): "P100-16GB",
    ("P4", 8192): "P4-8GB",
    ("T4", 16384): "T4-16GB",
    ("V100", 16384): "V100-16GB",
}
# GCP host machine type → (SKU, GPUs), from GCP's accelerator-optimised machine-type tables.
GCP_HOST = {
    "a2-highgpu-1g": ("A100-40GB", 1), "a2-highgpu-2g": ("A100-40GB", 2),
    "a2-highgpu-4g": ("A100-40GB", 4), "a2-highgpu-8g": ("A100-40GB", 8),
    "a2-megagpu-16g": ("A100-40GB", 16),
    "a2-ultragpu-1g": ("A100-80GB", 1), "a2-ultragpu-2g": ("A100-80GB", 2),
    "a2-ultragpu-4g": ("A100-80GB", 4), "a2-ultragpu-8g": ("A100-80GB", 8),
    "a3-highgpu-1g": ("H100-80GB-SXM", 1), "a3-highgpu-2g": ("H100-80GB-SXM", 2),
    "a3-highgpu-4g": ("H100-80GB-SXM", 4), "a3-highgpu-8g": ("H100-80GB-SXM", 8),
    "a3-megagpu-8g": ("H100-80GB-SXM", 8),
    "a3-edgegpu-8g": ("H100-80GB-SXM", 8), "a3-edgegpu-8g-nolssd": ("H100-80GB-SXM", 8),
    "a3-ultragpu-8g": ("H200-141GB", 8), "a3-ultragpu-8g-nolssd": ("H200-141GB", 8),
    "g2-standard-4": ("L4-24GB", 1), "g2-standard-8": ("L4-24GB", 1), "g2-standard-12": ("L4-24GB", 1),
    "g2-standard-16": ("L4-24GB", 1), "g2-standard-32": ("L4-24GB", 1), "g2-standard-24": ("L4-24GB", 2),
    "g2-standard-48": ("L4-24GB", 4), "g2-standard-96": ("L4-24GB", 8),
}


def data_text(name: str) -> str:
    """The real data from ../shared/data when present (CI clones it beside the repo), else vendored."""
    shared = SHARED_DATA / name
    return (shared if shared.exists() else VENDORED[name] / name).read_text(encoding="utf-8")


def rows(name: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data_text(name))))


def gpu_info_mib(gpu_info: str) -> int:
    (mib,) = re.findall(r"'SizeInMiB': (\d+)", gpu_info)
    return int(mib)


@pytest.mark.parametrize("name", sorted(VENDORED))
def test_vendored_copies_are_byte_identical_to_shared(name):
    vendored = (VENDORED[name] / name).read_bytes()
    assert vendored.count(b"\n") == README_ROWS[name] + 1
    shared = SHARED_DATA / name
    if not shared.exists():
        pytest.skip("../shared/data is not beside this checkout")
    assert vendored == shared.read_bytes()


@pytest.mark.parametrize("name", ["aws_gpu_vms_p_family.csv", "aws_gpu_vms_g_family.csv"])
def test_every_aws_row_maps_to_its_sku_and_count(name):
    checked = 0
    for row in rows(name):
        family = row["InstanceType"].split(".")[0]
        expected_sku, expected_mib = AWS_FAMILY[family]
        assert gpu_info_mib(row["GpuInfo"]) == expected_mib, row
        assert aws.row_sku(row) == (expected_sku, int(float(row["AcceleratorCount"]))), row
        checked += 1
    assert checked == README_ROWS[name] == len(data_text(name).splitlines()) - 1


def test_every_gcp_attachable_row_maps_to_its_sku_and_count():
    name = "gcp_gpu_attachable.csv"
    checked = 0
    for row in rows(name):
        assert row["InstanceType"] == ""
        expected = GCP_ACCELERATOR[(row["AcceleratorName"], gpu_info_mib(row["GpuInfo"]))]
        assert gcp.row_sku(row) == (expected, int(row["AcceleratorCount"])), row
        checked += 1
    assert checked == README_ROWS[name] == len(data_text(name).splitlines()) - 1


def test_every_gcp_host_row_maps_to_its_sku_and_count():
    name = "gcp_host_vms.csv"
    checked = 0
    for row in rows(name):
        assert gcp.row_sku(row) == GCP_HOST[row["InstanceType"]], row
        checked += 1
    assert checked == README_ROWS[name] == len(data_text(name).splitlines()) - 1
    assert {r["InstanceType"] for r in rows(name)} == set(GCP_HOST)
