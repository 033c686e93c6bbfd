"""Injectors that act on a deployment rather than a local fabric: the operator's commands
from the deployment file, or an instance terminated through its provider's API.

They see the deployment through a DeployedEnvironment (chaos.deployed_environment): the nodes the
control plane lists, the routers' metrics, the run's clock and event log.
"""

from __future__ import annotations

import asyncio
import logging
import shlex
import time
from collections.abc import Mapping

from chaos.admin_writes import AdminWrites
from chaos.deployed_environment import DeployedEnvironment, DeployedNode
from chaos.deployment import NODE_FIELDS, CommandAction, FaultAction, TerminateInstanceAction, template_fields
from chaos.drill import Fault, FaultKind
from chaos.environment import InjectionError
from chaos.faults.injector import Injector
from chaos.history import History, Outcome
from meridian.contracts import NodeStatus
from meridian.registry import UnknownName
from meridian.settings.providers import ProviderSettings
from providers.driver import FailsInstances
from providers.errors import ProviderError
from providers.provider import PROVIDERS, ProviderConfig

log = logging.getLogger(__name__)

# How often a preempted node's drain is looked for in the control plane's node list.
_DRAIN_POLL_S = 0.25
# Stderr kept in an error message when a command fails.
_STDERR_TAIL = 500


def create_deployed_injector(fault: Fault, action: FaultAction, env: DeployedEnvironment) -> Injector:
    """The injector carrying out `action` for `fault` on the deployment."""
    if isinstance(action, CommandAction):
        return CommandInjector(fault, action, env)
    return TerminateInstance(fault, action, env)


async def run_command(command: str, timeout_s: float) -> str:
    """Run a shell command; its stdout, or InjectionError when it fails or runs too long."""
    proc = await asyncio.create_subprocess_shell(
        command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, stdin=asyncio.subprocess.DEVNULL
    )
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise InjectionError(f"`{command}` ran longer than {timeout_s:g}s and was killed") from None
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace")[-_STDERR_TAIL:].strip()
        raise InjectionError(f"`{command}` exited with {proc.returncode}: {tail or '(no stderr)'}")
    return out.decode("utf-8", "replace")


