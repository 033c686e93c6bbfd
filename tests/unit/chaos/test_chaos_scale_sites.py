"""The fleet simulator's regions past the catalog: colocation sites beside real regions, read
by the control plane through the real inventory path."""

from __future__ import annotations

from pathlib import Path

from chaos.scale.sites import inventory_for
from providers.regions import region_catalog


def test_the_inventory_takes_the_catalog_to_100_regions_at_real_places(tmp_path: Path) -> None:
    catalog = region_catalog()
    assert len(catalog) < 100  # what the 10,000-node point needs more of
    path = inventory_for(100, tmp_path / "inventory.yaml")
    assert path is not None
    regions = region_catalog(path)
    assert len(regions) == 100
    assert set(catalog) <= set(regions)  # every catalog region and built-in site is kept
    places = {(r.latitude, r.longitude, tuple(r.zones)) for r in catalog.values() if r.provider != "onprem"}
    colos = [r for name, r in regions.items() if name not in catalog]
    assert colos and all(r.provider == "onprem" and r.name.startswith("onprem:colo-") for r in colos)
    # Each stands where a real cloud region stands, in its residency zones.
    assert all((r.latitude, r.longitude, tuple(r.zones)) in places for r in colos)


def test_no_inventory_is_written_when_the_catalog_has_enough(tmp_path: Path) -> None:
    assert inventory_for(10, tmp_path / "inventory.yaml") is None
    assert not (tmp_path / "inventory.yaml").exists()
