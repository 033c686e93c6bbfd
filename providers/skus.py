"""Canonical GPU SKUs: the one vocabulary placement works in, whatever a cloud calls the part.

Figures are per GPU, from the vendors' datasheets: memory as the clouds report it (GiB),
dense (non-sparse) bf16 tensor TFLOP/s (fp16 for parts without bf16), HBM/GDDR
bandwidth in GB/s, and the GPU-to-GPU link inside one host.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuSku:
    """One GPU part, as placement and model fit see it."""

    name: str
    memory_gib: float
    bf16_tflops: float
    hbm_gbps: float
    # "nvlink" parts talk to each other at interconnect_gbps inside a host; "pcie" ones
    # go through the host's PCIe switch (tensor parallelism across them is slower).
    interconnect: str
    interconnect_gbps: float


# The canonical table. Names say part, memory and (where two form factors differ in
# speed) the form factor, so that "H100" alone is never ambiguous.
SKUS: dict[str, GpuSku] = {
    s.name: s
    for s in (
        GpuSku("B200", 180.0, 2250.0, 8000.0, "nvlink", 1800.0),
        GpuSku("H200-141GB", 141.0, 989.0, 4800.0, "nvlink", 900.0),
        GpuSku("H100-80GB-SXM", 80.0, 989.0, 3350.0, "nvlink", 900.0),
        GpuSku("H100-80GB-PCIe", 80.0, 756.0, 2000.0, "pcie", 128.0),
        GpuSku("A100-80GB", 80.0, 312.0, 2039.0, "nvlink", 600.0),
        GpuSku("A100-40GB", 40.0, 312.0, 1555.0, "nvlink", 600.0),
        GpuSku("L40S-48GB", 44.7, 362.0, 864.0, "pcie", 64.0),
        GpuSku("L4-24GB", 22.4, 121.0, 300.0, "pcie", 64.0),
        GpuSku("A10G-24GB", 22.4, 70.0, 600.0, "pcie", 64.0),
        GpuSku("T4-16GB", 16.0, 65.0, 320.0, "pcie", 32.0),
        GpuSku("T4G-16GB", 16.0, 65.0, 320.0, "pcie", 32.0),
        GpuSku("V100-16GB", 16.0, 125.0, 900.0, "nvlink", 300.0),
        GpuSku("V100-32GB", 32.0, 125.0, 900.0, "nvlink", 300.0),
        GpuSku("P100-16GB", 16.0, 18.7, 732.0, "pcie", 32.0),
        GpuSku("P4-8GB", 8.0, 5.5, 192.0, "pcie", 16.0),
    )
}


class UnknownGpuError(ValueError):
    """A GPU name (with its memory and instance type) that matches no catalog SKU, or more than one."""


# Instance families whose GPUs are fixed by the family: the instance type alone names the part.
# Clouds' GPU names are vaguer than this ("A100" on both p4d and p4de, "H100" on p5 and a3).
_AWS_FAMILY_SKU = {
    "p3": "V100-16GB",
    "p3dn": "V100-32GB",
    "p4d": "A100-40GB",
    "p4de": "A100-80GB",
    "p5": "H100-80GB-SXM",
    "p5e": "H200-141GB",
    "p5en": "H200-141GB",
    "p6-b200": "B200",
    "g4dn": "T4-16GB",
    "g5": "A10G-24GB",
    "g5g": "T4G-16GB",
    "g6": "L4-24GB",
    "g6e": "L40S-48GB",
}
_GCP_FAMILY_SKU = {
    "a2-highgpu": "A100-40GB",
    "a2-megagpu": "A100-40GB",
    "a2-ultragpu": "A100-80GB",
    "a3-highgpu": "H100-80GB-SXM",
    "a3-megagpu": "H100-80GB-SXM",
    "a3-edgegpu": "H100-80GB-SXM",
    "a3-ultragpu": "H200-141GB",
    "a4-highgpu": "B200",
    "g2-standard": "L4-24GB",
}
_GCP_FAMILY_RE = re.compile(r"^(" + "|".join(map(re.escape, _GCP_FAMILY_SKU)) + r")(-|$)")

# Words that add nothing to the part's identity ("NVIDIA Tesla T4", "nvidia-tesla-a100").
_NOISE_TOKENS = frozenset({"NVIDIA", "TESLA"})
# Form-factor words and the interconnect they imply. MEGA is GCP's H100 on a3-megagpu (SXM);
# HBM3 is what nvidia-smi calls the SXM H100, HBM2E the PCIe one.
_FORM_TOKENS = {
    "SXM": "nvlink", "SXM2": "nvlink", "SXM4": "nvlink", "SXM5": "nvlink", "MEGA": "nvlink", "HBM3": "nvlink",
    "PCIE": "pcie", "HBM2E": "pcie",
}
_MEMORY_TOKEN = re.compile(r"^(\d+)G(I?B)?$")
# Clouds and drivers report a part's memory a few percent under its marketing size
# (an L4 "24GB" is 22888 MiB on AWS, a T4 15360 MiB under nvidia-smi).
_MEMORY_TOLERANCE = 0.12


def sku_for_instance_type(instance_type: str) -> GpuSku | None:
    """The SKU an instance type's family always carries (p5.48xlarge, a2-ultragpu-8g), or None when the
    family is not tied to one GPU (n1-*, on-prem host classes) or unknown."""
    it = instance_type.strip().lower()
    if "." in it:
        name = _AWS_FAMILY_SKU.get(it.split(".", 1)[0])
    else:
        m = _GCP_FAMILY_RE.match(it)
        name = _GCP_FAMILY_SKU[m.group(1)] if m else None
    return SKUS[name] if name else None


def _nominal_gb(sku: GpuSku) -> float:
    """Marketing memory size ("80GB" in the name), which spellings and reported sizes are compared to."""
    m = re.search(r"-(\d+)GB", sku.name)
    return float(m.group(1)) if m else sku.memory_gib


def _part(sku: GpuSku) -> str:
    return sku.name.split("-", 1)[0].upper()


def normalise_gpu_name(name: str, memory_mib: int | None = None, instance_type: str | None = None) -> GpuSku:
    """The canonical SKU for any spelling of a GPU: `A100 80GB`, `a100_80gb`, `A100` with 81920 MiB or on
    p4de, an instance type such as `a2-ultragpu-8g`; raises UnknownGpuError rather than guess."""
    spelled = name.strip()
    # A name that is itself an instance type ("p4de.24xlarge") is as good as the GPU's name.
    if instance_type is None and spelled and (by_instance := sku_for_instance_type(spelled)) is not None:
        instance_type, spelled = spelled, _part(by_instance)
    elif not spelled and instance_type and (by_instance := sku_for_instance_type(instance_type)) is not None:
        spelled = _part(by_instance)
    where = f"GPU {name!r}" + (f" with {memory_mib} MiB" if memory_mib is not None else "") + (
        f" on {instance_type}" if instance_type else "")

    tokens = [t for t in re.split(r"[\s_\-]+", spelled.upper()) if t and t not in _NOISE_TOKENS]
    if not tokens:
        raise UnknownGpuError(f"{where}: empty GPU name")
    part, words = tokens[0], tokens[1:]
    candidates = [s for s in SKUS.values() if _part(s) == part]
    if not candidates:
        parts = ", ".join(sorted({_part(s) for s in SKUS.values()}))
        raise UnknownGpuError(f"{where}: {part} is not a GPU in the catalog (known parts: {parts})")

    for word in words:
        if (mem := _MEMORY_TOKEN.match(word)) is not None:
            candidates = [s for s in candidates if _nominal_gb(s) == float(mem.group(1))]
        elif word in _FORM_TOKENS:
            candidates = [s for s in candidates if s.interconnect == _FORM_TOKENS[word]]
        else:
            raise UnknownGpuError(f"{where}: {word!r} names no memory size or form factor of a catalog GPU")
        if not candidates:
            raise UnknownGpuError(f"{where}: no catalog SKU of {part} matches {word!r}")

    if memory_mib is not None:
        gib = memory_mib / 1024
        candidates = [s for s in candidates
                      if abs(gib - _nominal_gb(s)) <= _MEMORY_TOLERANCE * _nominal_gb(s)]
        if not candidates:
            raise UnknownGpuError(f"{where}: no catalog SKU of {part} has {gib:.1f} GiB")

    implied = sku_for_instance_type(instance_type) if instance_type else None
    if implied is not None:
        if implied in candidates:
            return implied
        raise UnknownGpuError(
            f"{where}: {instance_type} carries {implied.name}, which the name or memory contradicts")
    if len(candidates) > 1:
        names = ", ".join(s.name for s in candidates)
        raise UnknownGpuError(
            f"{where} is ambiguous: it could be {names}; name the SKU or give the instance type")
    return candidates[0]
