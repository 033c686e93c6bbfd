import subprocess
import sys

import pytest

import providers.aws.offerings as aws
import providers.gcp.offerings as gcp
from providers.catalog import load_catalog, per_gpu_hour
from providers.offerings import CatalogDataError
from providers.onprem.inventory import InventoryError, load_inventory
from providers.onprem.offerings import host_capacity, onprem_capacity
from providers.onprem.offerings import offerings as onprem_offerings
from providers.regions import region_catalog
from providers.skus import SKUS

# --- AWS ------------------------------------------------------------------------------------


def aws_rows():
    return [row for f in aws.DATA_FILES for row in aws.read_rows(f)]


def test_aws_rows_that_differ_by_az_are_one_offering():
    rows, offers = aws_rows(), aws.offerings()
    pairs = {(r["InstanceType"], r["Region"]) for r in rows}
    assert len(offers) == len(pairs) == 302
    by_key = {(o.instance_type, o.region): o for o in offers}
    assert len(by_key) == len(offers)
    for instance_type, region in pairs:
        o = by_key[(instance_type, f"aws:{region}")]
        azs = {r["AvailabilityZone"] for r in rows
               if (r["InstanceType"], r["Region"]) == (instance_type, region)}
        assert o.availability_zones == tuple(sorted(azs))


def test_p4de_duplicate_az_rows_merge_and_take_the_cheapest_spot():
    o = next(o for o in aws.offerings() if (o.instance_type, o.region) == ("p4de.24xlarge", "aws:us-east-1"))
    assert o.sku == "A100-80GB" and o.gpu_count == 8
    assert len(o.availability_zones) == len(set(o.availability_zones))
    assert o.price_per_hour == 40.96575
    # us-east-1 p4de spot prices: use1-az4 7.8074, use1-az6 5.8394, the other rows blank or dearer.
    spots = [float(r["SpotPrice"]) for r in aws_rows()
             if r["InstanceType"] == "p4de.24xlarge" and r["Region"] == "us-east-1" and r["SpotPrice"]]
    assert o.spot_price_per_hour == min(spots) == 5.8394


def test_p5e_has_no_on_demand_price():
    p5e = [o for o in aws.offerings() if o.instance_type == "p5e.48xlarge"]
    assert p5e and all(o.price_per_hour is None for o in p5e)
    assert all(o.sku == "H200-141GB" and o.gpu_count == 8 for o in p5e)
    # ap-southeast-3 has a spot price (14.925), eu-north-1 none at all.
    by_region = {o.region: o for o in p5e}
    assert by_region["aws:ap-southeast-3"].spot_price_per_hour == 14.925
    assert by_region["aws:eu-north-1"].spot_price_per_hour is None


def test_aws_row_with_bad_gpu_info_is_a_clear_error():
    row = dict(aws_rows()[0], GpuInfo="__import__('os').system('true')")
    with pytest.raises(CatalogDataError, match="unreadable GpuInfo"):
        aws.row_sku(row)
    row = dict(aws_rows()[0], AcceleratorName="A100")  # a p3 (V100) row
    with pytest.raises(CatalogDataError, match="p3.16xlarge"):
        aws.row_sku(row)
    row = dict(aws_rows()[0], AcceleratorCount="4.0")  # GpuInfo says 8
    with pytest.raises(CatalogDataError, match="disagree"):
        aws.row_sku(row)


# --- GCP ------------------------------------------------------------------------------------


def gcp_offer(instance_type, region):
    return next(o for o in gcp.offerings() if (o.instance_type, o.region) == (instance_type, region))


