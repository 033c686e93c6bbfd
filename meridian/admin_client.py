"""The one client of the control plane's admin API, for the CLI, the chaos tooling and the local fabric.

Requests and answers are the kernel's models (`meridian.admin_api`, `meridian.contracts`), so
no caller builds a JSON body by hand or reads one by key. Every failure is one typed error,
`AdminAPIError`: a problem+json answer (status, title, detail, errors, and whether it came
with Retry-After), an invalid request refused before it is sent (422, as the control plane
would refuse it), an answer that does not parse, or a control plane that cannot be reached
(status 0, the transport error as its cause). Every call has a timeout.

`AdminClient` (sync: the CLI, the local fabric's threads) and `AsyncAdminClient` (the chaos
drills, in an event loop) make the same calls: each call is described once, as an `_Call`
(method, path, body, how to read the answer), and each client only sends it. A client has
the calls its users make (tenants and models only the CLI manages, so only the sync one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Generic, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from meridian.admin_api import (
    PROBLEM_MEDIA_TYPE,
    ApiKeyCreate,
    ApiKeyCreated,
    ApiKeyView,
    AuditEntryView,
    AutoscalerStatus,
    DeploymentUpsert,
    ModelFitView,
    ModelUpsert,
    ModelView,
    PlanRequest,
    PlanView,
    ReconcilerStatus,
    TenantCreate,
    TenantPatch,
    TenantView,
)
from meridian.contracts import DeploymentView, NodeView, RegionInfo

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# A placement preview may solve for up to its time limit; the call waits this much longer.
PLAN_TIMEOUT_MARGIN_S = 30.0


class AdminAPIError(Exception):
    """The admin call failed: the control plane's problem answer, or why there was none.

    `status` 0 means the control plane could not be reached (the httpx error is the cause); its
    message then has no status in front. `problem` says the answer was application/problem+json
    (a control plane's: anything else answering is not one); `retry_after` is its header;
    `base_url` the client's, so that a caller can go and see what answered instead.
    """

    def __init__(
        self,
        status: int,
        title: str,
        detail: str | None = None,
        *,
        errors: list[dict[str, Any]] | None = None,
        retry_after: str | None = None,
        problem: bool = False,
    ) -> None:
        super().__init__((f"{status} {title}" if status else title) + (f": {detail}" if detail else ""))
        self.status, self.title, self.detail, self.errors = status, title, detail, errors
        self.retry_after, self.problem = retry_after, problem
        self.base_url: str | None = None

    @property
    def unreachable(self) -> bool:
        return self.status == 0

    def field_errors(self) -> list[str]:
        """One "where: what" line per field error of a 422 (the body's "body" prefix dropped)."""
        lines = []
        for err in self.errors or []:
            loc = [str(p) for p in err.get("loc", []) if isinstance(p, str | int)] if isinstance(err, dict) else []
            if loc[:1] == ["body"]:
                loc = loc[1:]
            msg = err.get("msg", "invalid") if isinstance(err, dict) else str(err)
            lines.append(f"{'.'.join(loc) or '(request)'}: {msg}")
        return lines

    @classmethod
    def of_response(cls, r: httpx.Response) -> AdminAPIError:
        """The error an answer of 400 or more stands for."""
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = {}
        errors = body.get("errors")
        return cls(r.status_code, str(body.get("title") or r.reason_phrase), body.get("detail"),
                   errors=errors if isinstance(errors, list) else None,
                   retry_after=r.headers.get("retry-after"),
                   problem=r.headers.get("content-type", "").startswith(PROBLEM_MEDIA_TYPE))

    @classmethod
    def invalid_request(cls, e: ValidationError) -> AdminAPIError:
        """A request body the control plane would refuse, refused here in the same words."""
        errors = [{"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in e.errors()]
        return cls(422, HTTPStatus(422).phrase, "request failed validation", errors=errors)


def request_body(model: type[M], **fields: Any) -> M:
    """`model(**fields)`, or the AdminAPIError (422) the control plane would answer with."""
    try:
        return model(**fields)
    except ValidationError as e:
        raise AdminAPIError.invalid_request(e) from None


def _list_of(model: type[M]) -> Callable[[Any], list[M]]:
    return TypeAdapter(list[model]).validate_python  # type: ignore[valid-type]


def _nothing(_: Any) -> None:
    return None


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One admin call: what to send, and `parse` to read a successful answer's JSON.

    A `paged` call follows the Link: rel="next" headers; `parse` reads every page's items.
    """

    method: str
    path: str
    parse: Callable[[Any], T]
    body: BaseModel | None = None
    params: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float | None = None
    paged: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)

    def kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"params": dict(self.params) or None}
        if self.headers:
            kw["headers"] = dict(self.headers)
        if self.body is not None:
            # Only what the caller set: the control plane fills in its own defaults.
            kw["json"] = self.body.model_dump(mode="json", exclude_unset=True)
        if self.timeout_s is not None:
            kw["timeout"] = self.timeout_s
        return kw


def _paged(path: str, parse: Callable[[Any], T], **params: str) -> _Call[T]:
    return _Call("GET", path, parse, params=params, paged=True)


# --- the calls ---------------------------------------------------------------------------


def _regions() -> _Call[list[RegionInfo]]:
    return _paged("/v1/regions", _list_of(RegionInfo))


def _nodes() -> _Call[list[NodeView]]:
    return _paged("/v1/nodes", _list_of(NodeView))


def _create_key(body: ApiKeyCreate) -> _Call[ApiKeyCreated]:
    return _Call("POST", "/v1/api-keys", ApiKeyCreated.model_validate, body=body)


def _list_keys(tenant: str | None, include_revoked: bool) -> _Call[list[ApiKeyView]]:
    params = {"tenant": tenant} if tenant is not None else {}
    if include_revoked:
        params["include_revoked"] = "true"
    return _paged("/v1/api-keys", _list_of(ApiKeyView), **params)


def _revoke_key(key_id: str) -> _Call[None]:
    return _Call("DELETE", f"/v1/api-keys/{quote(key_id, safe='')}", _nothing)


def _tenants() -> _Call[list[TenantView]]:
    return _paged("/v1/tenants", _list_of(TenantView))


def _create_tenant(body: TenantCreate) -> _Call[TenantView]:
    return _Call("POST", "/v1/tenants", TenantView.model_validate, body=body)


def _patch_tenant(name: str, body: TenantPatch) -> _Call[TenantView]:
    return _Call("PATCH", _tenant_path(name), TenantView.model_validate, body=body)


def _if_match(version: int | None) -> dict[str, str]:
    """Only if the resource is still at `version` (the API's ETags are its quoted versions)."""
    return {"if-match": f'"{version}"'} if version is not None else {}


def _tenant_path(name: str) -> str:
    return f"/v1/tenants/{quote(name, safe='')}"


def _get_tenant(name: str) -> _Call[TenantView]:
    return _Call("GET", _tenant_path(name), TenantView.model_validate)


def _delete_tenant(name: str, version: int | None) -> _Call[None]:
    return _Call("DELETE", _tenant_path(name), _nothing, headers=_if_match(version))


def _models() -> _Call[list[ModelView]]:
    return _paged("/v1/models", _list_of(ModelView))


def _model_path(name: str) -> str:
    # Model names may hold '/', which the route takes as part of the name.
    return f"/v1/models/{quote(name, safe='/')}"


def _put_model(name: str, body: ModelUpsert) -> _Call[ModelView]:
    return _Call("PUT", _model_path(name), ModelView.model_validate, body=body)


def _get_model(name: str) -> _Call[ModelView]:
    return _Call("GET", _model_path(name), ModelView.model_validate)


def _delete_model(name: str, version: int | None) -> _Call[None]:
    return _Call("DELETE", _model_path(name), _nothing, headers=_if_match(version))


def _deployments() -> _Call[list[DeploymentView]]:
    return _paged("/v1/deployments", _list_of(DeploymentView))


def _model_fit(name: str, spot: bool) -> _Call[ModelFitView]:
    params = {"spot": "true"} if spot else {}
    return _Call("GET", f"{_model_path(name)}/fit", ModelFitView.model_validate, params=params)


@dataclass(frozen=True)
class AuditPage:
    """One page of the audit log, newest first; `next_cursor` asks for the older entries (None: no more)."""

    entries: list[AuditEntryView]
    next_cursor: str | None


def _audit(limit: int, cursor: str | None, filters: Mapping[str, str | None]) -> _Call[list[AuditEntryView]]:
    params = {k: v for k, v in {**filters, "cursor": cursor}.items() if v is not None}
    return _Call("GET", "/v1/audit", _list_of(AuditEntryView), params={"limit": str(limit), **params})


def _deployment_path(model: str) -> str:
    # Model names may hold '/', which the route takes as part of the name.
    return f"/v1/deployments/{quote(model, safe='/')}"


def _put_deployment(model: str, body: DeploymentUpsert) -> _Call[DeploymentView]:
    return _Call("PUT", _deployment_path(model), DeploymentView.model_validate, body=body)


def _get_deployment(model: str) -> _Call[DeploymentView]:
    return _Call("GET", _deployment_path(model), DeploymentView.model_validate)


def _delete_deployment(model: str, version: int | None) -> _Call[None]:
    return _Call("DELETE", _deployment_path(model), _nothing, headers=_if_match(version))


def _preview_plan(body: PlanRequest) -> _Call[PlanView]:
    timeout = body.time_limit_s + PLAN_TIMEOUT_MARGIN_S
    return _Call("POST", "/v1/placement/plans", PlanView.model_validate, body=body, timeout_s=timeout)


def _apply_plan(plan_id: str) -> _Call[PlanView]:
    return _Call("POST", f"/v1/placement/plans/{quote(plan_id, safe='')}/apply", PlanView.model_validate)


def _reconciler_status() -> _Call[ReconcilerStatus]:
    return _Call("GET", "/v1/reconciler/status", ReconcilerStatus.model_validate)


def _autoscaler_status(model: str | None) -> _Call[list[AutoscalerStatus]]:
    params = {"model": model} if model is not None else {}
    return _paged("/v1/autoscaler/status", _list_of(AutoscalerStatus), **params)


# --- sending them ------------------------------------------------------------------------


def _checked(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 400:
        raise AdminAPIError.of_response(r)
    return r


def _unreachable(base_url: httpx.URL, e: httpx.HTTPError) -> AdminAPIError:
    error = AdminAPIError(0, "control plane unreachable", f"{base_url}: {str(e) or type(e).__name__}")
    error.base_url = str(base_url)
    return error


def _unexpected(call: _Call[Any], r: httpx.Response, why: object) -> AdminAPIError:
    return AdminAPIError(r.status_code, "unexpected answer", f"{call.method} {call.path}: {why}")


def _body(call: _Call[Any], r: httpx.Response) -> Any:
    """The answer's JSON (None when empty); a paged call's must be a list of items."""
    try:
        value = r.json() if r.content else None
    except ValueError as e:
        raise _unexpected(call, r, e) from e
    if call.paged and not isinstance(value, list):
        raise _unexpected(call, r, "not a list")
    return value


def _parsed(call: _Call[T], r: httpx.Response, value: Any) -> T:
    """`call.parse(value)`: an answer that is not what the API promises is an AdminAPIError."""
    try:
        return call.parse(value)
    except ValueError as e:  # pydantic's ValidationError is one
        raise _unexpected(call, r, e) from e


def _next_url(r: httpx.Response) -> str | None:
    return r.links.get("next", {}).get("url")


def _headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class AdminClient:
    """The admin API over one HTTP connection pool (close it, or use `with`)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 10.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(api_key), timeout=timeout_s,
                                  transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            return _checked(self._http.request(method, url, **kw))
        except httpx.HTTPError as e:
            raise _unreachable(self._http.base_url, e) from e
        except AdminAPIError as e:
            e.base_url = str(self._http.base_url)
            raise

    def _run(self, call: _Call[T]) -> T:
        r = self._send(call.method, call.path, **call.kwargs())
        value = _body(call, r)
        while call.paged and (url := _next_url(r)) is not None:
            r = self._send("GET", url)
            value += _body(call, r)
        return _parsed(call, r, value)

    def regions(self) -> list[RegionInfo]:
        return self._run(_regions())

    def nodes(self) -> list[NodeView]:
        return self._run(_nodes())

    def create_key(self, body: ApiKeyCreate) -> ApiKeyCreated:
        """A new key; the answer is the only time its secret is shown."""
        return self._run(_create_key(body))

    def list_keys(self, tenant: str | None = None, include_revoked: bool = False) -> list[ApiKeyView]:
        return self._run(_list_keys(tenant, include_revoked))

    def revoke_key(self, key_id: str) -> None:
        self._run(_revoke_key(key_id))

    def tenants(self) -> list[TenantView]:
        return self._run(_tenants())

    def create_tenant(self, body: TenantCreate) -> TenantView:
        return self._run(_create_tenant(body))

    def update_tenant(self, name: str, body: TenantPatch) -> TenantView:
        """Change the fields `body` sets; the others stay as they are."""
        return self._run(_patch_tenant(name, body))

    def tenant(self, name: str) -> TenantView:
        return self._run(_get_tenant(name))

    def delete_tenant(self, name: str, version: int | None = None) -> None:
        """Delete the tenant and revoke its keys (only if still at `version`, when given)."""
        self._run(_delete_tenant(name, version))

    def models(self) -> list[ModelView]:
        return self._run(_models())

    def model(self, name: str) -> ModelView:
        return self._run(_get_model(name))

    def put_model(self, name: str, body: ModelUpsert) -> ModelView:
        return self._run(_put_model(name, body))

    def delete_model(self, name: str, version: int | None = None) -> None:
        """Delete the model (409 while it has a deployment; only if still at `version`, when given)."""
        self._run(_delete_model(name, version))

    def model_fit(self, name: str, spot: bool = False) -> ModelFitView:
        """Which GPU SKUs one replica of the model fits on, cheapest per token first."""
        return self._run(_model_fit(name, spot))

    def audit(self, limit: int = 50, cursor: str | None = None, *, resource_type: str | None = None,
              resource_id: str | None = None, actor_id: str | None = None, since: str | None = None) -> AuditPage:
        """One page of the audit log (newest first) and the cursor of the next, older one."""
        call = _audit(limit, cursor, {"resource_type": resource_type, "resource_id": resource_id,
                                      "actor_id": actor_id, "since": since})
        r = self._send(call.method, call.path, **call.kwargs())
        entries = _parsed(call, r, _body(call, r))
        next_url = _next_url(r)
        return AuditPage(entries, httpx.URL(next_url).params.get("cursor") if next_url else None)

    def deployments(self) -> list[DeploymentView]:
        return self._run(_deployments())

    def deployment(self, model: str) -> DeploymentView:
        return self._run(_get_deployment(model))

    def put_deployment(self, model: str, body: DeploymentUpsert) -> DeploymentView:
        return self._run(_put_deployment(model, body))

    def delete_deployment(self, model: str, version: int | None = None) -> None:
        """Delete the deployment (only if still at `version`, when given)."""
        self._run(_delete_deployment(model, version))

    def preview_plan(self, body: PlanRequest) -> PlanView:
        """Solve a placement preview; waits for the solve (its time limit and a margin)."""
        return self._run(_preview_plan(body))

    def apply_plan(self, plan_id: str) -> PlanView:
        return self._run(_apply_plan(plan_id))

    def reconciler_status(self) -> ReconcilerStatus:
        """The placement in force against what the providers hold, per node group."""
        return self._run(_reconciler_status())

    def autoscaler_status(self, model: str | None = None) -> list[AutoscalerStatus]:
        """Each deployment pool's counts and the autoscaler's last decision (one deployment's: `model`)."""
        return self._run(_autoscaler_status(model))


class AsyncAdminClient:
    """`AdminClient`'s calls for an event loop (close it, or use `async with`)."""

    def __init__(self, base_url: str, api_key: str | None, timeout_s: float = 10.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._http = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=_headers(api_key),
                                       timeout=timeout_s, transport=transport)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncAdminClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            return _checked(await self._http.request(method, url, **kw))
        except httpx.HTTPError as e:
            raise _unreachable(self._http.base_url, e) from e
        except AdminAPIError as e:
            e.base_url = str(self._http.base_url)
            raise

    async def _run(self, call: _Call[T]) -> T:
        r = await self._send(call.method, call.path, **call.kwargs())
        value = _body(call, r)
        while call.paged and (url := _next_url(r)) is not None:
            r = await self._send("GET", url)
            value += _body(call, r)
        return _parsed(call, r, value)

    async def regions(self) -> list[RegionInfo]:
        return await self._run(_regions())

    async def nodes(self) -> list[NodeView]:
        return await self._run(_nodes())

    async def create_key(self, body: ApiKeyCreate) -> ApiKeyCreated:
        """A new key; the answer is the only time its secret is shown."""
        return await self._run(_create_key(body))

    async def list_keys(self, tenant: str | None = None, include_revoked: bool = False) -> list[ApiKeyView]:
        return await self._run(_list_keys(tenant, include_revoked))

    async def revoke_key(self, key_id: str) -> None:
        await self._run(_revoke_key(key_id))

    async def deployments(self) -> list[DeploymentView]:
        return await self._run(_deployments())

    async def put_deployment(self, model: str, body: DeploymentUpsert) -> DeploymentView:
        return await self._run(_put_deployment(model, body))

    async def preview_plan(self, body: PlanRequest) -> PlanView:
        """Solve a placement preview; waits for the solve (its time limit and a margin)."""
        return await self._run(_preview_plan(body))

    async def apply_plan(self, plan_id: str) -> PlanView:
        return await self._run(_apply_plan(plan_id))
