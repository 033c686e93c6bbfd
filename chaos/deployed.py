"""Run a drill against a deployment (chaos.deployment) instead of a local fabric.

Nothing is started or stopped: the run makes a key per drill tenant (revoked afterwards),
warms the routers up, drives the load through them, injects and heals the fault with the
deployment's action for it, then collects the routers' and nodes' request journals from
their hosts. Journals of a live deployment hold other traffic too; the run keeps the lines
of its own requests, whose idempotency keys all start with the run's id.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import re
import secrets
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx

from chaos.admin_api import AdminApi, TenantKey
from chaos.deployed_environment import DeployedEnvironment
from chaos.deployment import CommandAction, Deployment, JournalSource, template_fields
from chaos.drill import Drill, Load
from chaos.environment import InjectionError
from chaos.faults.deployed import create_deployed_injector, run_command
from chaos.faults.injector import NotRunnable
from chaos.history import History, HistoryWriter
from chaos.load import LoadGenerator, LoadTarget, warm_up
from chaos.schedule import EventCallback, FaultState, RunOutcome, TickCallback, drive, finish

log = logging.getLogger(__name__)


def runnable_on(drill: Drill, deployment: Deployment) -> str | None:
    """Why `drill` cannot run against `deployment`; None when it can."""
    if drill.load.long_streams is not None:
        # Their reference run and the injector's wait for them are the local runner's.
        return "the deployed runner does not send long streams (load.long_streams) yet"
    action = deployment.actions.get(drill.fault.kind)
    if action is None:
        return f"deployment {deployment.name} has no action for fault kind {drill.fault.kind}"
    if isinstance(action, CommandAction) and action.per_node():
        t = drill.fault.target
        if t.service is not None and all(v is None for v in (t.node, t.region, t.provider, t.model)):
            return (f"the {drill.fault.kind} command uses a node's fields, but the drill targets the "
                    f"{t.service} service, not nodes")
    return None


@dataclass
class DeployedRunOptions:
    """Where a run against a deployment writes and how it reports progress."""

    out_dir: Path
    short: bool = True
    seed: int = 0
    on_step: Callable[[str], None] | None = None
    on_tick: TickCallback | None = None
    on_event: EventCallback | None = None


def run_drill_on(drill: Drill, deployment: Deployment, options: DeployedRunOptions) -> RunOutcome:
    """Run one drill (its short version with options.short) against a deployment."""
    return asyncio.run(_DeployedRun(drill, deployment, options).run())


class _DeployedRun:
    def __init__(self, drill: Drill, deployment: Deployment, options: DeployedRunOptions) -> None:
        self.drill = drill.short_version() if options.short else drill
        self.deployment = deployment
        self.options = options
        self.run_id = f"{self.drill.name}-{secrets.token_hex(4)}"
        self._step = options.on_step or (lambda _m: None)

    async def run(self) -> RunOutcome:
        why = runnable_on(self.drill, self.deployment)
        if why is not None:
            raise NotRunnable(f"drill {self.drill.name}: {why}")
        dep, out = self.deployment, self.options.out_dir
        out.mkdir(parents=True, exist_ok=True)
        client_log = out / "client.jsonl"
        client_log.unlink(missing_ok=True)
        started_at = datetime.now(UTC)
        admin = AdminApi(dep.control_plane, dep.admin_key())
        env = DeployedEnvironment(deployment=dep, admin=admin, run_id=self.run_id, seed=self.options.seed,
                                  on_event=self.options.on_event)
        state = FaultState()
        self._step(f"creating keys for the drill's tenants on {dep.name}")
        keys: dict[str, TenantKey] = {}
        try:
            # One at a time, so that every key made is revoked even when a later one fails.
            for tenant in self.drill.load.tenants:
                keys[tenant.name] = await admin.create_tenant_key(tenant, name=f"chaos-{self.run_id}")
            target = LoadTarget(tuple(dep.routers), {t: k.secret for t, k in keys.items()}, dep.model,
                                tuple(dep.grpc_routers))
            load = self._load(state)
            await warm_up(target, on_step=self._step)
            region_zones = await admin.region_zones()
            action = dep.actions[self.drill.fault.kind]
            self._step(f"running {self.drill.name} against {dep.name} (run {self.run_id})")
            with HistoryWriter(client_log) as writer:
                generator = LoadGenerator(load, target, writer, seed=self.options.seed, key_prefix=self.run_id)
                await drive(self.drill, generator, env, state,
                            lambda f: create_deployed_injector(f, action, env),
                            injection_errors=(InjectionError, OSError), on_tick=self.options.on_tick)
            # Nodes journal a request when they stop working on it, after the client's end.
            await asyncio.sleep(dep.settle_s)
            self._step("collecting the request journals")
            journals = await self._collect_journals(out / "journals", state)
            history = History.read(client_log, *journals)
            invariants = dict(await state.injector.observe(history)) if state.injector is not None else {}
        finally:
            await self._revoke(admin, [k.key_id for k in keys.values()], state)
        self._step("checking the request history against the pass criteria")
        return finish(self.drill, short=self.options.short, started_at=started_at, history=history,
                      region_zones=region_zones, env=env, state=state, invariants=invariants, out_dir=out)

    def _load(self, state: FaultState) -> Load:
        """The drill's load, less a gRPC share the deployment names no listener for."""
        load, dep = self.drill.load, self.deployment
        if "grpc" not in load.protocols or len(dep.grpc_routers) == len(dep.routers):
            return load
        rest = {p: w for p, w in load.protocols.items() if p != "grpc"} or {"http": 1.0}
        state.not_checked.append(f"gRPC clients: {dep.name} names no gRPC listener for each router (grpc_routers), "
                                 "so that share of the load went over " + " and ".join(sorted(rest)))
        return load.model_copy(update={"protocols": rest})

    async def _revoke(self, admin: AdminApi, key_ids: list[str], state: FaultState) -> None:
        try:
            failed = await admin.revoke_keys(key_ids)
        except httpx.HTTPError as exc:
            failed = [f"all ({exc})"]
        if failed:
            # Not a verdict on the fabric, but an operator must know keys were left behind.
            state.not_checked.append(f"drill keys not revoked on {self.deployment.name}: {', '.join(failed)}")

    async def _collect_journals(self, into: Path, state: FaultState) -> list[Path]:
        """This run's lines of every journal source, one file per source (and host)."""
        read: list[tuple[str, list[str], str | None]] = []
        for source in self.deployment.journals:
            if source.path is not None:
                read += await asyncio.to_thread(_read_files, source.name, source.path)
            else:
                read += await self._run_source(source)
        written, problems = await asyncio.to_thread(_write_own_lines, read, self.run_id, into)
        state.not_checked += problems
        return written

    async def _run_source(self, source: JournalSource) -> list[tuple[str, list[str], str | None]]:
        """(name, lines, problem) per host of a command source."""
        assert source.command is not None
        hosts = source.hosts if "host" in template_fields(source.command) else [""]
        results = []
        for host in hosts:
            name = f"{source.name}-{_file_safe(host)}" if host else source.name
            command = source.command.format_map({"host": shlex.quote(host), "run_id": self.run_id})
            try:
                text = await run_command(command, self.deployment.command_timeout_s)
                results.append((name, text.splitlines(True), None))
            except InjectionError as exc:
                results.append((name, [], str(exc)))
        return results


