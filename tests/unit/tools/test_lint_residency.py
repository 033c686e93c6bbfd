"""The residency lint (`make lint`): the repository passes it, and it fails on the zone rule
written anywhere but meridian/residency.py, however it is spelt."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.lint_residency import lint

REPO = Path(__file__).resolve().parents[3]


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_repository_writes_the_rule_once() -> None:
    assert lint(REPO) == []


@pytest.mark.parametrize("rule", [
    "zone == GLOBAL_ZONE or zone in region.zones",
    "tenant.zone != 'global' and tenant.zone not in r.zones",
    "'global' == key.zone",
    "residency.GLOBAL_ZONE == self.zone",
    "manifest.zone in answer.node_zones",
])
def test_a_call_site_with_its_own_rule_fails(tmp_path: Path, rule: str) -> None:
    root = _tree(tmp_path, {"geo_router/selection/candidates.py": f"def may(zone, region, tenant, key, r, self, "
                                                                 f"manifest, answer):\n    return {rule}\n"})
    found = lint(root)
    assert found and all(f.startswith("geo_router/selection/candidates.py:2: ") for f in found)


def test_a_real_call_site_reverted_to_its_own_rule_fails(tmp_path: Path) -> None:
    contracts = (REPO / "meridian/contracts.py").read_text()
    asked = "return residency.admits(self.zones, zone)"
    assert asked in contracts  # RegionInfo.admits asks the owner
    root = _tree(tmp_path, {"meridian/contracts.py": contracts.replace(
        asked, "return zone == GLOBAL_ZONE or zone in self.zones")})
    assert [f.split(": ")[1] for f in lint(root)] == ["a zone compared with the global zone",
                                                     "a zone looked up in a set of zones"]


def test_the_owner_and_a_line_that_says_why_pass(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "meridian/residency.py": "def admits(zones, zone):\n    return zone == 'global' or zone in zones\n",
        "cli/model_push.py": "if zone not in zones:  # residency: a name an operator may use\n    pass\n",
        "tests/test_x.py": "assert zone in region.zones\n",  # tests are not shipped code
    })
    assert lint(root) == []
