"""The YAML config file (`meridian --config FILE`, or `MERIDIAN_CONFIG`): checked, and explained.

One file configures every component: one section per settings class of meridian.settings
(`control_plane:`, `router:`, `node:`, `weights:`, `provider:`, `cli:`, `log:`), whose keys
are that class's field names, the `MERIDIAN_<PREFIX>_<KEY>` variables without the prefix:

    router:
      port: 8080
      routing_policy: affinity
    log:
      format: json

Precedence, highest first: CLI flags > environment variables > this file > defaults
(meridian.settings.FileSettings reads the file below the environment).

`check` finds everything wrong with a file before a process starts on it, each problem as
`section.key: message`: unknown sections and keys (with the closest known name, since a
misspelt key would otherwise be ignored silently) and values of the wrong type or out of
range, validated against the field alone (so the environment cannot hide an error in the
file). `load` puts the line of the file in front of each (`line 3: router.port: …`), as it
does the line and column of a YAML syntax error. Settings that span sources (a required
secret given in the environment) are checked when the component builds its settings
(meridian.cli_settings.settings_or_exit).

The helpers that find those lines (`yaml_lines`, `at_line`, `yaml_error`) and the closest
name (`did_you_mean`) serve every YAML file a command reads (`meridian deploy`'s spec too).
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from meridian.settings import FileSettings, LogSettings
from meridian.settings.cli import CLISettings
from meridian.settings.control_plane import ControlPlaneSettings
from meridian.settings.node import NodeSettings, WeightSettings
from meridian.settings.providers import ProviderSettings
from meridian.settings.router import RouterSettings

SECTIONS: dict[str, type[FileSettings]] = {
    cls.config_section: cls
    for cls in (ControlPlaneSettings, RouterSettings, NodeSettings, WeightSettings, ProviderSettings,
                CLISettings, LogSettings)
}
# Fields that are a whole other section: configured there, not nested here.
_NESTED = {("node", "weights"): "weights"}


class ConfigFileError(ValueError):
    """A config file that cannot be used; `problems` are one line each."""

    def __init__(self, path: Path, problems: list[str]) -> None:
        super().__init__(f"{path}: " + "; ".join(problems))
        self.path = path
        self.problems = problems


# Where a problem is in a parsed file: its keys (and list indices) from the top.
Where = tuple[str | int, ...]


def load(path: Path) -> dict[str, dict[str, Any]]:
    """The file's sections, checked (ConfigFileError listing every problem, with its line, otherwise)."""
    try:
        text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except OSError as e:
        raise ConfigFileError(path, [f"cannot read it: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        raise ConfigFileError(path, [f"not valid YAML: {yaml_error(e)}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(path, ["the top level must be a mapping of sections (router:, node:, …)"])
    problems = _problems(data)
    if problems:
        lines = yaml_lines(text)
        raise ConfigFileError(path, [f"{at_line(lines, where)}{message}" for where, message in problems])
    return data


def check(data: dict[Any, Any]) -> list[str]:
    """Every problem with a parsed config file, as `section.key: message` lines."""
    return [message for _, message in _problems(data)]


def _problems(data: dict[Any, Any]) -> list[tuple[Where, str]]:
    """Every problem with a parsed config file: where, and a `section.key: message` line."""
    problems: list[tuple[Where, str]] = []
    for section, values in data.items():
        cls = SECTIONS.get(str(section))
        if cls is None:
            problems.append(((str(section),), f"{section}: unknown section{did_you_mean(str(section), SECTIONS)}"
                                              f" (sections: {', '.join(SECTIONS)})"))
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append(((str(section),), f"{section}: must be a mapping of settings, not {type(values).__name__}"))
            continue
        for key, value in values.items():
            problems += _check_value(str(section), cls, str(key), value)
    return problems


def _check_value(section: str, cls: type[FileSettings], key: str, value: Any) -> list[tuple[Where, str]]:
    where = f"{section}.{key}"
    field = cls.model_fields.get(key)
    if field is None:
        return [((section, key), f"{where}: unknown key{did_you_mean(key, cls.model_fields)}")]
    if (section, key) in _NESTED:
        return [((section, key), f"{where}: set these in the top-level `{_NESTED[section, key]}:` section")]
    try:
        _adapter(field).validate_python(value)
    except ValidationError as e:
        return [((section, key, *err["loc"]), f"{where}{_loc(err['loc'])}: {err['msg']}") for err in e.errors()]
    return []


def _adapter(field: FieldInfo) -> TypeAdapter[Any]:
    # The field's type and its constraints (ge, le, pattern…), without its default or aliases.
    if not field.metadata:
        return TypeAdapter(field.annotation)
    return TypeAdapter(Annotated[(field.annotation, *field.metadata)])  # type: ignore[arg-type]


def _loc(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """" (did you mean port?)" when a known name is close to `name` (a likely typo), else ""."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


# --- where in a YAML file ------------------------------------------------------------------


def yaml_lines(text: str) -> dict[Where, int]:
    """The line (from 1) of every key and list item of a YAML document, by its path; {} when
    the text does not parse (its error says where instead)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[Where, int] = {}
    pending: list[tuple[yaml.Node | None, Where]] = [(root, ())]
    while pending:  # a loop, not recursion: a deeply nested file must not overflow the stack
        node, path = pending.pop()
        if isinstance(node, yaml.MappingNode):
            children = [((*path, k.value), k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)]
        elif isinstance(node, yaml.SequenceNode):
            children = [((*path, i), item, item) for i, item in enumerate(node.value)]
        else:
            continue
        for child_path, marked, child in children:
            lines.setdefault(child_path, marked.start_mark.line + 1)
            pending.append((child, child_path))
    return lines


def line_of(lines: Mapping[Where, int], where: Where) -> int | None:
    """The line of the deepest part of `where` the file holds (None when none: a missing key)."""
    for end in range(len(where), 0, -1):
        if where[:end] in lines:
            return lines[where[:end]]
    return None


def at_line(lines: Mapping[Where, int], where: Where) -> str:
    """"line 3: " for `where` (see line_of), or ""."""
    line = line_of(lines, where)
    return "" if line is None else f"line {line}: "


def yaml_error(e: yaml.YAMLError) -> str:
    """A YAML syntax error in one line, starting with where: "line 2, column 9: …"."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or problem is None:
        return " ".join(str(e).split())
    context = getattr(e, "context", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" + (f" ({context})" if context else "")


# --- `meridian config example` ------------------------------------------------------------


def example() -> str:
    """A commented config file with every setting at its default (all commented out, so the
    file is valid as it is): uncomment what you change."""
    lines = [
        "# Meridian config file: `meridian --config meridian.yaml …` or MERIDIAN_CONFIG=meridian.yaml.",
        "# One section per component; keys are the MERIDIAN_<PREFIX>_<KEY> settings without the prefix.",
        "# Precedence: command-line flags > environment variables > this file > defaults.",
    ]
    for section, cls in SECTIONS.items():
        prefix = str(cls.model_config.get("env_prefix", ""))
        lines += ["", f"# {(cls.__doc__ or '').strip().splitlines()[0]} ({prefix}*)", f"{section}:"]
        comments = _field_comments(cls)
        for name, field in cls.model_fields.items():
            if (section, name) in _NESTED:
                continue
            lines += [f"  # {c}" for c in comments.get(name, [])]
            lines.append(f"  # {name}: {_default(field)}")
    return "\n".join(lines) + "\n"


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "  # required (a secret: better in the environment)"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "null"
    if isinstance(value, SecretStr | BaseModel):
        return ""
    if isinstance(value, Path):
        value = str(value)
    return json.dumps(value, default=str)


def _field_comments(cls: type) -> dict[str, list[str]]:
    """The `#` comment lines right above each field in the class's source (its own and its
    bases'), which is where meridian.settings documents them."""
    comments: dict[str, list[str]] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, FileSettings)):
            continue
        pending: list[str] = []
        for line in inspect.getsource(klass).splitlines():
            stripped = line.strip()
            if stripped.startswith("# ---"):
                pending = []
            elif stripped.startswith("#"):
                pending.append(stripped.lstrip("# ").rstrip())
            elif m := re.match(r"\s{4}(\w+):", line):
                if m.group(1) in klass.model_fields:
                    comments[m.group(1)] = pending
                pending = []
            else:
                pending = []
    return comments
