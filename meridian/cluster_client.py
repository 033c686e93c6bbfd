"""The one client of the control plane's cluster API: the calls nodes and routers make with the
cluster token (register, heartbeat, deregister, weight sources, the routing table, scale-up, the
routers' flow-control backlog).

What `admin_client` is for the admin API: requests and answers are the kernel's contracts
(`meridian.contracts`), so no caller builds a JSON body or a path by hand, and every failure is
one typed error, `ClusterAPIError`: the control plane's status with its problem's detail and
the Retry-After it gave (seconds, within an hour), or status 0 when it could not be reached
(the transport error is the cause) or answered something that does not parse. What a failure
means is the caller's to decide: a node keeps serving, a router keeps its table, a scale-up is
asked for again later.

The client is pooled and every call has a timeout: the endpoint's, except the routing-table
long-poll, which may legitimately stay silent for its wait and gets that much more.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, SecretStr, ValidationError

from meridian.contracts import (
    HEADER_TABLE_BUILD,
    TABLE_DELTA_IM,
    HeartbeatAck,
    NodeHeartbeat,
    NodeRegistered,
    NodeRegistration,
    RouterBacklog,
    RoutingTable,
    RoutingTableDelta,
    ScaleUpRequest,
    WeightSources,
    WeightSourcesRequest,
)

M = TypeVar("M", bound=BaseModel)

ROUTING_TABLE_PATH = "/v1/routing-table"
# A long-poll is answered within its wait; the read may take this much longer (a busy control plane).
LONG_POLL_MARGIN_S = 10.0
# Retry-After values past this are not taken as a turn (the control plane gives seconds).
_RETRY_AFTER_MAX_S = 3600.0
_JSON = {"content-type": "application/json"}


class ClusterAPIError(Exception):
    """A cluster call failed: the control plane's answer, or why there was none (status 0)."""

    def __init__(self, status: int, detail: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"control plane answered {status}: {detail}" if status else detail)
        self.status = status
        self.detail = detail
        self.retry_after_s = retry_after_s

    @property
    def unreachable(self) -> bool:
        return self.status == 0

    @classmethod
    def of(cls, resp: httpx.Response) -> ClusterAPIError:
        return cls(resp.status_code, _detail(resp), _retry_after_s(resp))


@dataclass(frozen=True, slots=True)
class ClusterEndpoint:
    """Where the control plane is and how its callers are held to time and connections (each
    plane builds it from its own settings)."""

    url: str
    token: SecretStr | None
    timeout_s: float
    connect_timeout_s: float | None = None  # None: timeout_s
    max_connections: int = 4



@dataclass(frozen=True, slots=True)
class TableAnswer:
    """One routing-table poll: a whole table, a delta on the table held, or neither (unchanged)."""

    table: RoutingTable | None = None
    delta: RoutingTableDelta | None = None
    build: str | None = None  # the control plane's build id of the table answered

    @property
    def unchanged(self) -> bool:
        return self.table is None and self.delta is None


