"""What a drill's load sends, and when: the arrival schedule and the prompts.

Arrivals are a seeded Poisson process plus a drill's burst of long streams; prompts are
fresh one-sentence questions or turns of a tenant's conversations that share a long system
prompt (so prefix-cache affinity has something to find). Everything is derived from the
drill's seed, so a run's requests can be rebuilt exactly when its history is checked.
Kept apart from the generator (chaos.load), which only sends what this schedules.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from chaos.drill import Load
from chaos.streams import split_tenants

CONVERSATIONS_PER_TENANT = 4
MAX_PROMPT_CHARS = 1500
_ASSISTANT_ACK = "Noted."

_WORDS = (
    "region", "replica", "latency", "throughput", "cache", "prefix", "token", "stream", "router",
    "tenant", "zone", "failover", "quorum", "lease", "snapshot", "weights", "digest", "shard",
    "budget", "deadline", "retry", "backoff", "probe", "drain", "eject", "heal", "burst", "queue",
    "batch", "kernel", "memory", "bandwidth", "packet", "window", "sample", "model", "prompt",
    "answer", "summary", "incident", "runbook", "capacity", "forecast", "residency", "audit",
)



@dataclass(frozen=True, slots=True)
class Arrival:
    """One scheduled request; `conversation` is None without a shared prefix."""

    at_s: float
    tenant: str
    stream: bool
    conversation: int | None
    turn: int
    long: bool = False  # one of load.long_streams (chaos.streams)
    protocol: str = "http"  # one of chaos.protocols.PROTOCOLS (load.protocols' weights)


def make_schedule(load: Load, seed: int) -> list[Arrival]:
    """The Poisson arrivals and the long-stream burst (if any), in time order."""
    out = _poisson_schedule(load, seed)
    ls = load.long_streams
    if ls is not None:
        weights = {t.name: t.weight for t in load.tenants}
        names = ls.tenants or list(weights)
        rng = random.Random(f"long:{seed}")
        tenants = split_tenants([(n, weights[n]) for n in names], ls.count)
        out += [Arrival(ls.at_s + rng.uniform(0, ls.spread_s), t, True, None, 0, long=True) for t in tenants]
    return sorted(out, key=lambda a: a.at_s)


def _poisson_schedule(load: Load, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    names = [t.name for t in load.tenants]
    weights = [t.weight for t in load.tenants]
    turns: dict[tuple[str, int], int] = {}
    out: list[Arrival] = []
    t = rng.expovariate(load.arrivals_per_s)
    while t < load.duration_s:
        tenant = rng.choices(names, weights)[0]
        stream = rng.random() < load.streaming_fraction
        conversation: int | None = None
        turn = 0
        if load.shared_prefix:
            conversation = rng.randrange(CONVERSATIONS_PER_TENANT)
            turn = turns.get((tenant, conversation), 0)
            turns[tenant, conversation] = turn + 1
        protocol = _protocol(load, seed, len(out))
        # A WebSocket turn always streams (the socket's events are the streamed API's).
        out.append(Arrival(t, tenant, stream or protocol == "websocket", conversation, turn, protocol=protocol))
        t += rng.expovariate(load.arrivals_per_s)
    return out


def _protocol(load: Load, seed: int, n: int) -> str:
    """The n-th arrival's protocol, by load.protocols' weights; from its own random stream,
    so a drill that names no protocols sends exactly the schedule it always did."""
    if len(load.protocols) == 1:
        return next(iter(load.protocols))
    names = list(load.protocols)
    return random.Random(f"protocol:{seed}:{n}").choices(names, [load.protocols[p] for p in names])[0]


def burst_schedule(load: Load, count: int, at_s: float, seed: int, spread_s: float = 0.5) -> list[Arrival]:
    """`count` arrivals within `spread_s` seconds of `at_s`: tenants by weight, streams by
    the load's fraction, fresh prompts (a burst of new users, not ongoing conversations)."""
    rng = random.Random(seed)
    names = [t.name for t in load.tenants]
    weights = [t.weight for t in load.tenants]
    times = sorted(at_s + rng.uniform(0, spread_s) for _ in range(count))
    return [Arrival(t, rng.choices(names, weights)[0], rng.random() < load.streaming_fraction, None, 0)
            for t in times]


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def fresh_prompt(rng: random.Random) -> str:
    return f"In one sentence, explain {_words(rng, rng.randint(4, 10))}."


def system_prompt(tenant: str) -> str:
    """The long system prompt every conversation of a tenant shares (about 500 characters)."""
    rng = random.Random(f"system:{tenant}")
    sentences = [f"You are the operations assistant of {tenant}."]
    while sum(len(s) + 1 for s in sentences) < 500:
        sentences.append(f"Always consider {_words(rng, 6)} before answering.")
    return " ".join(sentences)


def _user_turn(seed: int, tenant: str, conversation: int, turn: int) -> str:
    rng = random.Random(f"turn:{seed}:{tenant}:{conversation}:{turn}")
    return f"Question {turn + 1}: what should we do about {_words(rng, rng.randint(5, 9))}?"


def conversation_messages(seed: int, tenant: str, conversation: int, turn: int) -> list[dict[str, str]]:
    """Turn `turn` of a conversation: the shared system prompt and the latest user turns.

    The generator never waits for answers, so earlier turns are followed by a fixed
    acknowledgement (chat templates want user and assistant to alternate). The oldest turns
    are dropped to keep the prompt under MAX_PROMPT_CHARS; the system prompt always stays.
    """
    system = system_prompt(tenant)
    budget = MAX_PROMPT_CHARS - len(system)
    latest = _user_turn(seed, tenant, conversation, turn)
    budget -= len(latest)
    kept: list[str] = []
    for earlier in range(turn - 1, -1, -1):
        text = _user_turn(seed, tenant, conversation, earlier)
        if len(text) + len(_ASSISTANT_ACK) > budget:
            break
        budget -= len(text) + len(_ASSISTANT_ACK)
        kept.append(text)
    messages = [{"role": "system", "content": system}]
    for text in reversed(kept):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": _ASSISTANT_ACK}]
    messages.append({"role": "user", "content": latest})
    return messages
