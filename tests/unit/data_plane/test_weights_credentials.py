"""GCS credentials from google-auth's Application Default Credentials, refreshed when they
expire (issue 18, finding 10): a service-account key whose token endpoint is a stand-in
OAuth server (the real JWT-bearer grant, signed with the key), and the clear error a node
gets when no credentials are configured at all."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.hazmat.primitives.hashes import SHA256
from fastapi import FastAPI, Request
from router_harness import ServerGroup

from data_plane.weights.origins import OriginDenied
from data_plane.weights.origins.credentials import GCS_SCOPE, GcpCredentialChain

# Under google-auth's refresh threshold (3 min 45 s): every token is due for refresh at once.
SHORT_LIVED_S = 60


def _b64(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


class TokenServer:
    """An OAuth 2.0 token endpoint taking JWT-bearer assertions signed by one key."""

    def __init__(self, public_key: rsa.RSAPublicKey) -> None:
        self.public_key = public_key
        self.issued: list[str] = []
        self.app = FastAPI()
        self.app.post("/token")(self.token)

    async def token(self, request: Request) -> dict[str, object]:
        form = {k: v[0] for k, v in parse_qs((await request.body()).decode()).items()}
        assert form["grant_type"] == "urn:ietf:params:oauth:grant-type:jwt-bearer"
        head, claims, signature = str(form["assertion"]).split(".")
        # Verified as Google verifies it: RS256 over the JWT's first two parts.
        self.public_key.verify(_b64(signature), f"{head}.{claims}".encode(), padding.PKCS1v15(), SHA256())
        assert json.loads(_b64(claims))["scope"] == GCS_SCOPE
        token = f"ya29.token-{len(self.issued)}"
        self.issued.append(token)
        return {"access_token": token, "token_type": "Bearer", "expires_in": SHORT_LIVED_S}


@pytest.fixture
async def token_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[TokenServer]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    server = TokenServer(key.public_key())
    servers = ServerGroup()
    try:
        url = await servers.start(server.app)
        pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
        account = {"type": "service_account", "project_id": "p", "private_key_id": "k1", "private_key": pem,
                   "client_email": "node@p.iam.gserviceaccount.com", "client_id": "1",
                   "token_uri": f"{url}/token"}
        path = tmp_path / "sa.json"
        path.write_text(json.dumps(account))
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(path))
        yield server
    finally:
        await servers.stop()


async def test_an_expiring_token_is_refreshed(token_server: TokenServer) -> None:
    chain = GcpCredentialChain()
    tokens = [await chain.token() for _ in range(3)]
    assert tokens == token_server.issued == ["ya29.token-0", "ya29.token-1", "ya29.token-2"]


async def test_no_credentials_anywhere_is_a_clear_denial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(OriginDenied, match="no GCS credentials"):
        await GcpCredentialChain().token()
