"""A local stand-in of the Compute Engine v1 REST API: the paths the GCP driver calls, in memory.

There is no official Compute Engine emulator. This app serves what google-cloud-compute's REST
transport sends (paths and verbs from its `services/*/transports/rest_base.py`; bodies are the
request messages as camelCase JSON, scalar fields as query parameters):

    GET    /compute/v1/projects/{p}/regions/{r}/instanceTemplates/{t}  regionInstanceTemplates.get
    GET    /compute/v1/projects/{p}/global/instanceTemplates/{t}    instanceTemplates.get
    GET    /compute/v1/projects/{p}/regions/{r}                      regions.get
    POST   …/regions/{r}/instanceGroupManagers                       regionInstanceGroupManagers.insert
    GET    …/regions/{r}/instanceGroupManagers/{m}                   ….get
    DELETE …/regions/{r}/instanceGroupManagers/{m}                   ….delete
    POST   …/instanceGroupManagers/{m}/resize?size=N                 ….resize
    POST   …/instanceGroupManagers/{m}/listManagedInstances          ….listManagedInstances
    POST   …/instanceGroupManagers/{m}/deleteInstances               ….deleteInstances
    GET    …/regions/{r}/operations/{op}                             regionOperations.get
    POST   …/regions/{r}/operations/{op}/wait                        regionOperations.wait
    GET    /compute/v1/projects/{p}/zones/{z}/operations?filter=…    zoneOperations.list

Behaviour, and the page of the API reference (cloud.google.com/compute/docs/reference/rest/v1/…)
or guide it follows:

- Instance templates (…/regionInstanceTemplates, …/instanceTemplates): a regional template
  lives in one region (its `region` field) and is addressed under it, so the same name may
  exist in several regions of a project; a global one lives under `global`. An
  InstanceGroupManager's instanceTemplate (or, when set, its `versions[].instanceTemplate`,
  which "overrides the top-level instanceTemplate field") is a full or partial URL of either;
  a regional template, usable "in a specified region only", must be in the MIG's own region.
- Operation (…/regionOperations): a mutation answers with an Operation RUNNING that becomes
  DONE `op_delay_s` later; a failure is `error.errors[]` of {code, message} with
  `httpErrorStatusCode`. regionOperations.wait returns when the operation is DONE "or the
  request approaches the 2 minute deadline" (here `wait_max_s`).
- regionInstanceGroupManagers.resize: "The resize operation is marked DONE if the resize
  request is successful. The underlying actions take additional time. You must separately
  verify the status of the creating or deleting actions with the get or listmanagedinstances
  method." The operation only sets targetSize; the group then creates or deletes instances.
- listManagedInstances / ManagedInstance: each instance has a currentAction (NONE, CREATING,
  RECREATING, DELETING, …) and, once the VM exists, an instanceStatus (STAGING, RUNNING,
  STOPPING); "if a previous action failed, the list displays the errors for that failed
  action" in lastAttempt.errors.errors[]. A CREATING instance "will try again until it is
  successful", so a quota or stock-out failure stays CREATING with the error until the fault
  is gone. Shrinking removes instances not yet created first.
- deleteInstances (RegionInstanceGroupManagersDeleteInstancesRequest): the target size drops
  by the instances deleted; with skipInstancesOnValidationError, instances that are not
  members are skipped, otherwise the operation fails.
- InstanceGroupManager: name RFC 1035 (1-63), baseInstanceName 1-58 characters, instances
  named "<baseInstanceName>-xxxx"; a target distribution shape other than EVEN requires
  updatePolicy.instanceRedistributionType NONE (guide "Regional MIG target distribution shape").
- regions.get: Region.quotas[] of {metric, limit, usage}; GPUs count against
  NVIDIA_<model>_GPUS, Spot VMs against PREEMPTIBLE_NVIDIA_<model>_GPUS (guide "GPU quota").
- Preemption (guide "Preemptible VM instances": "Detect if a VM was preempted"): a preempted
  VM leaves a zonal Operation of type compute.instances.preempted whose targetLink is the VM;
  zoneOperations.list accepts the filter `operationType="compute.instances.preempted"` (AIP-160
  equality terms joined by AND are supported here). The MIG recreates the VM under its name.
- Errors: Google's JSON error shape {"error": {"code", "message", "errors": [{"message",
  "domain", "reason"}], "status"}} (cloud.google.com/apis/design/errors): 404 notFound,
  409 alreadyExists, 400 invalid, 401 required/UNAUTHENTICATED, 403 forbidden/PERMISSION_DENIED.

Faults a test injects: `set_quota` (creating past a GPU quota records QUOTA_EXCEEDED in the
instance's lastAttempt, as real MIGs do), `stockout` (ZONE_RESOURCE_POOL_EXHAUSTED), `fail_all`
(every request answers one HTTP error, e.g. `auth_failure(401)`) and `preempt`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

COMPUTE = "https://www.googleapis.com/compute/v1"
RFC1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
BASE_INSTANCE_NAME = re.compile(r"^[a-z][-a-z0-9]{0,57}$")
DEFAULT_REGIONS = {
    "us-central1": ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"),
    "europe-west4": ("europe-west4-a", "europe-west4-b", "europe-west4-c"),
}
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
_FILTER_TERM = re.compile(r'^\s*(\w+)\s*=\s*"?([^"]*?)"?\s*$')


class ApiError(Exception):
    """An HTTP error in Google's JSON shape."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "code": self.code,
                "message": self.message,
                "errors": [{"message": self.message, "domain": "global", "reason": self.reason}],
                "status": _STATUS.get(self.code, "UNKNOWN"),
            }
        }


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


