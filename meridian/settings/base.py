"""What every settings class stands on: the config file, the shared cluster token, the log
and listener settings every process has (the package docstring says how they are read)."""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import ClassVar

from pydantic import AliasChoices, Field
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

CLUSTER_TOKEN_FIELD = Field(
    validation_alias=AliasChoices("MERIDIAN_CLUSTER_TOKEN", "cluster_token"),
    description="Shared secret nodes and routers present to the control plane.",
)


# Environment variable naming the config file when no --config flag was given.
CONFIG_ENV = "MERIDIAN_CONFIG"
_config_path: Path | None = None


def use_config_file(path: Path | None) -> None:
    """Make every settings class built from now on read `path` (None: only MERIDIAN_CONFIG)."""
    global _config_path
    _config_path = path


def config_file_path() -> Path | None:
    """The config file in force: the one given to use_config_file, else MERIDIAN_CONFIG's."""
    if _config_path is not None:
        return _config_path
    named = os.environ.get(CONFIG_ENV)
    return Path(named) if named else None


class FileSettings(BaseSettings):
    """Settings that also read their section of the config file, below the environment."""

    # Top-level key of this class's section in the config file ("" for none).
    config_section: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Earlier sources win: flags (init), then the environment, then the file.
        sources = (init_settings, env_settings, dotenv_settings, file_secret_settings)
        path = config_file_path()
        if not cls.config_section or path is None or not _has_section(path, cls.config_section):
            return sources
        return (*sources, YamlConfigSettingsSource(settings_cls, yaml_file=path,
                                                   yaml_config_section=cls.config_section))


def _has_section(path: Path, section: str) -> bool:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False  # meridian.config_file reports it; here the file is simply not read
    return isinstance(data, dict) and isinstance(data.get(section), dict)


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


class LogSettings(FileSettings):
    """Every process's logs (`MERIDIAN_LOG_*`, section `log:`): one line per record, as text
    or as one JSON object (ts, level, logger, msg and the record's extra fields)."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_LOG_", extra="ignore")
    config_section: ClassVar[str] = "log"

    format: LogFormat = LogFormat.TEXT
    level: str = Field("INFO", pattern=r"(?i)^(DEBUG|INFO|WARNING|ERROR|CRITICAL)$")


class ListenerSettings(FileSettings):
    """Limits of a process's HTTP listener (meridian.http_server), under its own prefix:
    `MERIDIAN_ROUTER_MAX_HEADER_BYTES`, `MERIDIAN_NODE_HEADER_TIMEOUT_S`, `MERIDIAN_CP_…`."""

    # A request head (request line + headers) over this is answered 431.
    max_header_bytes: int = Field(32 * 1024, ge=1024)
    # The whole head must arrive within this of its first byte, the body within
    # body_timeout_s of the head's end: 408 and the connection closed otherwise (an HTTP/2
    # stream is answered 408 and reset; its connection stays).
    header_timeout_s: float = Field(15.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)
    # Open connections beyond this are answered 503 with Retry-After and closed at once.
    max_connections: int = Field(4096, ge=1)
    # The same, per client address (0: no such limit). Leave it off behind a load balancer
    # or proxy, whose few addresses carry every client's connections.
    max_connections_per_client: int = Field(0, ge=0)
    # HTTP/1.1 pipelining: with this many requests of one connection waiting behind the one
    # being answered, nothing more of it is parsed or read until one is answered.
    max_pipelined_requests: int = Field(8, ge=1, le=1024)
    # HTTP/2 (the router's public listener, meridian.http2): a connection that sends more
    # control frames than this within a second (SETTINGS, PING, PRIORITY, RST_STREAM,
    # WINDOW_UPDATE beyond two per DATA frame sent, unknown types, empty DATA) is sent GOAWAY
    # ENHANCE_YOUR_CALM and closed. A real client sends a few SETTINGS and PINGs per
    # connection and at most one RST_STREAM per stream it cancels (100 streams at once), so
    # 1,000 leaves it tenfold room; the flood it stops sent 86,000 a second.
    http2_max_control_frames_per_s: int = Field(1000, ge=10)