class CommandInjector:
    """The deployment file's inject and heal commands. With a node's fields in them they run
    once per target node (in parallel); otherwise once. Values are shell-quoted."""

    def __init__(self, fault: Fault, action: CommandAction, env: DeployedEnvironment) -> None:
        self._fault, self._action, self._env = fault, action, env
        self._victims: list[DeployedNode] = []
        self._ejections_before: dict[str, float] = {}
        self._control_plane_down = False
        # Spot preemption: how long the node took to leave the control plane's list after the
        # notice, and whether the region was back to its ready nodes after the heal.
        self._ready_before: dict[str, int] = {}
        self._draining: asyncio.Task[float | None] | None = None
        self._drained_in_s: float | None = None
        self._replaced: bool | None = None
        # Postgres restart: an operator's admin writes through the fault.
        self._writes = (AdminWrites(env.admin, env.run_id, env.event) if fault.kind is FaultKind.POSTGRES_RESTART
                        else None)

    async def inject(self) -> None:
        if self._writes is not None:
            await self._writes.start_before_fault()
        if self._action.per_node():
            self._victims = await self._env.nodes(self._fault.target)
            self._ejections_before = await self._env.routers.ejections(n.node_id for n in self._victims)
            self._ready_before = await self._env.ready_counts({n.region for n in self._victims})
        await self._run(self._action.inject, "inject")
        if self._fault.kind is FaultKind.CONTROL_PLANE_OUTAGE:
            self._control_plane_down = not await self._env.control_plane_answers()
            self._env.event("check", f"control plane {'unreachable' if self._control_plane_down else 'STILL ANSWERS'}")
        if self._fault.kind is FaultKind.SPOT_PREEMPTION and self._victims:
            deadline_s = float(self._fault.params.get("drain_deadline_s", 120))
            self._draining = asyncio.create_task(self._drained(deadline_s), name="chaos-drain-watch")

    async def _drained(self, deadline_s: float) -> float | None:
        """Seconds until every victim left the list (deregistered after its drain) or was
        marked lost; None when that did not happen within three deadlines."""
        sent = time.monotonic()
        ids = {n.node_id for n in self._victims}
        while time.monotonic() - sent < deadline_s * 3:
            listed = await self._env.all_nodes()
            if all(i not in listed or listed[i].status == NodeStatus.LOST for i in ids):
                took = time.monotonic() - sent
                self._env.event("exited", f"{', '.join(sorted(ids))} left the node list {took:.2f}s after the notice")
                return took
            await asyncio.sleep(_DRAIN_POLL_S)
        return None

    async def heal(self) -> None:
        if self._draining is not None:
            # The heal (a restart, a new instance) comes after the node has gone.
            self._drained_in_s = await self._draining
        if self._action.heal is not None:
            await self._run(self._action.heal, "heal")
        if self._draining is not None:
            self._replaced = False
            self._replaced = await self._env.wait_for_ready(self._ready_before, self._action.recovery_timeout_s)
        if self._writes is not None:
            await self._writes.stop_after_heal()

    async def _run(self, template: str, step: str) -> None:
        fields = self._env.run_fields(self._fault)
        missing = template_fields(template) - fields.keys() - NODE_FIELDS
        if missing:
            raise InjectionError(f"the {step} command uses {', '.join(sorted(missing))}, which fault "
                                 f"{self._fault.kind} does not have")
        commands = ([_render(template, fields | node.fields()) for node in self._victims]
                    if self._action.per_node() else [_render(template, fields)])
        for command in commands:
            self._env.event(step, command)
        await asyncio.gather(*(run_command(c, self._env.deployment.command_timeout_s) for c in commands))

    async def observe(self, history: History) -> Mapping[str, bool]:
        seen: dict[str, bool] = {}
        if self._ejections_before:
            # Routers count every ejection; one per target node shows they took it out.
            ejected = await self._env.routers.all_ejected_since(self._ejections_before)
            seen.update(outlier_ejected=ejected, region_ejected=ejected)
        if self._fault.kind is FaultKind.CONTROL_PLANE_OUTAGE:
            f = self._fault
            served = any(op.outcome is Outcome.OK and f.start_s <= op.invoke_s < f.end_s for op in history.client)
            seen["served_from_snapshot"] = self._control_plane_down and served
        if self._draining is not None:
            deadline_s = float(self._fault.params.get("drain_deadline_s", 120))
            seen["node_drained_within_deadline"] = self._drained_in_s is not None and self._drained_in_s <= deadline_s
            seen["replacement_node_ready"] = bool(self._replaced)
        if self._writes is not None:
            seen.update(await self._writes.verify())
        return seen


def _render(template: str, fields: Mapping[str, str]) -> str:
    return template.format_map({k: shlex.quote(v) for k, v in fields.items()})


class TerminateInstance:
    """Terminate each target node's instance through its provider's API (node id = instance
    id). Healing waits until every affected region has as many ready nodes as before."""

    def __init__(self, fault: Fault, action: TerminateInstanceAction, env: DeployedEnvironment) -> None:
        self._fault, self._action, self._env = fault, action, env
        self._victims: list[DeployedNode] = []
        self._ready_before: dict[str, int] = {}
        self._replaced: bool | None = None

    async def inject(self) -> None:
        self._victims = await self._env.nodes(self._fault.target)
        self._ready_before = await self._env.ready_counts({n.region for n in self._victims})
        await asyncio.gather(*(self._terminate(n) for n in self._victims))

    async def _terminate(self, node: DeployedNode) -> None:
        try:
            provider = PROVIDERS.create(node.provider, ProviderConfig(ProviderSettings()))
        except UnknownName as exc:
            raise InjectionError(str(exc)) from exc
        driver = provider.driver()
        try:
            if not isinstance(driver, FailsInstances):
                raise InjectionError(f"the {node.provider} driver cannot terminate an instance; give fault "
                                     f"{self._fault.kind} a command action instead")
            await driver.fail_instance(node.region, node.node_id)
        except ProviderError as exc:
            raise InjectionError(f"terminating instance {node.node_id} in {node.region} failed: {exc}") from exc
        finally:
            close = getattr(driver, "close", None)
            if close is not None:
                close()
        self._env.event("terminate", f"instance {node.node_id} in {node.region} through the {node.provider} API")

    async def heal(self) -> None:
        if self._action.replacement_timeout_s == 0 or not self._victims:
            return
        self._replaced = False  # until seen: a heal cut short by the load's end is no replacement
        self._replaced = await self._env.wait_for_ready(
            self._ready_before, self._action.replacement_timeout_s, exclude={n.node_id for n in self._victims})

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {} if self._replaced is None else {"replacement_node_ready": self._replaced}