class ClusterClient:
    """The cluster API's calls (the module docstring); `transport` for tests."""

    def __init__(self, endpoint: ClusterEndpoint, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._endpoint = endpoint
        token = endpoint.token
        self._http = httpx.AsyncClient(
            base_url=endpoint.url.rstrip("/"),
            headers={"authorization": f"Bearer {token.get_secret_value()}"} if token else {},
            timeout=self._timeout(endpoint.timeout_s),
            limits=httpx.Limits(max_connections=endpoint.max_connections,
                                max_keepalive_connections=max(1, endpoint.max_connections // 2)),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> ClusterClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    # --- nodes -----------------------------------------------------------------------------

    async def register(self, registration: NodeRegistration) -> NodeRegistered:
        resp = await self._send("POST", "/v1/nodes/register", registration)
        return _answer(resp, NodeRegistered)

    async def heartbeat(self, node_id: str, beat: NodeHeartbeat) -> HeartbeatAck | None:
        """The control plane's ack; None when it no longer knows the node (register again)."""
        resp = await self._send("POST", f"/v1/nodes/{quote(node_id, safe='')}/heartbeat", beat)
        if resp.status_code == HTTPStatus.NOT_FOUND:
            return None
        return _answer(resp, HeartbeatAck)

    async def deregister(self, node_id: str) -> None:
        """Remove the node; a node the control plane does not know is gone already."""
        resp = await self._send("DELETE", f"/v1/nodes/{quote(node_id, safe='')}")
        if resp.status_code not in (HTTPStatus.OK, HTTPStatus.NO_CONTENT, HTTPStatus.NOT_FOUND):
            raise ClusterAPIError.of(resp)

    # --- weights ---------------------------------------------------------------------------

    async def weight_sources(self, digest: str, request: WeightSourcesRequest) -> WeightSources:
        """The peers a node may fetch the model's bytes from; a 403 when its zone forbids it."""
        resp = await self._send("POST", f"/v1/weights/{quote(digest, safe='')}/sources", request)
        return _answer(resp, WeightSources)

    async def withdraw_weights(self, digest: str, node_id: str) -> None:
        resp = await self._send("DELETE", f"/v1/weights/{quote(digest, safe='')}/nodes/{quote(node_id, safe='')}")
        if resp.status_code not in (HTTPStatus.OK, HTTPStatus.NO_CONTENT, HTTPStatus.NOT_FOUND):
            raise ClusterAPIError.of(resp)

    # --- routers ---------------------------------------------------------------------------

    async def routing_table(self, *, version: int | None = None, build: str | None = None,
                            wait_s: float = 0.0) -> TableAnswer:
        """The table, or, given the `version` held, nothing until it changes (at most `wait_s`),
        or with its `build` a delta on it."""
        headers: dict[str, str] = {}
        params: dict[str, str] = {}
        if version is not None:
            headers["if-none-match"] = f'"{version}"'
            if build is not None:
                headers["a-im"] = TABLE_DELTA_IM
                headers[HEADER_TABLE_BUILD] = build
            if wait_s > 0:
                params["wait"] = f"{wait_s:g}"
        resp = await self._call(self._http.build_request("GET", ROUTING_TABLE_PATH, headers=headers, params=params,
                                                         timeout=self._timeout(wait_s + LONG_POLL_MARGIN_S)))
        if resp.status_code == HTTPStatus.NOT_MODIFIED:
            return TableAnswer()
        answered_build = resp.headers.get(HEADER_TABLE_BUILD)
        if resp.status_code == HTTPStatus.IM_USED:
            return TableAnswer(delta=_parse(resp, RoutingTableDelta), build=answered_build)
        return TableAnswer(table=_answer(resp, RoutingTable), build=answered_build)

    async def scale_up(self, model: str, request: ScaleUpRequest) -> None:
        """Ask for a replica of `model` (404: no such deployment)."""
        resp = await self._send("POST", f"/v1/deployments/{quote(model, safe='')}/scale-up", request)
        if resp.status_code != HTTPStatus.OK:
            raise ClusterAPIError.of(resp)

    async def router_backlog(self, router_id: str, report: RouterBacklog) -> None:
        """Replace this router's report of what its flow control holds."""
        resp = await self._send("PUT", f"/v1/routers/{quote(router_id, safe='')}/backlog", report)
        if resp.status_code != HTTPStatus.NO_CONTENT:
            raise ClusterAPIError.of(resp)

    # --- sending ---------------------------------------------------------------------------

    def _timeout(self, read_s: float) -> httpx.Timeout:
        """The endpoint's timeouts, with `read_s` for the answer (a long-poll waits longer)."""
        e = self._endpoint
        return httpx.Timeout(e.timeout_s, connect=e.connect_timeout_s or e.timeout_s, read=read_s)

    async def _send(self, method: str, path: str, body: BaseModel | None = None) -> httpx.Response:
        content = body.model_dump_json().encode() if body is not None else None
        request = self._http.build_request(method, path, content=content, headers=_JSON if body is not None else None)
        return await self._call(request)

    async def _call(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self._http.send(request)
        except httpx.HTTPError as exc:
            raise ClusterAPIError(0, f"control plane unreachable ({type(exc).__name__}: {exc})") from exc


def _answer(resp: httpx.Response, model: type[M]) -> M:
    if resp.status_code != HTTPStatus.OK:
        raise ClusterAPIError.of(resp)
    return _parse(resp, model)


def _parse(resp: httpx.Response, model: type[M]) -> M:
    try:
        return model.model_validate_json(resp.content)
    except ValidationError as exc:
        raise ClusterAPIError(0, f"the control plane's {model.__name__} does not parse: {exc}") from exc


def _retry_after_s(resp: httpx.Response) -> float | None:
    try:
        value = float(resp.headers.get("retry-after", ""))
    except ValueError:
        return None
    return value if 0 <= value <= _RETRY_AFTER_MAX_S else None


def _detail(resp: httpx.Response) -> str:
    """The problem's detail (or title), else the start of whatever answered."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        return str(body.get("detail") or body.get("title") or body)[:300]
    return str(body)[:300]
