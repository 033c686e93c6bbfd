"""Tenants share nothing observable through the prefix cache (issue 18, finding 3): the
router salts every request per tenant, so one tenant cannot tell from `cached_tokens`
whether another sent a prompt; tenants an operator puts in one sharing group do share."""

from __future__ import annotations

from pathlib import Path

import pytest
from tenant_fabric import MODEL, Tenant, tenant_fabric

from data_plane.model.make_tiny import make_tiny_checkpoint

ACME = Tenant("acme", "mrd_acme-tenant-key-1")
RIVAL = Tenant("rival", "mrd_rival-tenant-key-1")
# A long shared prompt: several KV blocks of 16 tokens.
SECRET = "Quarterly numbers for the board, strictly confidential: " + "revenue up, costs down. " * 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL, seed=0)


def cached(body: dict[str, object]) -> int:
    details = body["usage"].get("prompt_tokens_details") or {}  # type: ignore[union-attr]
    return int(details.get("cached_tokens", 0))


async def ask(fabric, tenant: Tenant, prompt: str, **extra: object) -> dict[str, object]:  # type: ignore[no-untyped-def]
    async with fabric.client(tenant) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, **extra})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


async def test_a_tenant_cannot_see_whether_another_sent_a_prompt(checkpoint: Path) -> None:
    async with tenant_fabric(checkpoint, [ACME, RIVAL]) as fabric:
        first = await ask(fabric, ACME, SECRET)
        assert cached(first) == 0
        # The right guess looks exactly like a wrong one to the other tenant...
        guess = await ask(fabric, RIVAL, SECRET)
        assert cached(guess) == 0
        # ...while the tenant's own repeat is served from its cache.
        again = await ask(fabric, ACME, SECRET)
        assert cached(again) >= 100
        # A salt the client sends partitions its own cache further; it cannot name another's.
        assert cached(await ask(fabric, RIVAL, SECRET, cache_salt="x")) == 0
        assert cached(await ask(fabric, RIVAL, SECRET, cache_salt="x")) >= 100


async def test_tenants_in_one_sharing_group_share_their_cache(checkpoint: Path) -> None:
    a, b = Tenant("team-a", "mrd_team-a-key-0001", cache_group="acme-corp"), Tenant("team-b", "mrd_team-b-key-0001", cache_group="acme-corp")
    async with tenant_fabric(checkpoint, [a, b, RIVAL]) as fabric:
        await ask(fabric, a, SECRET)
        assert cached(await ask(fabric, b, SECRET)) >= 100
        assert cached(await ask(fabric, RIVAL, SECRET)) == 0


async def test_a_malformed_client_salt_is_a_400(checkpoint: Path) -> None:
    async with tenant_fabric(checkpoint, [ACME]) as fabric, fabric.client(ACME) as client:
        for salt in (17, "", "s" * 257, ["a"]):
            r = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": salt})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == "cache_salt"
