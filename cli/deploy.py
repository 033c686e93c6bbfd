"""`meridian deploy -f spec.yaml`: register a model and its deployment from one file.

A deployment spec (YAML or JSON):

    name: tiny-llama            # the model's name, served under it and deployed under it
    model:                      # optional: register (or replace) the model first
      path: ./tiny-llama        # a checkpoint directory (relative to the spec file), or
      # uri: s3://bucket/tiny   # the weights' origin (also stored as the model's weights_uri)
      # quantization: fp8       # any field of PUT /v1/models overrides what the checkpoint says
    zone: eu                    # the rest is the body of PUT /v1/deployments/{name}
    min_replicas: 0
    max_replicas: 2
    placement: {min_regions: 1}

The model's params_b, layers, kv_heads and head_dim come from the checkpoint's config.json and
safetensors headers (cli.checkpoint_shape), not from the operator's hand. The spec is checked
whole before anything is sent, and then sent as one request, PUT /v1/deployments/{name} with
the model in its body, which the control plane applies in one transaction: a deployment it
refuses (a zone it does not know) leaves no model registered behind it. `--dry-run` prints
that request's body and sends nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, get_args

import typer
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cli.admin_session import (
    ApiKeyOpt,
    ControlPlaneOpt,
    OutputFormat,
    OutputOpt,
    admin_client,
    api_errors,
    emit,
    err_console,
    fail,
)
from meridian.admin_api import WEIGHTS_URI_PATTERN, DeploymentUpsert, ModelUpsert
from meridian.cli_format import human_params
from meridian.contracts import ModelName


class ModelSource(BaseModel):
    """Where the model's shape comes from: a checkpoint directory or URI, and fields that override it."""

    model_config = ConfigDict(extra="allow")

    path: Path | None = None
    uri: str | None = Field(None, pattern=WEIGHTS_URI_PATTERN)

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if self.path is not None and self.uri is not None:
            raise ValueError("give the checkpoint's path or its uri, not both")
        return self


