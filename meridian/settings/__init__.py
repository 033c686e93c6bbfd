"""All of Meridian's settings, in one place (pydantic-settings, env prefix `MERIDIAN_`), one
module per process that reads them: `base` (the config file, logs, listeners), `control_plane`,
`providers`, `router`, `node` (with the weight store) and `cli`. A plane imports its own
module only (an import-linter contract), so a router setting cannot creep into a node.

Each process reads its own class: `MERIDIAN_CP_*` for the control plane,
`MERIDIAN_ROUTER_*` for the geo router, `MERIDIAN_NODE_*` for a data-plane node,
`MERIDIAN_PROVIDER_*` for how the control plane reaches the clouds.
`MERIDIAN_CLUSTER_TOKEN` is shared: nodes and routers present it to the control plane.
`MERIDIAN_LOG_*` is every process's log format and level (meridian.logs).

A YAML config file (`meridian --config FILE`, or `MERIDIAN_CONFIG=FILE`) holds the same
settings, one section per class (`control_plane:`, `router:`, `node:`, `weights:`,
`provider:`, `cli:`, `log:`) whose keys are the field names. Precedence, highest first:
CLI flags > environment variables > the config file > the defaults here. The file's
sections and keys are checked by meridian.config_file before any process starts.
"""

from meridian.settings.base import (
    CLUSTER_TOKEN_FIELD,
    CONFIG_ENV,
    FileSettings,
    ListenerSettings,
    LogFormat,
    LogSettings,
    config_file_path,
    use_config_file,
)

__all__ = [
    "CLUSTER_TOKEN_FIELD",
    "CONFIG_ENV",
    "FileSettings",
    "ListenerSettings",
    "LogFormat",
    "LogSettings",
    "config_file_path",
    "use_config_file",
]
