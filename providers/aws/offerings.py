"""AWS GPU offerings, from the P- and G-family rows of SkyPilot's catalog vendored in `data/`.

The CSVs hold one row per availability zone; rows that differ only by AZ become one
`Offering` per (instance type, region).
"""

from __future__ import annotations

import ast
import csv
import io
from collections import defaultdict
from collections.abc import Iterable, Mapping
from importlib.resources import files

from providers.offerings import CatalogDataError, Offering, parse_price
from providers.skus import UnknownGpuError, normalise_gpu_name

DATA_FILES = ("aws_gpu_vms_p_family.csv", "aws_gpu_vms_g_family.csv")

Row = Mapping[str, str]


def read_rows(file_name: str) -> list[dict[str, str]]:
    """The rows of one vendored AWS catalog CSV (works from an installed package)."""
    text = (files("providers.aws") / "data" / file_name).read_text(encoding="utf-8")
    return list(csv.DictReader(io.StringIO(text)))


def _where(row: Row) -> str:
    return f"AWS row {row.get('InstanceType')} in {row.get('AvailabilityZone')}"


def _price(row: Row, column: str) -> float | None:
    return parse_price(row.get(column), _where(row), column)


def row_sku(row: Row) -> tuple[str, int]:
    """(canonical SKU name, GPUs per instance) of one AWS catalog row, read from its GpuInfo."""
    try:
        # GpuInfo is EC2's structure written as a Python literal; literal_eval never runs code.
        info = ast.literal_eval(row["GpuInfo"])
        (gpu,) = info["Gpus"]  # one GPU model per instance type; several would be a new kind of row
        name, count, memory_mib = str(gpu["Name"]), int(gpu["Count"]), int(gpu["MemoryInfo"]["SizeInMiB"])
    except (KeyError, ValueError, TypeError, SyntaxError) as e:
        raise CatalogDataError(f"{_where(row)}: unreadable GpuInfo {row.get('GpuInfo')!r}: {e}") from None
    try:
        sku = normalise_gpu_name(name, memory_mib, row["InstanceType"])
        # SkyPilot's own name for the accelerator must agree with EC2's description.
        listed = normalise_gpu_name(row["AcceleratorName"], memory_mib, row["InstanceType"])
    except UnknownGpuError as e:
        raise CatalogDataError(f"{_where(row)}: {e}") from e
    if listed != sku or float(row["AcceleratorCount"]) != count:
        raise CatalogDataError(f"{_where(row)}: AcceleratorName/Count {row['AcceleratorName']} x "
                               f"{row['AcceleratorCount']} disagree with GpuInfo {name} x {count}")
    return sku.name, count


def aggregate(rows: Iterable[Row]) -> list[Offering]:
    """One offering per (instance type, region): its AZs, the on-demand price, the cheapest AZ's spot."""
    groups: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for row in rows:
        groups[(row["InstanceType"], row["Region"])].append(row)
    out = []
    for (instance_type, region), group in sorted(groups.items()):
        skus = {row_sku(r) for r in group}
        shapes = {(float(r["vCPUs"]), float(r["MemoryGiB"])) for r in group}
        if len(skus) != 1 or len(shapes) != 1:
            raise CatalogDataError(f"AWS {instance_type} in {region}: AZ rows disagree on GPUs or shape")
        (sku, count), (vcpus, memory_gib) = skus.pop(), shapes.pop()
        prices = [p for r in group if (p := _price(r, "Price")) is not None]
        spots = [p for r in group if (p := _price(r, "SpotPrice")) is not None]
        out.append(Offering(
            provider="aws", region=f"aws:{region}", instance_type=instance_type, sku=sku, gpu_count=count,
            vcpus=vcpus, memory_gib=memory_gib,
            price_per_hour=min(prices) if prices else None,
            spot_price_per_hour=min(spots) if spots else None,
            # p4de lists some AZs twice (GpuInfo naming the GPU "A100" and "A100-80GB").
            availability_zones=tuple(sorted({r["AvailabilityZone"] for r in group})),
        ))
    return out


def offerings() -> list[Offering]:
    """Every AWS GPU offering in the vendored catalog."""
    return aggregate(row for f in DATA_FILES for row in read_rows(f))