class DeploySpec(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: ModelName
    model: ModelSource | None = None


# The fields a spec's top level and its `model:` take (what a misspelt key is matched against).
_TOP_LEVEL = (DeploySpec, DeploymentUpsert)
_MODEL_LEVEL = (ModelSource, ModelUpsert)


# Each key's line in the spec file (meridian.config_file.yaml_lines), for the error messages.
Lines = Mapping[tuple[str | int, ...], int]


def _field_lines(e: ValidationError, lines: Lines, roots: tuple[type[BaseModel], ...],
                 prefix: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    """One "line 3: where: what" line per error (the line when the spec file has the key, which
    comes first, for sorting); an unknown field names the closest known one."""
    from meridian.config_file import at_line, did_you_mean, line_of  # YAML: only when a spec is read

    out = []
    for err in e.errors():
        loc = (*prefix, *err["loc"])
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            known = _known_fields(roots, err["loc"][:-1])
            message = "unknown field" + (did_you_mean(str(loc[-1]), known) or f"; known: {', '.join(known)}")
        out.append((line_of(lines, loc) or 0, f"{at_line(lines, loc)}{'.'.join(map(str, loc)) or '(spec)'}: {message}"))
    return out


def _in_file_order(problems: list[tuple[int, str]]) -> list[str]:
    """The problems by line (those of missing keys, which have none, first)."""
    return [text for _, text in sorted(problems, key=lambda p: p[0])]


def _known_fields(roots: tuple[type[BaseModel], ...], path: tuple[Any, ...]) -> list[str]:
    """The field names the model(s) at `path` (from `roots`, through nested models) take."""
    classes = list(roots)
    for part in path:
        nested = []
        for cls in classes:
            field = cls.model_fields.get(str(part))
            if field is not None:
                nested += [t for t in (field.annotation, *get_args(field.annotation))
                           if isinstance(t, type) and issubclass(t, BaseModel)]
        classes = nested
    return list(dict.fromkeys(name for cls in classes for name in cls.model_fields))


def load_spec(path: Path) -> tuple[DeploySpec, Lines]:
    """The spec file, parsed and checked (exit 2 with a line per problem otherwise), and where
    each of its keys is."""
    import yaml

    from meridian.config_file import yaml_error, yaml_lines

    try:
        text = path.read_text()
        data = yaml.safe_load(text)  # YAML is a superset of JSON
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}", 2)
    except yaml.YAMLError as e:
        fail(f"{path} is not YAML or JSON: {yaml_error(e)}", 2)
    if not isinstance(data, dict):
        fail(f"{path}: a deployment spec is a mapping (name, model, zone, replicas, …)", 2)
    lines = yaml_lines(text)
    try:
        return DeploySpec.model_validate(data), lines
    except ValidationError as e:
        fail(f"{path} is not a valid deployment spec:", 2, _in_file_order(_field_lines(e, lines, _TOP_LEVEL)))


class SpecProblems(ValueError):
    """Fields of the spec that do not make a valid request: (line, "line 3: where: what") each."""

    def __init__(self, problems: list[tuple[int, str]]) -> None:
        super().__init__("; ".join(text for _, text in problems))
        self.problems = problems


def model_body(source: ModelSource, spec_dir: Path, lines: Lines | None = None) -> ModelUpsert:
    """The model's spec: the checkpoint's shape, overridden by the fields the spec gives (exit 2
    when the checkpoint cannot be read; SpecProblems when the fields are not valid)."""
    from cli.checkpoint_shape import CheckpointShapeError, shape_from_dir, shape_from_uri

    fields: dict[str, Any] = {}
    try:
        if source.path is not None:
            fields = shape_from_dir(source.path if source.path.is_absolute() else spec_dir / source.path)
        elif source.uri is not None:
            fields = shape_from_uri(source.uri)
            fields["weights_uri"] = source.uri
    except CheckpointShapeError as e:
        fail(f"model: {e}", 2)
    fields.update(source.model_extra or {})
    try:
        return ModelUpsert(**fields)
    except ValidationError as e:
        raise SpecProblems(_field_lines(e, lines or {}, _MODEL_LEVEL, ("model",))) from None


def deployment_body(spec: DeploySpec, lines: Lines | None = None) -> DeploymentUpsert:
    """The body of PUT /v1/deployments/{name} (SpecProblems when the fields are not valid)."""
    try:
        return DeploymentUpsert(**(spec.model_extra or {}))
    except ValidationError as e:
        raise SpecProblems(_field_lines(e, lines or {}, _TOP_LEVEL)) from None


def deployment_request(file: Path, spec: DeploySpec, lines: Lines) -> DeploymentUpsert:
    """The deployment with its model, the spec's every problem at once (exit 2) otherwise."""
    problems: list[tuple[int, str]] = []
    model = deployment = None
    try:
        model = model_body(spec.model, file.parent, lines) if spec.model is not None else None
    except SpecProblems as e:
        problems += e.problems
    try:
        deployment = deployment_body(spec, lines)
    except SpecProblems as e:
        problems += e.problems
    if problems or deployment is None:
        fail(f"{file} is not a valid deployment spec:", 2, _in_file_order(problems))
    if model is not None:
        deployment.model = model  # the deployment and its model, in one transaction
    return deployment


def deploy(
    file: Annotated[Path, typer.Option("--file", "-f", help="Deployment spec (YAML or JSON)")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the request's body; send nothing")] = False,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Register a model (shape read from its checkpoint) and create or update its deployment, in one
    transaction (operator)."""
    from cli.admin_views import deployments_table

    spec, lines = load_spec(file)
    deployment = deployment_request(file, spec, lines)
    model = deployment.model
    if dry_run:
        body = deployment.model_dump(mode="json", exclude_unset=True)
        emit(OutputFormat.YAML if output == OutputFormat.YAML else OutputFormat.JSON,
             {f"PUT /v1/deployments/{spec.name}": body})
        return
    with api_errors(), admin_client(control_plane, api_key) as admin:
        d = admin.put_deployment(spec.name, deployment)
    if model is not None:
        err_console.print(f"model {spec.name}: {human_params(model.params_b)} parameters, {model.layers} layers, "
                          f"{model.kv_heads} KV heads × {model.head_dim}", highlight=False)
    emit(output, d, deployments_table([d]))
