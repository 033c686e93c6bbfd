"""The attack suite: each listener finding of issue 33 replayed against real processes.

Contract: `ATTACKS` are the attacks (one module each: chaos.attacks.pipelining,
.websocket, .http2), `run_attack`/`run_suite` (chaos.attacks.runner) run them against a
fresh `meridian control-plane serve` and `meridian router serve` (chaos.attacks.target)
while a well-behaved neighbour is timed (chaos.attacks.neighbour) and the target's RSS is
read from /proc, and `check(result)` (chaos.attacks.result) says which bound each result
breaks: cut off within the attack's bound, the neighbour's p99 within 250 ms, the RSS peak
within 128 MiB of idle and the RSS after within 64 MiB. `python -m bench.attacks` prints
the figures, tests/e2e/test_attacks.py asserts the checks in the short form.

Why a suite and not one test per fix: a listener bounded in one place and not another is
still unbounded, and the same five attacks, run against every listener change, say so.
Each attack is bounded in count and time and speaks to loopback only.
"""

from chaos.attacks.form import FORMS, LONG, SHORT, Attack, Form
from chaos.attacks.http2 import EndlessBodies, SettingsFlood
from chaos.attacks.pipelining import PipelinedFlood
from chaos.attacks.report import table
from chaos.attacks.result import AttackResult, Bounds, Outcome, check
from chaos.attacks.runner import run_attack, run_suite
from chaos.attacks.websocket import RevokedKeySocket, WarmUpFlood

ATTACKS: tuple[Attack, ...] = (
    PipelinedFlood(target="router"),
    PipelinedFlood(target="control-plane"),
    WarmUpFlood(),
    RevokedKeySocket(),
    SettingsFlood(),
    EndlessBodies(),
)

__all__ = [
    "ATTACKS",
    "FORMS",
    "LONG",
    "SHORT",
    "Attack",
    "AttackResult",
    "Bounds",
    "Form",
    "Outcome",
    "check",
    "run_attack",
    "run_suite",
    "table",
]
