"""How the control plane reaches the clouds (`MERIDIAN_PROVIDER_*`, section `provider:`): read
by the control plane's fleet loops and the cloud drivers they call."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from meridian.contracts import ProviderName
from meridian.settings.base import FileSettings


class ProviderSettings(FileSettings):
    """How the control plane reaches each provider's API (its node-group drivers and quotas)."""

    model_config = SettingsConfigDict(env_prefix="MERIDIAN_PROVIDER_", extra="ignore")
    config_section: ClassVar[str] = "provider"

    # Providers whose drivers the reconciler uses; the on-prem one needs no credentials. Any
    # registered provider (providers.provider.PROVIDERS), checked where the drivers are built.
    enabled: list[ProviderName] = Field(default_factory=lambda: ["onprem"])
    # AWS: credentials come from boto3's usual chain (env, profile, instance role).
    # An endpoint URL points every AWS client at an S3/EC2-compatible stand-in (moto in tests).
    aws_endpoint_url: str | None = None
    # Names of the Auto Scaling groups and launch templates iac creates: "<prefix>-<...>".
    aws_name_prefix: str = "meridian"
    # GCP: the project that holds the managed instance groups; credentials from Application
    # Default Credentials unless an endpoint (a local stand-in) is set, which needs none.
    gcp_project: str | None = None
    gcp_endpoint_url: str | None = None
    gcp_name_prefix: str = "meridian"
    # Upper bound on one call to a provider's API (each SDK call; waits poll within it).
    call_timeout_s: float = Field(30.0, gt=0)
    # How long a driver waits for a cloud operation to finish (a resize: until its instances
    # exist, not until they boot). Below the control plane's driver_timeout_s (60 s), so a
    # slow resize ends as the driver's own clear error; the reconciler retries it.
    operation_timeout_s: float = Field(45.0, gt=0)