def test_gcp_host_price_is_host_plus_its_gpus():
    # gcp_host_vms.csv:       a3-highgpu-8g,208.0,1872.0,,,,us-central1,us-central1-a,9.46006,2.17547
    # gcp_gpu_attachable.csv: ,,,H100,8,{…81920…},us-central1,us-central1-a,33.60609,18.024
    # (and the same in zones -b and -c)
    o = gcp_offer("a3-highgpu-8g", "gcp:us-central1")
    assert (o.sku, o.gpu_count, o.vcpus, o.memory_gib) == ("H100-80GB-SXM", 8, 208.0, 1872.0)
    assert o.price_per_hour == pytest.approx(9.46006 + 33.60609)
    assert o.spot_price_per_hour == pytest.approx(2.17547 + 18.024)
    assert o.availability_zones == ("us-central1-a", "us-central1-b", "us-central1-c")
    # g2-standard-24 (0.92571, spot 0.37042) carries 2 L4s (1.17608, spot 0.4212) in europe-west4.
    o = gcp_offer("g2-standard-24", "gcp:europe-west4")
    assert (o.sku, o.gpu_count) == ("L4-24GB", 2)
    assert o.price_per_hour == pytest.approx(0.92571 + 1.17608)
    assert o.spot_price_per_hour == pytest.approx(0.37042 + 0.4212)


def _host(it, zone, price="1.0", spot="0.5"):
    return {"InstanceType": it, "vCPUs": "12.0", "MemoryGiB": "85.0", "AcceleratorName": "",
            "AcceleratorCount": "", "GpuInfo": "", "Region": zone[:-2], "AvailabilityZone": zone,
            "Price": price, "SpotPrice": spot}


def _gpu(name, count, mib, zone, price="2.0", spot=""):
    return {"InstanceType": "", "vCPUs": "", "MemoryGiB": "", "AcceleratorName": name,
            "AcceleratorCount": str(count),
            "GpuInfo": f"{{'Gpus': [{{'MemoryInfo': {{'SizeInMiB': {mib}}}}}]}}",
            "Region": zone[:-2], "AvailabilityZone": zone, "Price": price, "SpotPrice": spot}


def test_gcp_host_zone_without_a_gpu_price_is_skipped():
    hosts = [_host("a2-highgpu-1g", "us-central1-a"), _host("a2-highgpu-1g", "us-central1-b", price="0.5"),
             _host("a2-highgpu-2g", "us-central1-a")]
    gpus = [_gpu("A100", 1, 40960, "us-central1-a", spot="0.25")]
    (o,) = gcp.build_offerings(hosts, gpus)
    assert (o.instance_type, o.availability_zones) == ("a2-highgpu-1g", ("us-central1-a",))
    assert o.price_per_hour == 3.0 and o.spot_price_per_hour == 0.75


def test_gcp_spot_is_none_when_host_or_gpu_has_no_spot():
    hosts, gpus = [_host("a2-highgpu-1g", "us-central1-a")], [_gpu("A100", 1, 40960, "us-central1-a")]
    (o,) = gcp.build_offerings(hosts, gpus)
    assert o.spot_price_per_hour is None


def test_gcp_n1_gpus_are_gpu_only_offerings():
    o = gcp_offer("n1+4xT4", "gcp:us-central1")
    assert (o.sku, o.gpu_count, o.vcpus, o.memory_gib) == ("T4-16GB", 4, 0.0, 0.0)
    rows = [r for r in gcp.read_rows(gcp.ATTACHABLE_FILE)
            if (r["AcceleratorName"], r["AcceleratorCount"], r["Region"]) == ("T4", "4", "us-central1")]
    assert o.price_per_hour == min(float(r["Price"]) for r in rows)
    n1 = {o.sku for o in gcp.offerings() if o.instance_type.startswith("n1+")}
    assert n1 == {"T4-16GB", "V100-16GB", "P4-8GB", "P100-16GB"}  # L4/A100/H100 come only with their hosts


def test_gcp_unknown_machine_type_or_accelerator_is_a_clear_error():
    with pytest.raises(CatalogDataError, match="a9-"):
        gcp.row_sku(_host("a9-hugegpu-8g", "us-central1-a"))
    with pytest.raises(CatalogDataError, match="MI300X"):
        gcp.row_sku(_gpu("MI300X", 1, 196608, "us-central1-a"))
    with pytest.raises(CatalogDataError, match="A100"):
        gcp.row_sku(_gpu("A100", 1, 81920, "us-central1-a"))  # "A100" on GCP is the 40 GB part


