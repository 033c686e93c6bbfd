"""A traffic burst against a deployment scaled to zero: the router must queue the requests
while a node cold-starts, then serve them, or answer 503 with Retry-After at its deadline
or when its queue is full; never drop one."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace

from chaos.arrivals import burst_schedule
from chaos.drill import Fault, Load
from chaos.environment import DrillEnvironment, InjectionError
from chaos.history import History
from chaos.load import LoadGenerator
from localfabric import FabricSpec, LocalDeployment

_DEFAULT_QUEUE_DEADLINE_S = 30.0


class ScaleFromZeroBurst:
    """`burst_requests` requests for the target model at once, from the drill's tenants."""

    @staticmethod
    def prepare(fault: Fault, spec: FabricSpec) -> None:
        model = fault.target.model
        if model is None:
            raise InjectionError("scale_from_zero_burst needs target.model (a deployment scaled to zero)")
        # One replica per region at most, so a zoned tenant's replica can start in its zone.
        spec.deployments = (*spec.deployments,
                            LocalDeployment(model, min_replicas=0, max_replicas=max(1, len(spec.regions))))
        spec.scaler_interval_s = 0.2
        deadline = float(fault.params.get("queue_deadline_s", _DEFAULT_QUEUE_DEADLINE_S))
        spec.router_env = {**spec.router_env, "MERIDIAN_ROUTER_SCALE_FROM_ZERO_TIMEOUT_S": f"{deadline:g}"}

    def __init__(self, fault: Fault, env: DrillEnvironment) -> None:
        if env.load_target is None or env.writer is None or env.load is None:
            raise InjectionError("scale_from_zero_burst needs the drill's load target and history writer")
        self._fault, self._env = fault, env
        self._count = int(fault.params["burst_requests"])
        self._generator: LoadGenerator | None = None

    async def inject(self) -> None:
        env, f = self._env, self._fault
        assert env.load_target is not None and env.writer is not None and f.target.model is not None
        drill_load = self._load()
        schedule = burst_schedule(drill_load, self._count, at_s=env.now_s(), seed=env.seed)
        self._generator = LoadGenerator(
            drill_load, replace(env.load_target, model=f.target.model), env.writer,
            seed=env.seed, key_prefix=f"{env.key_prefix}-burst", schedule=schedule,
        )
        env.background.append(asyncio.create_task(self._generator.run(env.clock_start), name="chaos-burst"))
        env.event("inject", f"{self._count} requests for {f.target.model} (scaled to zero) at once")

    def _load(self) -> Load:
        """The drill's load, with a client timeout past the router's queue deadline."""
        deadline = float(self._fault.params.get("queue_deadline_s", _DEFAULT_QUEUE_DEADLINE_S))
        load = self._env.load
        assert load is not None
        return load.model_copy(update={"request_timeout_s": max(load.request_timeout_s, deadline + 30)})

    async def heal(self) -> None:
        # Nothing to undo: the burst's requests end on their own (served or refused).
        return None

    async def observe(self, history: History) -> Mapping[str, bool]:
        return {}
