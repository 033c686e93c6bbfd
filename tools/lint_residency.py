"""The residency lint: the rule "may zone Z's data be in region R" is written once, in
meridian/residency.py, and every layer asks it (issue 36). A layer that writes its own copy,
even an exact one today, drifts the day the rule changes, and "EU data stays in the EU" is
what Meridian sells; so `make lint` fails on any comparison that looks like the rule
elsewhere in shipped code:

- a zone compared for equality with the global zone (`zone == GLOBAL_ZONE`, `!= "global"`);
- a zone looked up in a collection of zones (`zone in region.zones`).

A line that only looks like it (a zone checked against the zones an operator may name, not
against a region's) says so with `# residency: <why>` on the line, and the lint passes it.
Run: `python tools/lint_residency.py [ROOT]`; exit status 1 lists each finding.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

SHIPPED = ("meridian", "control_plane", "data_plane", "geo_router", "providers", "iac", "chaos", "cli", "localfabric")
OWNER = Path("meridian/residency.py")
PRAGMA = "# residency:"


def _name(node: ast.expr) -> str:
    """The last name of `x`, `a.b.x` or `f(...).x`, lower-cased ("" for anything else)."""
    if isinstance(node, ast.Name):
        return node.id.lower()
    if isinstance(node, ast.Attribute):
        return node.attr.lower()
    return ""


def _is_global(node: ast.expr) -> bool:
    return (isinstance(node, ast.Constant) and node.value == "global") or _name(node) == "global_zone"


def findings(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, what) for each comparison in `tree` that looks like the zone rule."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands[:-1], operands[1:], strict=True):
            if isinstance(op, ast.Eq | ast.NotEq):
                for a, b in ((left, right), (right, left)):
                    if _is_global(b) and _name(a).endswith("zone"):
                        yield node.lineno, "a zone compared with the global zone"
            elif isinstance(op, ast.In | ast.NotIn) and _name(left).endswith("zone") and _name(right).endswith("zones"):
                yield node.lineno, "a zone looked up in a set of zones"


def lint(root: Path) -> list[str]:
    out: list[str] = []
    for package in SHIPPED:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root)
            if relative == OWNER:
                continue
            text = path.read_text(encoding="utf-8")
            lines = text.splitlines()
            for line, what in findings(ast.parse(text, filename=str(path))):
                if PRAGMA not in lines[line - 1]:
                    out.append(f"{relative}:{line}: {what}: ask meridian.residency instead")
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[1]) if len(argv) > 1 else Path.cwd()
    problems = lint(root)
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} place(s) write the zone rule outside {OWNER}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
