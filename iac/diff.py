"""Compare two synth outputs resource by resource: what a plan change would add, remove or change.

It reads the Terraform JSON only (no cdktf), so it also compares outputs synthesised elsewhere.
A resource is `<stack>/<type>.<name>` (data sources `<stack>/data.<type>.<name>`); a changed one
lists the top-level attributes whose values differ, with old and new values, and marks those the
resource's `lifecycle.ignore_changes` names (a group's size: applying leaves an existing group's alone).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from rich.table import Table

Kind = Literal["added", "removed", "changed"]
# cdktf's own metadata inside each block; it says where the construct is, not what Terraform does.
_METADATA_KEY = "//"
_MAX_VALUE_CHARS = 60


@dataclass(frozen=True, slots=True)
class ResourceChange:
    """One resource that differs between the two outputs."""

    stack: str
    address: str  # "aws_autoscaling_group.asg_x" or "data.aws_ami.dlami_x86_64"
    kind: Kind
    # Changed top-level attributes, with (old, new) values (None where absent); empty unless "changed".
    attributes: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    # Changed attributes the resource's lifecycle.ignore_changes names: Terraform leaves them as they are.
    ignored: frozenset[str] = frozenset()

    @property
    def resource_type(self) -> str:
        return self.address.removeprefix("data.").split(".", 1)[0]


@dataclass(frozen=True, slots=True)
class StackDiff:
    """Everything that differs, sorted by stack and address."""

    changes: tuple[ResourceChange, ...]
    added_stacks: tuple[str, ...] = ()
    removed_stacks: tuple[str, ...] = ()

    def of_kind(self, kind: Kind) -> list[ResourceChange]:
        return [c for c in self.changes if c.kind == kind]

    @property
    def empty(self) -> bool:
        return not (self.changes or self.added_stacks or self.removed_stacks)

    def find(self, stack: str, resource_type: str) -> list[ResourceChange]:
        return [c for c in self.changes if c.stack == stack and c.resource_type == resource_type]


def load_stacks(out_dir: Path) -> dict[str, dict[str, Any]]:
    """Stack name → its Terraform JSON, for every stack of a synth output."""
    manifest_path = Path(out_dir) / "manifest.json"
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{out_dir} holds no synth output (no manifest.json)")
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    return {
        name: json.loads((Path(out_dir) / s["synthesizedStackPath"]).read_text(encoding="utf-8"))
        for name, s in sorted(manifest["stacks"].items())
    }


def resources(stack: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Address → attributes (cdktf metadata removed) of a stack's resources and data sources."""
    out = {}
    for section, prefix in (("resource", ""), ("data", "data.")):
        for rtype, blocks in stack.get(section, {}).items():
            for name, attrs in blocks.items():
                out[f"{prefix}{rtype}.{name}"] = {k: v for k, v in attrs.items() if k != _METADATA_KEY}
    return out


def _changed(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def _ignored(attrs: dict[str, Any]) -> frozenset[str]:
    lifecycle = attrs.get("lifecycle")
    names = lifecycle.get("ignore_changes", []) if isinstance(lifecycle, dict) else []
    return frozenset(names) if isinstance(names, list) else frozenset()


def diff_stacks(old_dir: Path, new_dir: Path) -> StackDiff:
    """What changes from the synth output in `old_dir` to the one in `new_dir`."""
    old, new = load_stacks(old_dir), load_stacks(new_dir)
    changes = []
    for stack in sorted(old.keys() | new.keys()):
        before, after = resources(old.get(stack, {})), resources(new.get(stack, {}))
        for address in sorted(before.keys() | after.keys()):
            if address not in before:
                changes.append(ResourceChange(stack, address, "added"))
            elif address not in after:
                changes.append(ResourceChange(stack, address, "removed"))
            elif attrs := _changed(before[address], after[address]):
                ignored = _ignored(after[address]) & attrs.keys()
                changes.append(ResourceChange(stack, address, "changed", attrs, frozenset(ignored)))
    return StackDiff(
        tuple(changes), tuple(sorted(new.keys() - old.keys())), tuple(sorted(old.keys() - new.keys()))
    )


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 1] + "…"


def _describe(change: ResourceChange) -> str:
    parts = []
    for name, (before, after) in change.attributes.items():
        scalar = all(v is None or isinstance(v, str | int | float | bool) for v in (before, after))
        line = f"{name}: {_short(before)} → {_short(after)}" if scalar else f"{name} (changed)"
        parts.append(f"{line} (ignored once created)" if name in change.ignored else line)
    return "\n".join(parts)


_STYLE = {"added": "green", "removed": "red", "changed": "yellow"}
_SIGN = {"added": "+", "removed": "-", "changed": "~"}


def diff_table(diff: StackDiff) -> Table:
    """The diff as a rich table: one row per resource, changed attributes with old → new values."""
    counts = ", ".join(f"{len(diff.of_kind(k))} {k}" for k in ("added", "changed", "removed"))
    table = Table(title=f"Terraform changes ({counts})", show_lines=False)
    table.add_column("", width=1)
    table.add_column("stack", style="bold", overflow="fold")
    table.add_column("resource", overflow="fold")
    table.add_column("changes", overflow="fold")
    for c in diff.changes:
        style = _STYLE[c.kind]
        table.add_row(
            f"[{style}]{_SIGN[c.kind]}[/{style}]", c.stack, f"[{style}]{c.address}[/{style}]", _describe(c)
        )
    return table
