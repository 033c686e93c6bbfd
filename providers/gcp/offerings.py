"""GCP GPU offerings, from SkyPilot's catalog rows vendored in `data/`.

Two kinds of row: host VMs (`gcp_host_vms.csv`: a2-*, a3-*, g2-*, accelerator fields
empty) whose GPUs are fixed by the machine type, and attachable GPUs
(`gcp_gpu_attachable.csv`: no instance type, priced for the GPUs alone). An
accelerator-optimised offering costs host + its GPUs. GPUs that attach to general
purpose n1-* hosts (T4, V100, P4, P100) have no host row in the data; they become
offerings named like `n1+4xT4` priced for the GPUs only, with no vCPUs or memory.
"""

from __future__ import annotations

import ast
import csv
import io
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib.resources import files

from providers.offerings import CatalogDataError, Offering, parse_price
from providers.skus import UnknownGpuError, normalise_gpu_name

HOST_FILE = "gcp_host_vms.csv"
ATTACHABLE_FILE = "gcp_gpu_attachable.csv"

Row = Mapping[str, str]

# The machine family each GCP accelerator name runs on (GCP's GPU machine-type docs).
# Families other than n1 have the GPUs built in; n1 hosts take 1-8 attached GPUs.
N1 = "n1"
ACCELERATOR_FAMILY = {
    "A100": "a2-highgpu",  # also a2-megagpu-16g
    "A100-80GB": "a2-ultragpu",
    "H100": "a3-highgpu",  # also a3-edgegpu
    "H100-MEGA": "a3-megagpu",
    "H200": "a3-ultragpu",
    "B200": "a4-highgpu",
    "L4": "g2-standard",
    "T4": N1,
    "V100": N1,
    "P4": N1,
    "P100": N1,
}

# GPUs per g2-standard size: not in the name, from GCP's G2 machine-type table.
_G2_L4_COUNT = {4: 1, 8: 1, 12: 1, 16: 1, 32: 1, 24: 2, 48: 4, 96: 8}
# (machine-type pattern, accelerator name whose attachable row prices its GPUs).
_HOST_ACCELERATOR = (
    (re.compile(r"^a2-(highgpu|megagpu)-(?P<n>\d+)g$"), "A100"),
    (re.compile(r"^a2-ultragpu-(?P<n>\d+)g$"), "A100-80GB"),
    (re.compile(r"^a3-(highgpu|edgegpu)-(?P<n>\d+)g(-nolssd)?$"), "H100"),
    (re.compile(r"^a3-megagpu-(?P<n>\d+)g$"), "H100-MEGA"),
    (re.compile(r"^a3-ultragpu-(?P<n>\d+)g(-nolssd)?$"), "H200"),
    (re.compile(r"^a4-highgpu-(?P<n>\d+)g$"), "B200"),
)


@dataclass(frozen=True, slots=True)
class _ZoneOffer:
    """One zone's row of an offering, before the zones of a region are merged."""

    instance_type: str
    region: str
    zone: str
    sku: str
    gpu_count: int
    vcpus: float
    memory_gib: float
    price: float
    spot: float | None


def read_rows(file_name: str) -> list[dict[str, str]]:
    """The rows of one vendored GCP catalog CSV (works from an installed package)."""
    text = (files("providers.gcp") / "data" / file_name).read_text(encoding="utf-8")
    return list(csv.DictReader(io.StringIO(text)))


def _where(row: Row) -> str:
    what = row.get("InstanceType") or f"{row.get('AcceleratorName')} x {row.get('AcceleratorCount')}"
    return f"GCP row {what} in {row.get('AvailabilityZone')}"


def _price(row: Row, column: str) -> float | None:
    return parse_price(row.get(column), _where(row), column)


_ATTACHED = re.compile(rf"^{N1}\+(?P<count>\d+)x(?P<accelerator>[A-Za-z0-9-]+)$")


def attached_accelerator(instance_type: str) -> tuple[str, int] | None:
    """(GCP accelerator name, count) of an attached-GPU offering ("n1+4xT4" → ("T4", 4)); None for
    a machine type."""
    m = _ATTACHED.match(instance_type)
    return (m.group("accelerator"), int(m.group("count"))) if m else None


def host_accelerator(instance_type: str) -> tuple[str, int]:
    """(GCP accelerator name, count) a host machine type carries, e.g. a3-highgpu-8g → ("H100", 8)."""
    if (m := re.fullmatch(r"g2-standard-(\d+)", instance_type)) and int(m.group(1)) in _G2_L4_COUNT:
        return "L4", _G2_L4_COUNT[int(m.group(1))]
    for pattern, accelerator in _HOST_ACCELERATOR:
        if m := pattern.match(instance_type):
            return accelerator, int(m.group("n"))
    raise CatalogDataError(f"GCP machine type {instance_type!r} carries no GPU known to Meridian")


