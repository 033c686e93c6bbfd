"""The operator CLI's settings (`meridian status`, `meridian keys …`; `MERIDIAN_*`, section `cli:`)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict

from meridian.settings.base import FileSettings


class CLISettings(FileSettings):
    """Settings of the operator CLI (`meridian status`, `meridian keys …`)."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_", extra="ignore")
    config_section: ClassVar[str] = "cli"

    control_plane_url: str = "http://127.0.0.1:8081"
    api_key: SecretStr | None = None
    timeout_s: float = Field(10.0, gt=0)
    # Where `meridian demo` keeps the models it fetches and converts (SmolLM2); None:
    # $XDG_CACHE_HOME/meridian/models, else ~/.cache/meridian/models.
    model_cache_dir: Path | None = None
