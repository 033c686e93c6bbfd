"""Cloud credentials for the object-store origins: the clouds' own maintained chains,
refreshed before they expire.

A node lives for days; the credentials it gets from its instance role, a web identity or
a service account last an hour or so. The S3 origin used to read static `AWS_*` variables
only (which the EC2 boot script filled once with the role's temporary credentials, dead
hours later), and GCS took a static token or the metadata server only: after expiry a node
could no longer pull a new model or serve a peer from the bucket.

So credentials come from the chains the clouds' SDKs use, not from our own code:

- AWS: botocore's default chain: environment, shared credentials and config files
  (profiles, `credential_process`, SSO, assume-role), web identity (EKS IRSA), ECS/EKS
  container credentials, and EC2 instance metadata (IMDSv2), as `RefreshableCredentials`
  that botocore renews ahead of expiry;
- GCP: google-auth's Application Default Credentials: `GOOGLE_APPLICATION_CREDENTIALS`
  (service-account key, workload identity federation, authorized user), gcloud's ADC file,
  the GCE/GKE metadata server; tokens refreshed ahead of expiry.

Only the credential providers are used: requests are still signed (SigV4) and sent by the
origins' own pooled httpx clients, whose parallel ranged fetch the weights bench measures.
Both libraries do blocking I/O when they refresh, so that runs in a worker thread, once
for all the requests waiting on it; in between, a credential is a cached value.

This is the only module of the data plane that imports botocore or google (the
import-linter contracts name it): no SDK client, just the credential chains.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

import botocore.credentials
import botocore.exceptions
import botocore.session
import google.auth
import google.auth.credentials
import google.auth.exceptions
import google.auth.transport.urllib3
import urllib3

from data_plane.weights.origins.base import OriginDenied, OriginUnavailable
from data_plane.weights.origins.sigv4 import AwsCredentials

GCS_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"


class AwsCredentialSource(Protocol):
    """Where an S3 origin gets the credentials of its next request (None: unsigned)."""

    async def get(self) -> AwsCredentials | None: ...


class StaticAwsCredentials:
    """Credentials given as they are (settings, tests)."""

    def __init__(self, credentials: AwsCredentials | None) -> None:
        self._credentials = credentials

    async def get(self) -> AwsCredentials | None:
        return self._credentials


class AwsCredentialChain:
    """botocore's default credential chain, frozen per use and refreshed before expiry."""

    def __init__(self) -> None:
        self._source: botocore.credentials.Credentials | None = None
        self._resolved = False
        self._frozen: AwsCredentials | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> AwsCredentials | None:
        if self._resolved and not self._refresh_needed():
            return self._frozen
        async with self._lock:
            if not self._resolved or self._refresh_needed():
                try:
                    self._frozen = await asyncio.to_thread(self._load)
                except botocore.exceptions.BotoCoreError as exc:
                    raise OriginUnavailable(f"AWS credentials could not be loaded or refreshed: {exc}") from exc
        return self._frozen

    def _refresh_needed(self) -> bool:
        source = self._source
        return isinstance(source, botocore.credentials.RefreshableCredentials) and source.refresh_needed()

    def _load(self) -> AwsCredentials | None:
        """(In a worker thread.) Resolve the chain once, then freeze the current credentials,
        which refreshes them when they are about to expire."""
        if not self._resolved:
            # AWS_PROFILE and the other variables are read by botocore itself.
            self._source = botocore.session.Session().get_credentials()
            self._resolved = True
        if self._source is None:
            return None  # nothing configured: requests go unsigned (public buckets, emulators)
        frozen = self._source.get_frozen_credentials()
        return AwsCredentials(frozen.access_key, frozen.secret_key, frozen.token)


class GcpCredentialChain:
    """google-auth's Application Default Credentials, refreshed before expiry."""

    def __init__(self) -> None:
        self._credentials: google.auth.credentials.Credentials | None = None
        self._lock = asyncio.Lock()
        self._http = urllib3.PoolManager(timeout=urllib3.Timeout(connect=5.0, read=30.0))

    async def token(self) -> str:
        """A valid access token (OriginDenied when no credentials are configured)."""
        credentials = self._credentials
        if credentials is not None and credentials.valid:
            return str(credentials.token)
        async with self._lock:
            try:
                return await asyncio.to_thread(self._refresh)
            except google.auth.exceptions.DefaultCredentialsError as exc:
                raise OriginDenied(
                    "no GCS credentials: set GOOGLE_APPLICATION_CREDENTIALS, run `gcloud auth "
                    f"application-default login`, or run on GCE/GKE ({exc})"
                ) from exc
            except google.auth.exceptions.GoogleAuthError as exc:
                raise OriginUnavailable(f"GCS credentials could not be refreshed: {exc}") from exc

    def _refresh(self) -> str:
        """(In a worker thread.) Find the credentials once; refresh them when not valid."""
        if self._credentials is None:
            self._credentials, _project = google.auth.default(scopes=[GCS_SCOPE])
        if not self._credentials.valid:
            self._credentials.refresh(google.auth.transport.urllib3.Request(self._http))
        return str(self._credentials.token)
