"""How every `meridian` command shows things: tables that fold, sizes people can read, and
`-o json|yaml` for scripts.

Each plane draws its own tables (the catalog in providers, the weight cache in the data
plane, status and plans in the CLI), so the rules they share live in the kernel. A table
must stay whole on an 80-column terminal: rich's default shrinks a narrow column's cells to
"Regi…", losing the value; these columns wrap on words and fold long names (region and node
ids, digests) instead, and keep a minimum width so no column is squeezed to one letter.
Piped into grep or awk (stdout not a terminal), a table is as wide as its rows need, one
line per row, unless COLUMNS says otherwise: rich would fold it at 80 columns (or at the
width of the terminal stdin happens to be), splitting values over lines a script reads
one at a time. A listing's `-o json` (or yaml) prints the API's models as they came and
nothing else on stdout (notes and progress go to stderr), so that scripts can read it.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any

import typer
from pydantic import BaseModel, TypeAdapter
from rich.console import Console, ConsoleDimensions, RenderableType
from rich.table import Table

# A column is never narrower than its header's longest word, within these bounds: rich
# widens a column to its minimum after shrinking the table to the terminal, so minimums that
# add up to more than the terminal would crop the table's right edge. Ten columns of 5 fit 80.
MIN_COLUMN_WIDTH = 3
MAX_MIN_COLUMN_WIDTH = 5

# The width of output piped elsewhere: wider than any row, so that none folds (a table is only
# as wide as its cells, so this pads nothing).
PIPED_WIDTH = 1000

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# Parameter counts as model cards write them (decimal: "8B" is eight billion).
_COUNT_UNITS = ("", "K", "M", "B", "T")


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


def human_params(params_b: float) -> str:
    """A parameter count given in billions, as model cards write it: 0.134515 → "135M",
    8.03 → "8B", 1.24 → "1.2B" (whole numbers from 10 up, one decimal below)."""
    value = params_b * 1e9
    for unit in _COUNT_UNITS:
        rounded = round(value) if value >= 10 else round(value, 1)
        if rounded < 1000 or unit == _COUNT_UNITS[-1]:
            return f"{rounded:g}{unit}"
        value /= 1000
    raise AssertionError("unreachable")


def human_time(t: datetime | None, *, seconds: bool = False) -> str:
    """A timestamp in a table cell ("-" when there is none), to the minute or the second."""
    return "-" if t is None else t.strftime("%Y-%m-%d %H:%M:%S" if seconds else "%Y-%m-%d %H:%M")


class OutputConsole(Console):
    """A console on stdout that, piped (not a terminal) and without COLUMNS, is PIPED_WIDTH wide.

    Decided at each print, not at start-up: tests and callers swap sys.stdout.
    """

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self.is_terminal or os.environ.get("COLUMNS", "").isdigit():
            return size
        return ConsoleDimensions(PIPED_WIDTH, size.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]


def folding_table(*columns: str, right: tuple[str, ...] = (), **table_kwargs: Any) -> Table:
    """A rich Table whose columns fold rather than truncate; `right` are right-justified."""
    table = Table(header_style="bold", **table_kwargs)
    for name in columns:
        add_folding_column(table, name, right=name in right)
    return table


def add_folding_column(table: Table, name: str, *, right: bool = False) -> None:
    """Add a column that wraps and folds its cells, at least as wide as its header's longest word
    (within MIN_COLUMN_WIDTH and MAX_MIN_COLUMN_WIDTH)."""
    header_word = max((len(w) for w in name.split()), default=0)
    table.add_column(name, justify="right" if right else "left", overflow="fold", no_wrap=False,
                     min_width=max(MIN_COLUMN_WIDTH, min(header_word, MAX_MIN_COLUMN_WIDTH)))


class OutputFormat(StrEnum):
    TABLE = "table"
    JSON = "json"
    YAML = "yaml"


OutputOpt = Annotated[OutputFormat, typer.Option("--output", "-o", help="table, json or yaml")]


def dumpable(value: Any) -> Any:
    """Models and dataclasses (or lists and dicts of them) as plain JSON data."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    return TypeAdapter(Any).dump_python(value, mode="json")


def emit(output: OutputFormat, data: Any, table: RenderableType | None = None,
         console: Console | None = None) -> None:
    """Print `table` (on `console`), or `data` as JSON or YAML on stdout and nothing else."""
    if output == OutputFormat.TABLE and table is not None:
        (console or OutputConsole()).print(table)
    elif output == OutputFormat.YAML:
        import yaml

        print(yaml.safe_dump(dumpable(data), sort_keys=False, allow_unicode=True), end="")
    else:
        print(json.dumps(dumpable(data), indent=2))