# --- on-prem --------------------------------------------------------------------------------

INVENTORY = """
sites:
  - name: osaka-1
    latitude: 34.69
    longitude: 135.5
    zones: [apac]
    hosts:
      - {instance_type: dgx-h100, sku: H100-80GB-SXM, gpu_count: 8, count: 3, vcpus: 224, memory_gib: 2048,
         price_per_hour: 16.0}
      - {instance_type: l4-box, sku: l4, gpu_count: 2, count: 5, vcpus: 32, memory_gib: 128}
  - name: ams-1
    latitude: 52.37
    longitude: 4.9
    zones: [eu]
"""


def test_onprem_inventory_hosts_become_offerings_with_capacity(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    offers = {o.instance_type: o for o in onprem_offerings(inv)}
    assert set(offers) == {"dgx-h100", "l4-box"}
    h = offers["dgx-h100"]
    assert (h.provider, h.region, h.sku, h.gpu_count, h.price_per_hour, h.spot_price_per_hour) == (
        "onprem", "onprem:osaka-1", "H100-80GB-SXM", 8, 16.0, None)
    assert offers["l4-box"].sku == "L4-24GB" and offers["l4-box"].price_per_hour == 0.0
    assert onprem_capacity(inv) == {("onprem:osaka-1", "H100-80GB-SXM"): 24,
                                    ("onprem:osaka-1", "L4-24GB"): 10}
    assert host_capacity(inv) == {("onprem:osaka-1", "dgx-h100"): 3, ("onprem:osaka-1", "l4-box"): 5}
    assert set(region_catalog(inv)) >= {"onprem:osaka-1", "onprem:ams-1"}


def test_default_inventory_has_capacity_in_two_zones():
    cat = region_catalog()
    capacity = onprem_capacity()
    assert capacity[("onprem:tokyo-1", "H100-80GB-SXM")] == 32
    zones = {z for (region, _), gpus in capacity.items() if gpus > 0 for z in cat[region].zones}
    assert {"apac", "eu"} <= zones


@pytest.mark.parametrize(("hosts", "message"), [
    ("[{instance_type: x, sku: MI300X, gpu_count: 8, count: 1, vcpus: 1, memory_gib: 1}]", "not a GPU"),
    ("[{instance_type: x, sku: H100, gpu_count: 8, count: 1, vcpus: 1, memory_gib: 1}]", "ambiguous"),
    ("[{instance_type: x, sku: L4, gpu_count: 0, count: 1, vcpus: 1, memory_gib: 1}]", "gpu_count"),
    ("[{instance_type: x, sku: L4, gpu_count: 1, count: 0, vcpus: 1, memory_gib: 1}]", "count"),
    ("[{instance_type: x, sku: L4, gpu_count: 1, count: 1, vcpus: 1, memory_gib: 1, price_per_hour: -1}]",
     "price"),
    ("[{instance_type: x, sku: L4, gpu_count: 1, count: 1, vcpus: 1}]", "memory_gib"),
    ("[{instance_type: x, sku: L4, gpu_count: 1, count: 1, vcpus: 1, memory_gib: 1, spot: 1}]", "spot"),
    ("[{instance_type: x, sku: L4, gpu_count: 1, count: 1, vcpus: 1, memory_gib: 1},"
     " {instance_type: x, sku: T4, gpu_count: 1, count: 1, vcpus: 1, memory_gib: 1}]", "listed twice"),
    ("{instance_type: x}", "hosts"),
])
def test_bad_host_inventory_gives_clear_error(tmp_path, hosts, message):
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"sites:\n  - {{name: a, latitude: 1, longitude: 2, zones: [eu], hosts: {hosts}}}\n")
    with pytest.raises(InventoryError, match="invalid on-prem inventory") as e:
        onprem_offerings(inv)
    assert message in str(e.value)