def _file_safe(text: str) -> str:
    """`text` as part of a file name (a host may be user@host:port)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text)


def _read_files(name: str, pattern: str) -> list[tuple[str, list[str], str | None]]:
    """(name, lines, problem) per file a path source's glob matches."""
    paths = [Path(p) for p in sorted(glob.glob(pattern))]
    if not paths:
        return [(name, [], f"no file matches {pattern}")]
    out: list[tuple[str, list[str], str | None]] = []
    for p in paths:
        try:
            out.append((f"{name}-{p.stem}", p.read_text(encoding="utf-8").splitlines(True), None))
        except (OSError, UnicodeDecodeError) as exc:
            out.append((f"{name}-{p.stem}", [], f"cannot read {p}: {exc}"))
    return out


def _write_own_lines(read: list[tuple[str, list[str], str | None]], run_id: str,
                     into: Path) -> tuple[list[Path], list[str]]:
    """Write each source's lines of this run to `into`; the files and the problems met."""
    into.mkdir(parents=True, exist_ok=True)
    for old in into.glob("*.jsonl"):
        old.unlink()
    written, problems = [], []
    for name, lines, problem in read:
        if problem is not None:
            problems.append(f"journal {name}: {problem}")
            continue
        kept, skipped = _own_lines(lines, run_id)
        path = into / f"{name}.jsonl"
        path.write_text("".join(kept), encoding="utf-8")
        written.append(path)
        if skipped:
            problems.append(f"journal {name}: {skipped} unreadable line(s) skipped")
    return written, problems


def _own_lines(lines: list[str], run_id: str) -> tuple[list[str], int]:
    """The lines of this run's requests (keys starting with the run id), and how many lines
    could not be read; a journal still being written may end in a torn line."""
    prefix = f"{run_id}-"
    kept, bad = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict) and str(record.get("key", "")).startswith(prefix):
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept, bad
