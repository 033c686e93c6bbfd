"""How every `meridian` command shows things: tables that fold, sizes people can read.

Each plane draws its own tables (the catalog in providers, the weight cache in the data
plane, status and plans in the CLI), so the rules they share live in the kernel. A table
must stay whole on an 80-column terminal: rich's default shrinks a narrow column's cells to
"Regi…", losing the value; these columns wrap on words and fold long names (region and node
ids, digests) instead, and keep a minimum width so no column is squeezed to one letter.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

# Narrowest a column gets when the terminal is too narrow for every column's content.
MIN_COLUMN_WIDTH = 4

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float | None) -> str:
    """1536 → "1.5 KiB", 3 → "3 B", None → "-" (binary units, as `du -h` and `ls -lh`)."""
    if n is None:
        return "-"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def folding_table(*columns: str, right: tuple[str, ...] = (), **table_kwargs: Any) -> Table:
    """A rich Table whose columns fold rather than truncate; `right` are right-justified."""
    table = Table(header_style="bold", **table_kwargs)
    for name in columns:
        add_folding_column(table, name, right=name in right)
    return table


def add_folding_column(table: Table, name: str, *, right: bool = False) -> None:
    """Add a column that wraps and folds its cells; its width is at least its header's first word."""
    header_word = max((len(w) for w in name.split()), default=0)
    table.add_column(name, justify="right" if right else "left", overflow="fold", no_wrap=False,
                     min_width=max(MIN_COLUMN_WIDTH, min(header_word, 10)))