def row_sku(row: Row) -> tuple[str, int]:
    """(canonical SKU name, GPU count) of a host-VM row (from its machine type) or an attachable-GPU row."""
    instance_type = (row.get("InstanceType") or "").strip()
    try:
        if instance_type:
            accelerator, count = host_accelerator(instance_type)
            return normalise_gpu_name(accelerator, instance_type=instance_type).name, count
        accelerator = row["AcceleratorName"]
        family = ACCELERATOR_FAMILY.get(accelerator)
        if family is None:
            raise CatalogDataError(f"{_where(row)}: accelerator {accelerator!r} has no known machine family")
        # GpuInfo is written as a Python literal; literal_eval never runs code.
        (gpu,) = ast.literal_eval(row["GpuInfo"])["Gpus"]
        memory_mib = int(gpu["MemoryInfo"]["SizeInMiB"])
        sku = normalise_gpu_name(accelerator, memory_mib, None if family == N1 else family)
        return sku.name, int(row["AcceleratorCount"])
    except UnknownGpuError as e:
        raise CatalogDataError(f"{_where(row)}: {e}") from e
    except (KeyError, ValueError, TypeError, SyntaxError) as e:
        raise CatalogDataError(f"{_where(row)}: unreadable row: {e}") from None


def _host_zone_offers(hosts: Iterable[Row], gpu_rows: Mapping[tuple[str, int, str], Row]) -> list[_ZoneOffer]:
    out = []
    for row in hosts:
        instance_type = row["InstanceType"]
        accelerator, count = host_accelerator(instance_type)
        gpus = gpu_rows.get((accelerator, count, row["AvailabilityZone"]))
        if gpus is None:
            continue  # the zone has the host type but no price for its GPUs: not orderable as a GPU VM
        host_price, gpu_price = _price(row, "Price"), _price(gpus, "Price")
        if host_price is None or gpu_price is None:
            continue
        host_spot, gpu_spot = _price(row, "SpotPrice"), _price(gpus, "SpotPrice")
        sku, _ = row_sku(row)
        out.append(_ZoneOffer(
            instance_type=instance_type, region=row["Region"], zone=row["AvailabilityZone"], sku=sku,
            gpu_count=count, vcpus=float(row["vCPUs"]), memory_gib=float(row["MemoryGiB"]),
            price=host_price + gpu_price,
            spot=host_spot + gpu_spot if host_spot is not None and gpu_spot is not None else None,
        ))
    return out


def _n1_zone_offers(gpu_rows: Iterable[Row]) -> list[_ZoneOffer]:
    out = []
    for row in gpu_rows:
        if ACCELERATOR_FAMILY.get(row["AcceleratorName"]) != N1:
            continue  # built into a2/a3/a4/g2 machine types: priced with their host rows
        price = _price(row, "Price")
        if price is None:
            continue
        sku, count = row_sku(row)
        out.append(_ZoneOffer(
            # The n1 host VM is not in the data: vCPUs/memory unknown, price is the GPUs' alone.
            instance_type=f"{N1}+{count}x{row['AcceleratorName']}", region=row["Region"],
            zone=row["AvailabilityZone"], sku=sku, gpu_count=count, vcpus=0.0, memory_gib=0.0,
            price=price, spot=_price(row, "SpotPrice"),
        ))
    return out


def _merge_zones(zone_offers: Iterable[_ZoneOffer]) -> list[Offering]:
    """One offering per (instance type, region): cheapest zone's on-demand and spot prices, zones listed."""
    groups: dict[tuple[str, str], list[_ZoneOffer]] = defaultdict(list)
    for z in zone_offers:
        groups[(z.instance_type, z.region)].append(z)
    out = []
    for (instance_type, region), group in sorted(groups.items()):
        first = group[0]
        spots = [z.spot for z in group if z.spot is not None]
        out.append(Offering(
            provider="gcp", region=f"gcp:{region}", instance_type=instance_type, sku=first.sku,
            gpu_count=first.gpu_count, vcpus=first.vcpus, memory_gib=first.memory_gib,
            price_per_hour=round(min(z.price for z in group), 6),
            spot_price_per_hour=round(min(spots), 6) if spots else None,
            availability_zones=tuple(sorted({z.zone for z in group})),
        ))
    return out


def build_offerings(hosts: Iterable[Row], gpu_rows: Iterable[Row]) -> list[Offering]:
    """GCP offerings from host-VM rows and attachable-GPU rows (see the module docstring)."""
    gpu_rows = list(gpu_rows)
    by_zone: dict[tuple[str, int, str], Row] = {}
    for r in gpu_rows:
        key = (r["AcceleratorName"], int(r["AcceleratorCount"]), r["AvailabilityZone"])
        if key in by_zone:
            raise CatalogDataError(f"{_where(r)}: listed twice")
        by_zone[key] = r
    return _merge_zones([*_host_zone_offers(hosts, by_zone), *_n1_zone_offers(gpu_rows)])


def offerings() -> list[Offering]:
    """Every GCP GPU offering in the vendored catalog."""
    return build_offerings(read_rows(HOST_FILE), read_rows(ATTACHABLE_FILE))