DEFAULT_TEMPLATE_REGION = "us-central1"
_TEMPLATE_URL = re.compile(
    r"^(?:https?://[^/]+/compute/v1/)?projects/(?P<project>[^/]+)/"
    r"(?:regions/(?P<region>[^/]+)|global)/instanceTemplates/(?P<name>[^/]+)$"
)


@dataclass
class Template:
    name: str
    machine_type: str
    accelerator: str  # quota metric stem, e.g. "NVIDIA_H100"
    gpus: int
    spot: bool
    region: str | None  # None: a global template

    @property
    def scope(self) -> str:
        """Where the template lives under its project: "regions/<r>" or "global"."""
        return f"regions/{self.region}" if self.region else "global"

    @property
    def metric(self) -> str:
        return f"{'PREEMPTIBLE_' if self.spot else ''}{self.accelerator}_GPUS"


@dataclass
class Instance:
    name: str
    zone: str
    created_at: float | None = None  # None: the MIG has not managed to create the VM yet
    deleting_since: float | None = None
    recreating: bool = False
    errors: list[dict[str, str]] = field(default_factory=list)


@dataclass
class Mig:
    name: str
    region: str
    template: Template
    base_instance_name: str
    target_size: int
    zones: tuple[str, ...]
    body: dict[str, Any]
    id: int
    instances: dict[str, Instance] = field(default_factory=dict)


@dataclass
class Operation:
    body: dict[str, Any]
    done_at: float


