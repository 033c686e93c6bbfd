"""Helpers shared by the admin API tests: scoped keys, page walks, sample resources."""

from __future__ import annotations

from typing import Any

import httpx
from cp_harness import ControlPlane

# Llama 3 8B's shape.
MODEL_SPEC: dict[str, Any] = {
    "params_b": 8.03,
    "layers": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "attention_heads": 32,
    "hidden_size": 4096,
    "max_context": 8192,
    "target_concurrent_seqs": 16,
}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


async def scoped_key(cp: ControlPlane, scope: str, *, name: str | None = None) -> tuple[dict[str, str], str]:
    """A new key with one scope (tenant "ops"): its Authorization header and its id."""
    r = await cp.create_key(name=name or scope, tenant="ops", zone="global", scopes=[scope])
    assert r.status_code == 201, r.text
    body = r.json()
    return bearer(body["key"]), body["id"]


def next_link(response: httpx.Response) -> str | None:
    """The URL of the Link header's rel="next", if any."""
    link = response.headers.get("link")
    if link is None:
        return None
    url, _, rel = link.partition(";")
    assert rel.strip() == 'rel="next"', link
    return url.strip().removeprefix("<").removesuffix(">")


async def walk(cp: ControlPlane, url: str, headers: dict[str, str], **params: Any) -> list[list[Any]]:
    """Every page of a listing, following Link headers from `url`."""
    pages: list[list[Any]] = []
    r = await cp.http.get(url, params=params, headers=headers)
    while True:
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body, list)
        pages.append(body)
        following = next_link(r)
        if following is None:
            return pages
        r = await cp.http.get(following, headers=headers)
