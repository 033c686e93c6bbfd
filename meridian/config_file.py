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
file). Settings that span sources (a required secret given in the environment) are checked
when the component builds its settings (meridian.cli_settings.settings_or_exit).
"""

from __future__ import annotations

import difflib
import inspect
import json
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, SecretStr, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from meridian.settings import (
    CLISettings,
    ControlPlaneSettings,
    FileSettings,
    LogSettings,
    NodeSettings,
    ProviderSettings,
    RouterSettings,
    WeightSettings,
)

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


def load(path: Path) -> dict[str, dict[str, Any]]:
    """The file's sections, checked (ConfigFileError listing every problem otherwise)."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigFileError(path, [f"cannot read it: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        raise ConfigFileError(path, [f"not valid YAML: {' '.join(str(e).split())}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(path, ["the top level must be a mapping of sections (router:, node:, …)"])
    problems = check(data)
    if problems:
        raise ConfigFileError(path, problems)
    return data


def check(data: dict[Any, Any]) -> list[str]:
    """Every problem with a parsed config file, as `section.key: message` lines."""
    problems: list[str] = []
    for section, values in data.items():
        cls = SECTIONS.get(str(section))
        if cls is None:
            problems.append(f"{section}: unknown section{_suggest(str(section), SECTIONS)}"
                            f" (sections: {', '.join(SECTIONS)})")
            continue
        if values is None:
            continue
        if not isinstance(values, dict):
            problems.append(f"{section}: must be a mapping of settings, not {type(values).__name__}")
            continue
        for key, value in values.items():
            problems += _check_value(str(section), cls, str(key), value)
    return problems


def _check_value(section: str, cls: type[FileSettings], key: str, value: Any) -> list[str]:
    where = f"{section}.{key}"
    field = cls.model_fields.get(key)
    if field is None:
        return [f"{where}: unknown key{_suggest(key, cls.model_fields)}"]
    if (section, key) in _NESTED:
        return [f"{where}: set these in the top-level `{_NESTED[section, key]}:` section"]
    try:
        _adapter(field).validate_python(value)
    except ValidationError as e:
        return [f"{where}{_loc(err['loc'])}: {err['msg']}" for err in e.errors()]
    return []


def _adapter(field: FieldInfo) -> TypeAdapter[Any]:
    # The field's type and its constraints (ge, le, pattern…), without its default or aliases.
    if not field.metadata:
        return TypeAdapter(field.annotation)
    return TypeAdapter(Annotated[(field.annotation, *field.metadata)])  # type: ignore[arg-type]


def _loc(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)


def _suggest(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


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
