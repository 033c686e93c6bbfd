"""A deployment that drills run against instead of a local fabric.

A deployment file says where the routers and the control plane are, how to collect the
routers' and nodes' request journals from their hosts after a run, and how each fault kind
is injected there: commands the operator writes (over ssh, kubectl, a cloud CLI), or an
instance terminated through its provider's API. The drill files stay the same; a drill
whose fault has no action in the file cannot run against that deployment, with that reason.

```yaml
name: staging
control_plane: https://cp.staging.example.com
routers: [https://eu.staging.example.com, https://us.staging.example.com]
model: llama-3-8b
admin_key_env: MERIDIAN_CHAOS_ADMIN_KEY      # the key itself never goes in the file
metrics_token_env: MERIDIAN_CHAOS_METRICS_TOKEN  # the routers' /metrics token
journals:
  - {name: routers, command: "ssh {host} cat /var/lib/meridian/router-requests.jsonl",
     hosts: [router-eu-1, router-us-1]}
  - {name: nodes, path: "/mnt/meridian-journals/*.jsonl"}
actions:
  process_hang:
    type: command
    inject: "ssh {host} sudo systemctl kill -s STOP meridian-node"
    heal: "ssh {host} sudo systemctl kill -s CONT meridian-node"
  process_crash: {type: terminate_instance, replacement_timeout_s: 900}
```
"""

from __future__ import annotations

import os
import string
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from chaos.drill import FaultKind, load_yaml_model

# Fields a command may use: the node it acts on (the command then runs once per target node),
# the run, and the fault's parameters as `param_<name>`.
NODE_FIELDS = frozenset({"node_id", "region", "provider", "url", "host", "model"})
RUN_FIELDS = frozenset({"run_id", "kind", "deployment"})
PARAM_PREFIX = "param_"
_NAME = r"^[a-z0-9][a-z0-9-]{0,62}$"


class DeploymentError(ValueError):
    """A deployment file is unreadable or invalid, or a secret it names is not set."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def template_fields(template: str) -> set[str]:
    """The `{field}` names a command template uses; ValueError when it is malformed."""
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"malformed template {template!r}: {exc}") from None


def _check_template(template: str, allowed: frozenset[str], params: bool) -> str:
    for name in template_fields(template):
        if name not in allowed and not (params and name.startswith(PARAM_PREFIX)):
            known = ", ".join(sorted(allowed)) + (f", and {PARAM_PREFIX}<name> for the fault's parameters"
                                                  if params else "")
            raise ValueError(f"unknown field {{{name}}} in {template!r} (known: {known})")
    return template


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL")
    return url.rstrip("/")


class JournalSource(_Spec):
    """Where request journals are read after a run: files readable from here (`path`, a glob
    over a mount or a synced folder), or a `command` run once per host that prints a
    journal on its standard output (`{run_id}` lets it send only this run's lines)."""

    name: str = Field(pattern=_NAME)
    path: str | None = None
    command: str | None = None
    hosts: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _one_way(self) -> JournalSource:
        if (self.path is None) == (self.command is None):
            raise ValueError("a journal source has either a path or a command")
        if self.command is not None:
            _check_template(self.command, frozenset({"host", "run_id"}), params=False)
            if "host" in template_fields(self.command) and not self.hosts:
                raise ValueError("a command with {host} needs hosts to run on")
        elif self.hosts:
            raise ValueError("hosts go with a command, not a path")
        return self


class CommandAction(_Spec):
    """Shell commands that inject and heal the fault. A command using a node's fields runs
    once per node the drill's target matches; otherwise once."""

    type: Literal["command"]
    inject: str = Field(min_length=1)
    heal: str | None = None
    # Spot preemption: how long after the heal command the target's regions may take to have
    # as many ready nodes as before (the replacement the drill checks for).
    recovery_timeout_s: float = Field(300.0, gt=0)

    @field_validator("inject", "heal")
    @classmethod
    def _template(cls, v: str | None) -> str | None:
        return None if v is None else _check_template(v, NODE_FIELDS | RUN_FIELDS, params=True)

    def per_node(self) -> bool:
        return any(template_fields(t) & NODE_FIELDS for t in (self.inject, self.heal) if t)


class TerminateInstanceAction(_Spec):
    """Terminate each target node's instance through its provider's API (its node id is the
    instance id), as a hardware failure or a spot reclaim without notice would; the Auto
    Scaling group or the reconciler replaces it. Healing waits until the target's regions
    have as many ready nodes as before (0: does not wait)."""

    type: Literal["terminate_instance"]
    replacement_timeout_s: float = Field(600.0, ge=0)


FaultAction = Annotated[CommandAction | TerminateInstanceAction, Field(discriminator="type")]


class Deployment(_Spec):
    """A running Meridian deployment and how drills act on it."""

    name: str = Field(pattern=_NAME)
    control_plane: str
    routers: list[str] = Field(min_length=1)
    # Each router's gRPC listener (host:port, KServe v2), in `routers`' order; without them a
    # drill's gRPC share of the load goes over the other protocols (the report says so).
    grpc_routers: list[str] = Field(default_factory=list)
    model: str = Field(min_length=1)
    admin_key_env: str = Field("MERIDIAN_CHAOS_ADMIN_KEY", pattern=r"^[A-Z_][A-Z0-9_]*$")
    # The routers' metrics token (or the cluster token): their /metrics answers no one else.
    metrics_token_env: str = Field("MERIDIAN_CHAOS_METRICS_TOKEN", pattern=r"^[A-Z_][A-Z0-9_]*$")
    # Without the routers' and nodes' journals a run cannot tell a lost request from one
    # that ran, or count duplicates: at least one source is required.
    journals: list[JournalSource] = Field(min_length=1)
    actions: dict[FaultKind, FaultAction] = Field(default_factory=dict)
    command_timeout_s: float = Field(60.0, gt=0)
    # After the load ends, how long nodes get to journal what they were still finishing.
    settle_s: float = Field(5.0, ge=0)

    @field_validator("control_plane")
    @classmethod
    def _control_plane_url(cls, v: str) -> str:
        return _http_url(v)

    @field_validator("routers")
    @classmethod
    def _router_urls(cls, v: list[str]) -> list[str]:
        return [_http_url(u) for u in v]

    @model_validator(mode="after")
    def _unique_sources(self) -> Deployment:
        names = [s.name for s in self.journals]
        if len(names) != len(set(names)):
            raise ValueError("journal source names must be unique")
        return self

    def admin_key(self) -> str:
        """The admin API key, from the environment variable the file names."""
        key = os.environ.get(self.admin_key_env, "")
        if not key:
            raise DeploymentError(f"deployment {self.name}: set {self.admin_key_env} to an admin API key")
        return key

    def metrics_token(self) -> str | None:
        """The token the routers' /metrics answer, from the environment (None: unset, and
        what only the routers' metrics show, ejections say, is not observed)."""
        return os.environ.get(self.metrics_token_env) or None


def load_deployment(path: str | Path) -> Deployment:
    """Read and validate a deployment file; DeploymentError names the file and the field."""
    return load_yaml_model(path, Deployment, DeploymentError, "deployment file")
