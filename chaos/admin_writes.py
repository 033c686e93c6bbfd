"""An operator writing through the admin API while a fault is on (the control plane's
database restarting): every write the control plane acknowledged must be there afterwards,
and every refusal must be a clean 503 problem with Retry-After. The same probe for a local
fabric and a deployment."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from chaos.admin_api import AdminApi
from meridian.admin_api import ApiKeyCreate, Scope
from meridian.admin_client import AdminAPIError
from meridian.contracts import GLOBAL_ZONE

# One write (a new API key) this often while the probe runs.
WRITE_INTERVAL_S = 0.2
# Writing starts this long before the fault (writes acknowledged before it) and goes on this
# long after its heal (writes acknowledged after it); all of them must be there at the end.
LEAD_S = 1.0
TRAIL_S = 3.0
# The keys the probe makes belong to this tenant; they are revoked once checked.
TENANT = "chaos-writes"


class AdminWrites:
    """Writes keys named `<prefix>-ack-<n>` until stopped; `verify` checks what survived."""

    def __init__(self, admin: AdminApi, prefix: str, event: Callable[[str, str], None]) -> None:
        self._admin, self._prefix, self._event = admin, prefix, event
        self._acknowledged: dict[str, str] = {}  # name -> key id
        self._unclean: list[str] = []
        self._statuses: Counter[str] = Counter()
        self._writing = False
        self._task: asyncio.Task[None] | None = None

    async def start_before_fault(self) -> asyncio.Task[None]:
        """Start writing in the background, and return LEAD_S later; the task ends after stop()."""
        self._writing = True
        self._task = asyncio.create_task(self._write(), name="chaos-admin-writes")
        await asyncio.sleep(LEAD_S)
        return self._task

    async def stop_after_heal(self) -> None:
        """Go on writing for TRAIL_S after the heal, then stop."""
        await asyncio.sleep(TRAIL_S)
        await self.stop()

    async def stop(self) -> None:
        self._writing = False
        if self._task is not None:
            await self._task

    async def _write(self) -> None:
        n = 0
        async with self._admin.client() as admin:
            while self._writing:
                n += 1
                name = f"{self._prefix}-ack-{n:05d}"
                try:
                    made = await admin.create_key(ApiKeyCreate(name=name, tenant=TENANT, zone=GLOBAL_ZONE,
                                                               scopes=[Scope.INFERENCE], models=None,
                                                               create_tenant=True))
                    self._statuses["201"] += 1
                    self._acknowledged[name] = made.id
                except AdminAPIError as e:
                    self._refused(name, e)
                await asyncio.sleep(WRITE_INTERVAL_S)
        self._event("writes", f"{n} admin writes, {len(self._acknowledged)} acknowledged; "
                              f"answers {dict(sorted(self._statuses.items()))}")

    def _refused(self, name: str, e: AdminAPIError) -> None:
        """Count a write that was not acknowledged; only a 503 problem with Retry-After is clean."""
        if e.unreachable:
            self._statuses[type(e.__cause__).__name__] += 1
            self._unclean.append(f"{name}: {type(e.__cause__).__name__}")
            return
        self._statuses[str(e.status)] += 1
        if not (e.status == 503 and e.retry_after is not None and e.problem):
            self._unclean.append(f"{name}: {e}"[:160])

    async def verify(self) -> dict[str, bool]:
        """`acknowledged_writes_present` and `admin_errors_clean`; then revokes the probe's keys."""
        await self.stop()
        present = {k.name for k in await self._admin.api_keys(tenant=TENANT)}
        missing = [n for n in self._acknowledged if n not in present]
        if missing:
            self._event("check", f"acknowledged writes missing afterwards: {missing[:10]}")
        if self._unclean:
            self._event("check", f"admin writes answered without a clean 503: {self._unclean[:5]}")
        failed = await self._admin.revoke_keys(self._acknowledged.values())
        if failed:
            self._event("check", f"{len(failed)} probe keys could not be revoked")
        return {"acknowledged_writes_present": bool(self._acknowledged) and not missing,
                "admin_errors_clean": not self._unclean}
