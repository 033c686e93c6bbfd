"""A small synchronous client of the control plane's admin API for the CLI."""

from __future__ import annotations

from typing import Any

import httpx

from meridian.contracts import NodeView, RegionInfo


class AdminAPIError(Exception):
    """The control plane answered with an error (its problem body is in the message)."""

    def __init__(self, status: int, title: str, detail: str | None) -> None:
        super().__init__(f"{status} {title}" + (f": {detail}" if detail else ""))
        self.status = status


class AdminClient:
    """Calls the admin API with an API key; every call has a timeout."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 10.0) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.HTTPError as e:
            raise AdminAPIError(0, "control plane unreachable", f"{self._http.base_url}: {e}") from e
        if r.status_code >= 400:
            try:
                body = r.json()
            except ValueError:
                body = {}
            raise AdminAPIError(r.status_code, body.get("title", r.reason_phrase), body.get("detail"))
        return r

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        r = self._request(method, path, **kw)
        return r.json() if r.content else None

    def _list(self, path: str) -> list[Any]:
        """Every item of a paginated listing, following its Link: rel="next" headers."""
        items: list[Any] = []
        url: str | None = path
        while url is not None:
            r = self._request("GET", url)
            items.extend(r.json())
            url = r.links.get("next", {}).get("url")
        return items

    def nodes(self) -> list[NodeView]:
        return [NodeView.model_validate(n) for n in self._list("/v1/nodes")]

    def regions(self) -> list[RegionInfo]:
        return [RegionInfo.model_validate(r) for r in self._list("/v1/regions")]

    def create_key(
        self, *, name: str, tenant: str, zone: str, scopes: list[str], models: list[str] | None
    ) -> dict[str, Any]:
        body = {"name": name, "tenant": tenant, "zone": zone, "scopes": scopes, "models": models}
        return self._call("POST", "/v1/api-keys", json=body)

    def list_keys(self) -> list[dict[str, Any]]:
        return self._list("/v1/api-keys")

    def revoke_key(self, key_id: str) -> None:
        self._call("DELETE", f"/v1/api-keys/{key_id}")

    def preview_plan(self, time_limit_s: float) -> dict[str, Any]:
        # The solve may take up to its time limit; the call waits for it.
        timeout = time_limit_s + 30.0
        result: dict[str, Any] = self._call("POST", "/v1/placement/plans", json={"time_limit_s": time_limit_s},
                                            timeout=timeout)
        return result

    def apply_plan(self, plan_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/v1/placement/plans/{plan_id}/apply")
        return result
