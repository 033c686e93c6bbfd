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
safetensors headers (cli.checkpoint_shape), not from the operator's hand. `--dry-run` prints the
two request bodies and sends nothing. The spec is checked whole before anything is sent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

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
from meridian.admin_client import AdminAPIError
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


def _field_lines(e: ValidationError, prefix: str = "") -> list[str]:
    return [f"{prefix}{'.'.join(str(p) for p in err['loc']) or '(spec)'}: {err['msg']}" for err in e.errors()]


def load_spec(path: Path) -> DeploySpec:
    """The spec file, parsed and checked (exit 2 with a line per problem otherwise)."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())  # YAML is a superset of JSON
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror or e}", 2)
    except yaml.YAMLError as e:
        fail(f"{path} is not YAML or JSON: {str(e).splitlines()[0]}", 2)
    if not isinstance(data, dict):
        fail(f"{path}: a deployment spec is a mapping (name, model, zone, replicas, …)", 2)
    try:
        return DeploySpec.model_validate(data)
    except ValidationError as e:
        fail(f"{path} is not a valid deployment spec:", 2, _field_lines(e))


def model_body(source: ModelSource, spec_dir: Path) -> ModelUpsert:
    """The PUT /v1/models body: the checkpoint's shape, overridden by the fields the spec gives."""
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
        fail("model: the checkpoint and the spec do not make a valid model:", 2, _field_lines(e, "model."))


def deployment_body(spec: DeploySpec) -> DeploymentUpsert:
    try:
        return DeploymentUpsert(**(spec.model_extra or {}))
    except ValidationError as e:
        fail("the deployment fields are not valid:", 2, _field_lines(e))


def deploy(
    file: Annotated[Path, typer.Option("--file", "-f", help="Deployment spec (YAML or JSON)")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the request bodies; send nothing")] = False,
    output: OutputOpt = OutputFormat.TABLE,
    control_plane: ControlPlaneOpt = None,
    api_key: ApiKeyOpt = None,
) -> None:
    """Register a model (shape read from its checkpoint) and create or update its deployment (operator)."""
    from cli.admin_views import deployments_table

    spec = load_spec(file)
    model = model_body(spec.model, file.parent) if spec.model is not None else None
    deployment = deployment_body(spec)
    if dry_run:
        requests: dict[str, Any] = {}
        if model is not None:
            requests[f"PUT /v1/models/{spec.name}"] = model.model_dump(mode="json")
        requests[f"PUT /v1/deployments/{spec.name}"] = deployment.model_dump(mode="json", exclude_unset=True)
        emit(OutputFormat.YAML if output == OutputFormat.YAML else OutputFormat.JSON, requests)
        return
    with api_errors(), admin_client(control_plane, api_key) as admin:
        if model is not None:
            m = admin.put_model(spec.name, model)
            err_console.print(f"model {m.name}: {human_params(m.params_b)} parameters, {m.layers} layers, "
                              f"{m.kv_heads} KV heads × {m.head_dim} (version {m.resource_version})",
                              highlight=False)
        try:
            d = admin.put_deployment(spec.name, deployment)
        except AdminAPIError as e:
            if model is not None:
                err_console.print(f"[yellow]model {spec.name} was registered; its deployment was not[/yellow]")
            raise e
    emit(output, d, deployments_table([d]))
