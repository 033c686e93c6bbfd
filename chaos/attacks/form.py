"""How long and how hard each attack runs, and what every attack module provides.

Contract: an attack is a value with a `name`, the `target` process it aims at ("router" or
"control-plane"), the `router_env` its router starts with, the `cut_off_bound_s` it is held
to, `seconds(form)` (how long its client runs at most) and `run(fabric, form)` (the attack
itself, which closes its connections before it returns). `SHORT` is the form CI runs (a few
seconds an attack, enough to replay each finding's harm on today's code); `LONG` the form
the issue's figures were taken in (seconds to tens of seconds, hundreds of thousands of
requests). Every attack is bounded in count and time in both, and speaks to loopback only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from chaos.attacks.result import Outcome
from chaos.attacks.target import AttackFabric


@dataclass(frozen=True)
class Form:
    name: str
    # The neighbour's time alone with the idle server, before the attack (its baseline).
    idle_s: float
    # After the attack's connections closed, before RSS "after" is read.
    settle_s: float

    @property
    def long(self) -> bool:
        return self.name == "long"


SHORT = Form("short", idle_s=1.0, settle_s=2.0)
LONG = Form("long", idle_s=2.0, settle_s=5.0)
FORMS = {f.name: f for f in (SHORT, LONG)}


class Attack(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def target(self) -> str: ...

    @property
    def cut_off_bound_s(self) -> float: ...

    @property
    def router_env(self) -> Mapping[str, str]: ...

    def seconds(self, form: Form) -> float: ...

    async def run(self, fabric: AttackFabric, form: Form) -> Outcome: ...
