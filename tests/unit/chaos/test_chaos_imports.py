"""The chaos package imports without cycles, type-checking imports included: environments,
injectors and the schedule share only leaf modules (chaos.timeline, chaos.faults.netns),
and the injector registry names its built-ins as strings instead of importing them."""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[set[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_the_chaos_package_has_no_import_cycle() -> None:
    graph = grimp.build_graph("chaos")
    assert _cycles(graph) == []


def test_the_injector_registry_imports_no_fault_module() -> None:
    graph = grimp.build_graph("chaos")
    imported = graph.find_modules_directly_imported_by("chaos.faults.injector")
    assert not {m for m in imported if m.startswith("chaos.faults.")}
