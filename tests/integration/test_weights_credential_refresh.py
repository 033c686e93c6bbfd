"""A node's S3 credentials are refreshed while it pulls (issue 18, finding 10).

The S3 origin read static `AWS_*` variables only, which the EC2 boot script filled once
with the instance role's temporary credentials: hours later they expired and the node
could no longer pull. Now credentials come from botocore's chain. Here a stand-in for the
ECS/EKS container credentials endpoint (one of the chain's sources, like EC2's instance
metadata) hands out short-lived access keys of an IAM user of a moto server that checks
every signature, rotating them as a pull goes on and deleting old ones for good: the pull
outlives its first credentials and still completes, and its first key is dead by then.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest
from aws_moto import KEYS
from fastapi import FastAPI
from router_harness import ServerGroup

from data_plane.weights.cache import NodeCache
from data_plane.weights.origins import OriginDenied, OriginURI
from data_plane.weights.origins.s3 import S3Origin
from data_plane.weights.origins.sigv4 import AwsCredentials
from data_plane.weights.pull import WeightPuller
from data_plane.weights.push import push_model
from meridian.settings.node import WeightSettings

S3_POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":["s3:*"],"Resource":"*"}]}'
ADMIN_POLICY = '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":["iam:*","s3:*"],"Resource":"*"}]}'
# The stand-in rotates its key every this many credential requests, and deletes a key two
# rotations old (so that no request signed with it can still be in flight).
ROTATE_EVERY = 20


def iam(endpoint: str, keys: dict[str, str]) -> Any:
    return boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", **keys)


@dataclass
class ContainerCredentials:
    """The ECS/EKS container credentials endpoint, issuing the node user's keys."""

    endpoint: str
    admin: dict[str, str]
    issued: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    requests: int = 0
    secrets: dict[str, str] = field(default_factory=dict)

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v2/credentials/node")
        async def credentials() -> dict[str, str]:
            self.requests += 1
            if not self.issued or self.requests % ROTATE_EVERY == 0:
                await asyncio.to_thread(self._rotate)
            key = self.issued[-1]
            # Always close to expiry: the chain must refresh, never keep what it has.
            expires = datetime.now(UTC) + timedelta(seconds=30)
            return {"AccessKeyId": key, "SecretAccessKey": self.secrets[key], "Token": "",
                    "Expiration": expires.strftime("%Y-%m-%dT%H:%M:%SZ")}

        return app

    def _rotate(self) -> None:
        client = iam(self.endpoint, self.admin)
        if len(self.issued) >= 2:
            old = self.issued[-2]
            client.delete_access_key(UserName="node", AccessKeyId=old)
            self.deleted.append(old)
        key = client.create_access_key(UserName="node")["AccessKey"]
        self.secrets[key["AccessKeyId"]] = key["SecretAccessKey"]
        self.issued.append(key["AccessKeyId"])


@pytest.fixture(scope="module")
def enforcing_moto(private_moto_server: str) -> tuple[str, dict[str, str]]:
    """A moto server with a bucket, an admin user and a node user, checking signatures."""
    setup = iam(private_moto_server, KEYS)
    for user, policy in (("admin", ADMIN_POLICY), ("node", S3_POLICY)):
        setup.create_user(UserName=user)
        setup.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=policy)
    key = setup.create_access_key(UserName="admin")["AccessKey"]
    admin = {"aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
    boto3.client("s3", endpoint_url=private_moto_server, region_name="us-east-1", **admin).create_bucket(Bucket="weights")
    httpx.post(f"{private_moto_server}/moto-api/reset-auth", content=b"0", timeout=10).raise_for_status()
    return private_moto_server, admin


@pytest.fixture
async def container_credentials(
    enforcing_moto: tuple[str, dict[str, str]], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> AsyncIterator[ContainerCredentials]:
    endpoint, admin = enforcing_moto
    stand_in = ContainerCredentials(endpoint, admin)
    servers = ServerGroup()
    try:
        url = await servers.start(stand_in.app())
        # Nothing else of this machine's AWS set-up may be found first.
        for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
        monkeypatch.setenv("AWS_CONTAINER_CREDENTIALS_FULL_URI", f"{url}/v2/credentials/node")
        yield stand_in
    finally:
        await servers.stop()


def model_dir(root: Path) -> Path:
    d = root / "model"
    d.mkdir()
    for i in range(3):
        (d / f"shard-{i}.bin").write_bytes(hashlib.shake_256(f"{i}".encode()).digest(160_000))
    (d / "config.json").write_text('{"x": 1}')
    return d


async def test_a_pull_outlives_its_first_credentials(
    container_credentials: ContainerCredentials, tmp_path: Path
) -> None:
    endpoint = container_credentials.endpoint
    # Small ranges, one at a time: a pull of a few hundred signed requests.
    settings = WeightSettings(s3_endpoint_url=endpoint, s3_region="us-east-1", cache_dir=tmp_path / "cache",
                              manifest_chunk_bytes=4096, range_bytes=4096, concurrency=2, peer_fetch=False)
    source = model_dir(tmp_path)
    await push_model(source, "s3://weights/m", settings)
    first = container_credentials.issued[0]

    pulled = await WeightPuller(settings, NodeCache(settings.cache_dir)).pull("s3://weights/m")

    for f in source.iterdir():
        assert (pulled.model.path / f.name).read_bytes() == f.read_bytes()
    # The pull went on across several keys, and its first one was deleted meanwhile...
    assert first in container_credentials.deleted
    assert len(container_credentials.issued) >= 4
    # ...so credentials taken once at start (what the node did before) no longer work.
    frozen = S3Origin(OriginURI.parse("s3://weights/m"), settings,
                      AwsCredentials(first, container_credentials.secrets[first]))
    try:
        with pytest.raises(OriginDenied, match="InvalidAccessKeyId"):
            await frozen.read("config.json")
    finally:
        await frozen.aclose()
