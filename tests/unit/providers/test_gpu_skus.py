import pytest

from providers.skus import SKUS, UnknownGpuError, normalise_gpu_name, sku_for_instance_type


def sku(name, memory_mib=None, instance_type=None):
    return normalise_gpu_name(name, memory_mib, instance_type).name


@pytest.mark.parametrize("name", sorted(SKUS))
def test_canonical_names_map_to_themselves_in_any_case(name):
    assert sku(name) == name
    assert sku(name.lower()) == name
    assert sku(name.replace("-", " ")) == name
    assert sku(name.replace("-", "_").lower()) == name


@pytest.mark.parametrize(("spelling", "memory_mib", "instance_type", "expected"), [
    # A100 80 GB, every way clouds write it.
    ("A100-80GB", None, None, "A100-80GB"),
    ("A100 80GB", None, None, "A100-80GB"),
    ("a100-80gb", None, None, "A100-80GB"),
    ("A100_80GB", None, None, "A100-80GB"),
    ("  a100   80GB ", None, None, "A100-80GB"),
    ("A100", 81920, None, "A100-80GB"),
    ("p4de.24xlarge", None, None, "A100-80GB"),
    ("a2-ultragpu-8g", None, None, "A100-80GB"),
    ("A100", None, "p4de.24xlarge", "A100-80GB"),
    ("A100", 81920, "p4de.24xlarge", "A100-80GB"),  # the p4de quirk: GpuInfo says "A100"
    ("A100-80GB", 81920, "p4de.24xlarge", "A100-80GB"),
    ("nvidia-a100-80gb", None, None, "A100-80GB"),  # GCP accelerator type
    ("NVIDIA A100-SXM4-80GB", None, None, "A100-80GB"),  # nvidia-smi
    # A100 40 GB.
    ("A100", 40960, None, "A100-40GB"),
    ("A100", None, "p4d.24xlarge", "A100-40GB"),
    ("A100", None, "a2-highgpu-8g", "A100-40GB"),
    ("A100", None, "a2-megagpu-16g", "A100-40GB"),
    ("nvidia-tesla-a100", 40960, None, "A100-40GB"),
    ("A100-40GB", None, None, "A100-40GB"),
    # H100.
    ("H100", None, "p5.48xlarge", "H100-80GB-SXM"),
    ("H100", 81920, "a3-highgpu-8g", "H100-80GB-SXM"),
    ("H100-MEGA", None, None, "H100-80GB-SXM"),
    ("H100-MEGA", 81920, "a3-megagpu-8g", "H100-80GB-SXM"),
    ("H100", None, "a3-edgegpu-8g-nolssd", "H100-80GB-SXM"),
    ("H100-SXM", None, None, "H100-80GB-SXM"),
    ("h100 sxm5", None, None, "H100-80GB-SXM"),
    ("NVIDIA H100 80GB HBM3", None, None, "H100-80GB-SXM"),
    ("H100-PCIe", None, None, "H100-80GB-PCIe"),
    ("H100 PCIe", None, None, "H100-80GB-PCIe"),
    ("h100_pcie", 81559, None, "H100-80GB-PCIe"),
    # H200, B200.
    ("H200", None, "p5e.48xlarge", "H200-141GB"),
    ("H200", 144384, "p5en.48xlarge", "H200-141GB"),
    ("H200", None, "a3-ultragpu-8g", "H200-141GB"),
    ("H200", None, None, "H200-141GB"),
    ("B200", 184320, None, "B200"),
    ("p6-b200.48xlarge", None, None, "B200"),
    # V100 16 vs 32 GB.
    ("V100", 16384, None, "V100-16GB"),
    ("V100", None, "p3.2xlarge", "V100-16GB"),
    ("V100-32GB", None, None, "V100-32GB"),
    ("V100-32GB", 32768, "p3dn.24xlarge", "V100-32GB"),
    ("V100", 32768, None, "V100-32GB"),
    # Smaller parts; memory as the clouds report it (a few percent under the marketing size).
    ("T4", 16384, None, "T4-16GB"),
    ("nvidia-tesla-t4", None, None, "T4-16GB"),
    ("T4g", 16384, "g5g.xlarge", "T4G-16GB"),
    ("t4g", None, None, "T4G-16GB"),
    ("L4", 22888, "g6.xlarge", "L4-24GB"),
    ("L4", 24576, "g2-standard-96", "L4-24GB"),
    ("L40S", 45776, "g6e.xlarge", "L40S-48GB"),
    ("A10G", 22888, "g5.xlarge", "A10G-24GB"),
    ("P100", 16384, None, "P100-16GB"),
    ("P4", 8192, None, "P4-8GB"),
    ("", None, "p5.48xlarge", "H100-80GB-SXM"),  # no name: the instance type alone
])
def test_spellings(spelling, memory_mib, instance_type, expected):
    assert sku(spelling, memory_mib, instance_type) == expected


@pytest.mark.parametrize(("spelling", "memory_mib", "instance_type", "message"), [
    ("MI300X", None, None, "not a GPU in the catalog"),
    ("A10", None, None, "not a GPU in the catalog"),  # the A10G's sibling is not in the catalog
    ("RTX 4090", None, None, "not a GPU in the catalog"),
    ("", None, None, "empty"),
    ("", None, "n1-standard-8", "empty"),
    ("H100 NVL", None, None, "'NVL'"),
    ("A100-PCIE-40GB", None, None, "no catalog SKU of A100"),  # catalog's A100s are SXM (NVLink)
    ("A100", None, None, "ambiguous"),  # 40 or 80 GB: never guessed
    ("H100", None, None, "ambiguous"),  # SXM or PCIe
    ("H100-80GB", 81920, None, "ambiguous"),
    ("V100", None, None, "ambiguous"),
    ("A100", 61440, None, "60.0 GiB"),
    ("A100-80GB", 40960, None, "no catalog SKU"),
    ("A100", 81920, "p4d.24xlarge", "contradicts"),
    ("A100-40GB", None, "a2-ultragpu-1g", "contradicts"),
    ("T4", None, "g5g.xlarge", "contradicts"),
    ("H100-PCIe", None, "p5.48xlarge", "contradicts"),
])
def test_unknown_or_ambiguous_names_raise(spelling, memory_mib, instance_type, message):
    with pytest.raises(UnknownGpuError, match=message):
        normalise_gpu_name(spelling, memory_mib, instance_type)


def test_unknown_gpu_error_is_a_value_error():
    assert issubclass(UnknownGpuError, ValueError)


@pytest.mark.parametrize(("instance_type", "expected"), [
    ("p5.48xlarge", "H100-80GB-SXM"), ("g6e.12xlarge", "L40S-48GB"), ("a3-ultragpu-8g-nolssd", "H200-141GB"),
    ("g2-standard-4", "L4-24GB"), ("n1-standard-8", None), ("dgx-h100", None), ("m5.large", None),
])
def test_instance_family_sku(instance_type, expected):
    found = sku_for_instance_type(instance_type)
    assert (found.name if found else None) == expected
