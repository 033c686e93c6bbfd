import pytest

from providers.onprem.regions import InventoryError
from providers.regions import region_catalog


def test_catalog_spans_three_providers_with_zones():
    cat = region_catalog()
    assert {r.provider for r in cat.values()} == {"aws", "gcp", "onprem"}
    assert cat["aws:us-east-1"].zones == ["us"]
    assert cat["gcp:europe-west4"].zones == ["eu"]
    assert cat["onprem:tokyo-1"].zones == ["apac"]


def test_onprem_inventory_file(tmp_path):
    inv = tmp_path / "inv.yaml"
    inv.write_text("sites:\n  - {name: fra-dc2, latitude: 50.1, longitude: 8.7, zones: [eu]}\n")
    cat = region_catalog(inv)
    assert cat["onprem:fra-dc2"].zones == ["eu"]
    assert "onprem:tokyo-1" not in cat


@pytest.mark.parametrize("text", ["sites: [{name: X, latitude: 1, longitude: 2, zones: [eu]}]",
                                  "sites: [{name: a, latitude: 100, longitude: 2, zones: [eu]}]",
                                  "sites: [{name: a, latitude: 1, longitude: 2, zones: []}]",
                                  "sites: [unbalanced"])
def test_bad_inventory_gives_clear_error(tmp_path, text):
    inv = tmp_path / "inv.yaml"
    inv.write_text(text)
    with pytest.raises(InventoryError, match="invalid on-prem inventory"):
        region_catalog(inv)


def test_missing_inventory_file(tmp_path):
    with pytest.raises(InventoryError, match="cannot read"):
        region_catalog(tmp_path / "nope.yaml")