def test_duplicate_site_is_an_error(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("sites: [{name: a, latitude: 1, longitude: 2, zones: [eu]},"
                   " {name: a, latitude: 1, longitude: 2, zones: [eu]}]\n")
    with pytest.raises(InventoryError, match="listed twice"):
        load_inventory(inv)


# --- the whole catalog ----------------------------------------------------------------------


def test_every_offering_is_in_a_known_region_with_a_known_sku():
    catalog, regions = load_catalog(), region_catalog()
    assert {o.provider for o in catalog.offerings} == set(catalog.providers) == {"aws", "gcp", "onprem"}
    for o in catalog.offerings:
        assert o.region in regions, o
        assert regions[o.region].provider == o.provider
        assert o.sku in SKUS
        assert o.gpu_count >= 1
    assert "onprem:tokyo-1" in catalog.regions()


@pytest.mark.parametrize(("region", "zones"), [
    ("aws:us-east-1", ["us"]), ("gcp:europe-west4", ["eu"]), ("onprem:tokyo-1", ["apac"]),
    ("aws:eu-west-2", ["uk"]), ("gcp:europe-west2", ["uk"]), ("gcp:europe-west6", ["ch"]),
    ("gcp:me-west1", ["il"]), ("gcp:me-central2", ["me"]), ("gcp:europe-central2", ["eu"]),
    ("gcp:europe-north1", ["eu"]), ("gcp:northamerica-northeast2", ["ca"]),
    ("gcp:southamerica-east1", ["sa"]),
    ("aws:ap-southeast-2", ["apac"]), ("gcp:asia-east2", ["apac"]), ("onprem:fra-dc1", ["eu"]),
])
def test_residency_zones_of_catalog_regions(region, zones):
    assert region_catalog()[region].zones == zones


def test_catalog_queries(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text(INVENTORY)
    catalog = load_catalog(inv)
    assert catalog.cheapest_per_gpu_hour("onprem", "H100-80GB-SXM") == 2.0  # 16 $/h over 8 GPUs
    assert catalog.cheapest_per_gpu_hour("onprem", "h100 sxm") == 2.0
    assert catalog.cheapest_per_gpu_hour("onprem", "A100-80GB") is None
    assert catalog.cheapest_per_gpu_hour("gcp", "H100-80GB-SXM", region="gcp:us-central1") == pytest.approx(
        (9.46006 + 33.60609) / 8)
    aws_h100 = [o.price_per_hour / 8 for o in catalog.offerings
                if o.provider == "aws" and o.instance_type == "p5.48xlarge" and o.price_per_hour]
    assert catalog.cheapest_per_gpu_hour("aws", "H100-80GB-SXM") == min(aws_h100)
    assert catalog.gpu_counts("A100-40GB", "gcp") == [1, 2, 4, 8, 16]
    assert catalog.gpu_capacity("onprem:osaka-1", "H100-80GB-SXM") == 24
    assert catalog.gpu_capacity("onprem:osaka-1", "A100-80GB") == 0
    assert catalog.gpu_capacity("aws:us-east-1", "H100-80GB-SXM") is None  # clouds: no limit known here
    assert "onprem:tokyo-1" not in catalog.regions()  # nothing cached from the default inventory
    assert {o.region for o in catalog.for_region("gcp:us-central1")} == {"gcp:us-central1"}
    h200 = catalog.for_sku("H200")
    prices = [per_gpu_hour(o) for o in h200]
    priced = [p for p in prices if p is not None]
    assert priced == sorted(priced) and prices[: len(priced)] == priced  # cheapest first, unpriced (p5e) last
    narrowed = catalog.where(provider="onprem")
    assert {o.provider for o in narrowed.offerings} == {"onprem"}
    assert narrowed.host_limits == catalog.host_limits


def test_catalog_imports_no_cloud_sdk():
    # Loading the catalog and the regions imports every registered provider's description, and no SDK.
    code = ("import sys, providers.catalog, providers.regions; "
            "providers.catalog.load_catalog(); providers.regions.region_catalog(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('boto3', 'botocore', 'google')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