class ComputeStandIn:
    """In-memory Compute Engine for one project; `app` is the ASGI app, `url` is set while served."""

    def __init__(
        self,
        project: str = "meridian-test",
        regions: dict[str, tuple[str, ...]] | None = None,
        *,
        op_delay_s: float = 0.05,
        boot_s: float = 0.15,
        delete_s: float = 0.1,
        wait_max_s: float = 2.0,
        seed: int = 7,
    ) -> None:
        self.project = project
        self.regions = dict(regions or DEFAULT_REGIONS)
        self.op_delay_s, self.boot_s, self.delete_s, self.wait_max_s = (
            op_delay_s,
            boot_s,
            delete_s,
            wait_max_s,
        )
        self.url = ""
        self._rand = random.Random(seed)
        self._ids = itertools.count(1_000_000_000)
        self._lock = threading.Lock()
        self.reset()
        self.app = self._build_app()

    # --- test controls -----------------------------------------------------------------

    def reset(self) -> None:
        """Forget every resource, quota and fault."""
        with self._lock:
            # By (scope, name): "regions/us-central1" or "global".
            self.templates: dict[tuple[str, str], Template] = {}
            self.migs: dict[tuple[str, str], Mig] = {}
            self.region_ops: dict[tuple[str, str], Operation] = {}
            self.zone_ops: dict[str, list[dict[str, Any]]] = {}
            self.limits: dict[tuple[str, str], float] = {}
            self.stockouts: set[str] = set()
            self.fault: ApiError | None = None
            # Set to keep new instances in CREATING with no VM (a slow creation).
            self.hold_creation = False
            self.requests: list[tuple[str, str, dict[str, str]]] = []

    def add_template(
        self,
        name: str,
        machine_type: str,
        accelerator: str,
        gpus: int,
        spot: bool = False,
        region: str | None = DEFAULT_TEMPLATE_REGION,
    ) -> None:
        """An instance template as iac makes it: regional (in `region`; None makes a global one), with
        `gpus` GPUs of quota stem `accelerator` (NVIDIA_H100)."""
        with self._lock:
            if region is not None and region not in self.regions:
                raise ValueError(f"{region} is not a region of the stand-in ({', '.join(self.regions)})")
            t = Template(name, machine_type, accelerator, gpus, spot, region)
            self.templates[(t.scope, name)] = t

    def set_quota(self, region: str, metric: str, limit: float) -> None:
        """The project's limit of `metric` (e.g. NVIDIA_H100_GPUS) in `region`; unset GPU metrics are 0."""
        with self._lock:
            self.limits[(region, metric)] = limit

    def stockout(self, region: str, on: bool = True) -> None:
        """Every zone of `region` out of (or back in) stock: creations fail ZONE_RESOURCE_POOL_EXHAUSTED."""
        with self._lock:
            (self.stockouts.add if on else self.stockouts.discard)(region)

    def fail_all(self, code: int, reason: str, message: str) -> None:
        """Answer every request with this HTTP error until `clear_fault`."""
        with self._lock:
            self.fault = ApiError(code, reason, message)

    def auth_failure(self, code: int = 401) -> None:
        """Reject every request as Google does for a missing token (401) or a missing permission (403)."""
        if code == 401:
            self.fail_all(
                401,
                "required",
                "Request is missing required authentication credential. "
                "Expected OAuth 2 access token, login cookie or other valid "
                "authentication credential.",
            )
        else:
            self.fail_all(
                403,
                "forbidden",
                f"Required 'compute.instanceGroupManagers.get' permission for 'projects/{self.project}'",
            )

    def clear_fault(self) -> None:
        with self._lock:
            self.fault = None

    def preempt(self, instance: str, at: datetime | None = None) -> None:
        """Preempt a Spot VM: record compute.instances.preempted in its zone; its MIG recreates it."""
        with self._lock:
            for mig in self.migs.values():
                inst = mig.instances.get(instance)
                if inst is None:
                    continue
                self.zone_ops.setdefault(inst.zone, []).append(
                    self._operation_body(
                        "compute.instances.preempted",
                        self._instance_url(inst),
                        zone=inst.zone,
                        done=True,
                        insert_time=(at or datetime.now(UTC)).isoformat(timespec="milliseconds"),
                        status_message="Instance was preempted.",
                        user="system",
                    )
                )
                inst.recreating, inst.created_at = True, time.monotonic()
                return
        raise KeyError(instance)

    def mig(self, region: str, name: str) -> Mig:
        with self._lock:
            return self.migs[(region, name)]

    # --- the model ---------------------------------------------------------------------

    def _instance_url(self, inst: Instance) -> str:
        return f"{COMPUTE}/projects/{self.project}/zones/{inst.zone}/instances/{inst.name}"

    def _template_url(self, t: Template) -> str:
        return f"{COMPUTE}/projects/{self.project}/{t.scope}/instanceTemplates/{t.name}"

    def _mig_url(self, mig: Mig) -> str:
        return f"{COMPUTE}/projects/{self.project}/regions/{mig.region}/instanceGroupManagers/{mig.name}"

    def _used(self, region: str, metric: str) -> int:
        return sum(
            m.template.gpus
            for m in self.migs.values()
            if m.region == region and m.template.metric == metric
            for i in m.instances.values()
            if i.created_at is not None
        )

    def _advance(self, now: float) -> None:
        """Move every MIG towards its target size (called, under the lock, before each request)."""
        for mig in self.migs.values():
            for name, inst in list(mig.instances.items()):
                if inst.deleting_since is not None and now - inst.deleting_since >= self.delete_s:
                    del mig.instances[name]
            live = [i for i in mig.instances.values() if i.deleting_since is None]
            if len(live) < mig.target_size:
                for _ in range(mig.target_size - len(live)):
                    counts = {z: sum(i.zone == z for i in mig.instances.values()) for z in mig.zones}
                    zone = min(mig.zones, key=lambda z: counts[z])
                    name = f"{mig.base_instance_name}-" + "".join(
                        self._rand.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=4)
                    )
                    mig.instances[name] = Instance(name=name, zone=zone)
            elif len(live) > mig.target_size:
                # Instances not yet created go first, then the newest.
                victims = sorted(live, key=lambda i: (i.created_at is not None, -(i.created_at or 0.0)))
                for inst in victims[: len(live) - mig.target_size]:
                    if inst.created_at is None:
                        del mig.instances[inst.name]
                    else:
                        inst.deleting_since = now
            for inst in mig.instances.values():
                if inst.created_at is None and inst.deleting_since is None:
                    self._try_create(mig, inst, now)

    def _try_create(self, mig: Mig, inst: Instance, now: float) -> None:
        if self.hold_creation:  # the MIG is still working on it: no VM yet, no error either
            return
        t = mig.template
        if mig.region in self.stockouts:
            inst.errors = [
                {
                    "code": "ZONE_RESOURCE_POOL_EXHAUSTED",
                    "message": f"The zone 'projects/{self.project}/zones/{inst.zone}' does not have enough "
                    "resources available to fulfill the request. Try a different zone, or try "
                    "again later.",
                }
            ]
            return
        limit = self.limits.get((mig.region, t.metric), 0.0)
        if self._used(mig.region, t.metric) + t.gpus > limit:
            inst.errors = [
                {
                    "code": "QUOTA_EXCEEDED",
                    "message": f"Quota '{t.metric}' exceeded.  Limit: {limit} in region {mig.region}.",
                }
            ]
            return
        inst.created_at, inst.errors = now, []

    def _instance_view(self, mig: Mig, inst: Instance, now: float) -> dict[str, Any]:
        view: dict[str, Any] = {
            "instance": self._instance_url(inst),
            "name": inst.name,
            "id": str(abs(hash((mig.name, inst.name))) % 10**18),
            "version": {"instanceTemplate": self._template_url(mig.template)},
        }
        if inst.deleting_since is not None:
            view.update(currentAction="DELETING", instanceStatus="STOPPING")
        elif inst.created_at is None:
            view["currentAction"] = "CREATING"
        elif now - inst.created_at < self.boot_s:
            view.update(
                currentAction="RECREATING" if inst.recreating else "CREATING", instanceStatus="STAGING"
            )
        else:
            inst.recreating = False
            view.update(currentAction="NONE", instanceStatus="RUNNING")
        if inst.errors:
            view["lastAttempt"] = {"errors": {"errors": inst.errors}}
        return view

    def _mig_view(self, mig: Mig, now: float) -> dict[str, Any]:
        views = [self._instance_view(mig, i, now) for i in mig.instances.values()]
        actions: dict[str, int] = {}
        for v in views:
            key = re.sub(r"_(\w)", lambda m: m.group(1).upper(), v["currentAction"].lower())
            actions[key] = actions.get(key, 0) + 1
        return {
            **mig.body,
            "kind": "compute#instanceGroupManager",
            "id": str(mig.id),
            "name": mig.name,
            "region": f"{COMPUTE}/projects/{self.project}/regions/{mig.region}",
            "selfLink": self._mig_url(mig),
            "targetSize": mig.target_size,
            "currentActions": actions,
            "status": {"isStable": all(v["currentAction"] == "NONE" for v in views)},
        }

    def _operation_body(
        self,
        op_type: str,
        target: str,
        *,
        region: str | None = None,
        zone: str | None = None,
        done: bool = False,
        error: dict[str, Any] | None = None,
        http_status: int = 400,
        insert_time: str | None = None,
        status_message: str | None = None,
        user: str = "anonymous",
    ) -> dict[str, Any]:
        name = f"operation-{int(time.time() * 1000)}-{self._rand.getrandbits(48):012x}"
        scope = f"regions/{region}" if region else f"zones/{zone}"
        body: dict[str, Any] = {
            "kind": "compute#operation",
            "id": str(next(self._ids)),
            "name": name,
            "operationType": op_type,
            "targetLink": target,
            "status": "DONE" if done else "RUNNING",
            "progress": 100 if done else 0,
            "user": user,
            "insertTime": insert_time or _now(),
            "startTime": insert_time or _now(),
            "selfLink": f"{COMPUTE}/projects/{self.project}/{scope}/operations/{name}",
        }
        if region:
            body["region"] = f"{COMPUTE}/projects/{self.project}/regions/{region}"
        else:
            body["zone"] = f"{COMPUTE}/projects/{self.project}/zones/{zone}"
        if done:
            body["endTime"] = body["insertTime"]
        if status_message:
            body["statusMessage"] = status_message
        if error:
            body["error"] = error
            body["httpErrorStatusCode"] = http_status
            body["httpErrorMessage"] = _STATUS.get(http_status, "BAD REQUEST")
        return body

    def _region_op(
        self, region: str, op_type: str, target: str, error: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        body = self._operation_body(op_type, target, region=region, error=error)
        self.region_ops[(region, body["name"])] = Operation(body, time.monotonic() + self.op_delay_s)
        return self._op_view(self.region_ops[(region, body["name"])], time.monotonic())

    @staticmethod
    def _op_view(op: Operation, now: float) -> dict[str, Any]:
        if now < op.done_at:
            return op.body
        return {**op.body, "status": "DONE", "progress": 100, "endTime": op.body.get("endTime") or _now()}

    # --- HTTP --------------------------------------------------------------------------

    def _check(self, project: str, region: str | None = None) -> None:
        if self.fault is not None:
            raise self.fault
        if project != self.project:
            raise ApiError(404, "notFound", f"The resource 'projects/{project}' was not found")
        if region is not None and region not in self.regions:
            raise ApiError(
                404, "notFound", f"The resource 'projects/{project}/regions/{region}' was not found"
            )

    def _template_view(self, t: Template) -> dict[str, Any]:
        view: dict[str, Any] = {
            "kind": "compute#instanceTemplate",
            "id": str(abs(hash((t.scope, t.name))) % 10**18),
            "name": t.name,
            "selfLink": self._template_url(t),
            "properties": {
                "machineType": t.machine_type,
                "scheduling": {
                    "provisioningModel": "SPOT" if t.spot else "STANDARD",
                    "onHostMaintenance": "TERMINATE",
                },
            },
        }
        if t.region:
            view["region"] = f"{COMPUTE}/projects/{self.project}/regions/{t.region}"
        return view

    def _find_template(self, scope: str, name: str) -> Template:
        t = self.templates.get((scope, name))
        if t is None:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/{scope}/instanceTemplates/{name}' was not found",
            )
        return t

    def _mig_template(self, region: str, body: dict[str, Any]) -> Template:
        """The template a MIG insert names: its first version's, else its instanceTemplate."""
        versions = body.get("versions") or []
        if versions:
            field_name, url = "resource.versions[0].instanceTemplate", versions[0].get("instanceTemplate", "")
        else:
            field_name, url = "resource.instanceTemplate", body.get("instanceTemplate", "")
        url = str(url)
        m = _TEMPLATE_URL.match(url)
        if m is None or m.group("project") != self.project:
            raise ApiError(400, "invalid", f"Invalid value for field '{field_name}': '{url}'")
        if m.group("region") is not None and m.group("region") != region:
            raise ApiError(
                400,
                "invalid",
                f"Invalid value for field '{field_name}': '{url}'. The regional instance template must be "
                f"in the same region as the instance group manager ({region})",
            )
        scope = f"regions/{m.group('region')}" if m.group("region") else "global"
        return self._find_template(scope, m.group("name"))

    def _find_mig(self, region: str, name: str) -> Mig:
        mig = self.migs.get((region, name))
        if mig is None:
            raise ApiError(
                404,
                "notFound",
                f"The resource 'projects/{self.project}/regions/{region}/instanceGroupManagers/{name}' "
                "was not found",
            )
        return mig

    def _build_app(self) -> FastAPI:
        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
        base = "/compute/v1/projects/{project}"
        migs = base + "/regions/{region}/instanceGroupManagers"

        @app.exception_handler(ApiError)
        async def api_error(_: Request, e: ApiError) -> JSONResponse:
            return JSONResponse(e.body(), status_code=e.code)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
            err = ApiError(e.status_code, "notFound" if e.status_code == 404 else "invalid", str(e.detail))
            return JSONResponse(err.body(), status_code=e.status_code)

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Any:
            with self._lock:
                self.requests.append((request.method, request.url.path, dict(request.query_params)))
            return await call_next(request)

        @app.get(base + "/regions/{region}/instanceTemplates/{name}")
        async def get_region_template(project: str, region: str, name: str) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                return self._template_view(self._find_template(f"regions/{region}", name))

        @app.get(base + "/global/instanceTemplates/{name}")
        async def get_template(project: str, name: str) -> dict[str, Any]:
            with self._lock:
                self._check(project)
                return self._template_view(self._find_template("global", name))

        @app.get(base + "/regions/{region}")
        async def get_region(project: str, region: str) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                self._advance(time.monotonic())
                metrics = {m for (r, m) in self.limits if r == region}
                metrics |= {m.template.metric for m in self.migs.values() if m.region == region}
                return {
                    "kind": "compute#region",
                    "name": region,
                    "status": "UP",
                    "selfLink": f"{COMPUTE}/projects/{project}/regions/{region}",
                    "zones": [f"{COMPUTE}/projects/{project}/zones/{z}" for z in self.regions[region]],
                    "quotas": [
                        {
                            "metric": m,
                            "limit": self.limits.get((region, m), 0.0),
                            "usage": float(self._used(region, m)),
                        }
                        for m in sorted(metrics)
                    ],
                }

        @app.post(migs)
        async def insert_mig(project: str, region: str, request: Request) -> dict[str, Any]:
            body = await request.json()
            with self._lock:
                self._check(project, region)
                name = body.get("name", "")
                if not RFC1035.match(name):
                    raise ApiError(
                        400,
                        "invalid",
                        f"Invalid value for field 'resource.name': '{name}'. "
                        "Must be a match of regex '[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?'",
                    )
                base_name = body.get("baseInstanceName", "")
                if not BASE_INSTANCE_NAME.match(base_name):
                    raise ApiError(
                        400, "invalid", f"Invalid value for field 'resource.baseInstanceName': '{base_name}'"
                    )
                if (region, name) in self.migs:
                    raise ApiError(
                        409,
                        "alreadyExists",
                        f"The resource 'projects/{project}/regions/{region}/"
                        f"instanceGroupManagers/{name}' already exists",
                    )
                template = self._mig_template(region, body)
                policy = body.get("distributionPolicy") or {}
                zones = (
                    tuple(z["zone"].rsplit("/", 1)[-1] for z in policy.get("zones", []))
                    or self.regions[region]
                )
                foreign = [z for z in zones if z not in self.regions[region]]
                if foreign:
                    raise ApiError(
                        400,
                        "invalid",
                        f"Invalid value for field 'resource.distributionPolicy.zones': "
                        f"{foreign} are not zones of {region}",
                    )
                shape = policy.get("targetShape", "EVEN")
                redistribution = (body.get("updatePolicy") or {}).get(
                    "instanceRedistributionType", "PROACTIVE"
                )
                if shape != "EVEN" and redistribution != "NONE":
                    raise ApiError(
                        400,
                        "invalid",
                        f"Target distribution shape {shape} requires proactive instance "
                        "redistribution to be disabled (instanceRedistributionType NONE)",
                    )
                size = int(body.get("targetSize", 0))
                if size < 0:
                    raise ApiError(400, "invalid", "Invalid value for field 'resource.targetSize'")
                mig = Mig(
                    name=name,
                    region=region,
                    template=template,
                    base_instance_name=base_name,
                    target_size=size,
                    zones=zones,
                    body=body,
                    id=next(self._ids),
                )
                self.migs[(region, name)] = mig
                self._advance(time.monotonic())
                return self._region_op(
                    region, "compute.regionInstanceGroupManagers.insert", self._mig_url(mig)
                )

        @app.get(migs + "/{name}")
        async def get_mig(project: str, region: str, name: str) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                now = time.monotonic()
                self._advance(now)
                return self._mig_view(self._find_mig(region, name), now)

        @app.delete(migs + "/{name}")
        async def delete_mig(project: str, region: str, name: str) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                mig = self._find_mig(region, name)
                del self.migs[(region, name)]
                return self._region_op(
                    region, "compute.regionInstanceGroupManagers.delete", self._mig_url(mig)
                )

        @app.post(migs + "/{name}/resize")
        async def resize(project: str, region: str, name: str, size: int) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                mig = self._find_mig(region, name)
                if size < 0:
                    raise ApiError(400, "invalid", "Invalid value for field 'size'")
                mig.target_size = size
                self._advance(time.monotonic())
                return self._region_op(
                    region, "compute.regionInstanceGroupManagers.resize", self._mig_url(mig)
                )

        @app.post(migs + "/{name}/listManagedInstances")
        async def list_managed(project: str, region: str, name: str) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                now = time.monotonic()
                self._advance(now)
                mig = self._find_mig(region, name)
                views = [
                    self._instance_view(mig, i, now)
                    for i in sorted(mig.instances.values(), key=lambda i: i.name)
                ]
                return {"managedInstances": views} if views else {}

        @app.post(migs + "/{name}/deleteInstances")
        async def delete_instances(project: str, region: str, name: str, request: Request) -> dict[str, Any]:
            body = await request.json()
            with self._lock:
                self._check(project, region)
                mig = self._find_mig(region, name)
                wanted = [str(u).rsplit("/", 1)[-1] for u in body.get("instances", [])]
                members = [mig.instances.get(n) for n in wanted]
                missing = [
                    n
                    for n, m in zip(wanted, members, strict=True)
                    if m is None or m.deleting_since is not None
                ]
                error = None
                if missing and not body.get("skipInstancesOnValidationError"):
                    error = {
                        "errors": [
                            {
                                "code": "RESOURCE_NOT_FOUND",
                                "message": f"Instances {missing} are not members of {name} or are already "
                                "being deleted",
                            }
                        ]
                    }
                else:
                    now = time.monotonic()
                    for inst in members:
                        if inst is not None and inst.deleting_since is None:
                            inst.deleting_since = now
                            mig.target_size -= 1
                return self._region_op(
                    region,
                    "compute.regionInstanceGroupManagers.deleteInstances",
                    self._mig_url(mig),
                    error=error,
                )

        @app.get(base + "/regions/{region}/operations/{name}")
        async def get_operation(project: str, region: str, name: str) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                op = self.region_ops.get((region, name))
                if op is None:
                    raise ApiError(
                        404,
                        "notFound",
                        f"The resource 'projects/{project}/regions/{region}/operations/{name}' was not found",
                    )
                return self._op_view(op, time.monotonic())

        @app.post(base + "/regions/{region}/operations/{name}/wait")
        async def wait_operation(project: str, region: str, name: str) -> dict[str, Any]:
            with self._lock:
                self._check(project, region)
                op = self.region_ops.get((region, name))
                if op is None:
                    raise ApiError(
                        404,
                        "notFound",
                        f"The resource 'projects/{project}/regions/{region}/operations/{name}' was not found",
                    )
            await asyncio.sleep(max(0.0, min(op.done_at - time.monotonic(), self.wait_max_s)))
            return self._op_view(op, time.monotonic())

        @app.get(base + "/zones/{zone}/operations")
        async def list_zone_operations(project: str, zone: str, filter: str = "") -> dict[str, Any]:
            with self._lock:
                self._check(project)
                terms: list[tuple[str, str]] = []
                for part in (
                    re.split(r"\s+AND\s+", filter.strip(), flags=re.IGNORECASE) if filter.strip() else []
                ):
                    m = _FILTER_TERM.match(part.strip("() "))
                    if m is None:
                        raise ApiError(400, "invalid", f"Invalid value for field 'filter': '{filter}'")
                    terms.append((m.group(1), m.group(2)))
                items = [
                    op for op in self.zone_ops.get(zone, []) if all(str(op.get(k)) == v for k, v in terms)
                ]
                return {
                    "kind": "compute#operationList",
                    "id": f"projects/{project}/zones/{zone}/operations",
                    "items": items,
                    "selfLink": f"{COMPUTE}/projects/{project}/zones/{zone}/operations",
                }

        return app


class _ThreadServer(uvicorn.Server):
    """uvicorn in a worker thread: it must leave the signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.contextmanager
def serving(standin: ComputeStandIn, timeout_s: float = 10.0) -> Iterator[str]:
    """Serve the stand-in on a free loopback port in a background thread; yields (and sets) its URL."""
    server = _ThreadServer(
        uvicorn.Config(standin.app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="gcp-compute-standin", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the Compute Engine stand-in did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    standin.url = f"http://127.0.0.1:{port}"
    try:
        yield standin.url
    finally:
        server.should_exit = True
        thread.join(timeout_s)
