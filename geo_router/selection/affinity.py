"""What the router knows about each candidate replica beyond its health: load, KV-prefix
overlap with the request, LoRA residency and expected queueing time.

Prefix overlap comes from the exact index (geo_router.state.kv_index, built from the node's KV
events) for nodes that publish events, and from the approximate index of this router's
(and, with Redis, every router's) own routing history (geo_router.state.prefix_history) for
nodes that do not. Both give the number of leading blocks of the prompt a node holds;
the policy sees the share of the prompt that is. Load is what the node last reported to
the prober, combined with this router's own in-flight count (Candidate.pending).

A request with one candidate is not annotated at all: there is nothing to choose, and
that keeps the common single-replica path cheap.

When the candidates are a bounded sample of a large model's replicas (geo_router.selection.candidates),
the replica a conversation went to may not be in it: `annotate` asks the routing history and
the KV index for the nodes holding the longest run of the prompt (O(log keys), not
O(replicas)) and adds the usable ones. The history records where every request went, so it
finds a conversation's replica; the KV index finds a cache that holds the prompt for another
reason (another router's request, without shared history), among the nodes it indexes and at
the candidates' block size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from meridian.clock import SYSTEM_CLOCK, Clock
from meridian.contracts import RoutingNode

from ..state.node_load import NodeLoad
from .candidates import Candidate, LoraState, split_adapter
from .prefix import RequestPrefix

# A node's service time is an exponentially weighted mean with this weight on each sample.
_EWMA_ALPHA = 0.2
# Adapters sent to a node within this many seconds count as loaded there.
_ADAPTER_RECENT_S = 60.0
# Block size assumed until a node's metrics or events say otherwise (vLLM's and ours).
DEFAULT_BLOCK_SIZE = 16
# Holders of a prompt's prefix added to a bounded candidate set, at most (most recent first).
_MAX_HOLDERS = 4


class LoadSource(Protocol):
    def load(self, node_id: str) -> NodeLoad | None: ...


class BlockIndex(Protocol):
    def match(self, hashes: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]: ...

    def holders(self, hashes: Sequence[int], limit: int) -> list[str]: ...

    def block_size(self, node_id: str) -> int | None: ...


class History(Protocol):
    def match(self, keys: Sequence[int], node_ids: Iterable[str]) -> dict[str, int]: ...

    def holders(self, keys: Sequence[int], limit: int) -> list[str]: ...

    def record(self, node_id: str, keys: Sequence[int]) -> None: ...


class PrefixSource(Protocol):
    def build(self, model: str, payload: Mapping[str, Any], block_size: int | None) -> RequestPrefix: ...


@dataclass(frozen=True, slots=True)
class Choice:
    """What the router predicted for the replica it tried first (for metrics and history)."""

    node_id: str
    prompt_tokens: int
    predicted_hit_tokens: int


class ServiceTimes:
    """Per-node mean time to first byte, learnt from the requests the router forwarded."""

    def __init__(self, default_ms: float) -> None:
        self._default_ms = default_ms
        self._ms: dict[str, float] = {}

    def observe(self, node_id: str, seconds: float) -> None:
        ms = seconds * 1000.0
        prev = self._ms.get(node_id)
        self._ms[node_id] = ms if prev is None else prev + _EWMA_ALPHA * (ms - prev)

    def ms(self, node_id: str) -> float:
        return self._ms.get(node_id, self._default_ms)

    def forget(self, node_id: str) -> None:
        self._ms.pop(node_id, None)

    def nodes(self) -> list[str]:
        return list(self._ms)


class RecentCounts:
    """Requests sent to each node, decaying with a half-life: who got the most work lately."""

    def __init__(self, half_life_s: float, clock: Clock = SYSTEM_CLOCK) -> None:
        self._rate = math.log(2) / half_life_s
        self._clock = clock
        self._counts: dict[str, tuple[float, float]] = {}  # node -> (count, at)

    def get(self, node_id: str) -> float:
        entry = self._counts.get(node_id)
        if entry is None:
            return 0.0
        count, at = entry
        return count * math.exp(-self._rate * (self._clock.monotonic() - at))

    def add(self, node_id: str) -> None:
        self._counts[node_id] = (self.get(node_id) + 1.0, self._clock.monotonic())

    def forget(self, node_id: str) -> None:
        self._counts.pop(node_id, None)

    def nodes(self) -> list[str]:
        return list(self._counts)


def every_node(_node: RoutingNode) -> bool:
    """Affinity's `exact` when the KV index follows every node that publishes events."""
    return True


class Affinity:
    """Annotates candidates for the policy and remembers where prompts and adapters went."""

    def __init__(
        self,
        *,
        loads: LoadSource,
        kv_index: BlockIndex,
        history: History,
        prefixes: PrefixSource,
        default_service_ms: float = 200.0,
        balance_half_life_s: float = 60.0,
        clock: Clock = SYSTEM_CLOCK,
        exact: Callable[[RoutingNode], bool] | None = every_node,
    ) -> None:
        self._loads = loads
        self._kv_index = kv_index
        self._history = history
        self._prefixes = prefixes
        self._clock = clock
        # Which of the nodes that publish KV events the KV index follows, and so are matched
        # exactly (geo_router.state.kv_scope); the others are matched by history. None: a router
        # that does not subscribe to KV events matches every node by history.
        self._exact_for = exact
        self.service_times = ServiceTimes(default_service_ms)
        self.recent = RecentCounts(balance_half_life_s, clock)
        self._recent_adapters: dict[str, dict[str, float]] = {}

    def annotate(
        self,
        candidates: Sequence[Candidate],
        model: str,
        payload: Mapping[str, Any],
        more: Callable[[Sequence[str]], list[Candidate]] | None = None,
    ) -> tuple[list[Candidate], RequestPrefix | None]:
        """The candidates with load, prefix overlap, LoRA state and queueing filled in.

        `more`, given when the candidates are a bounded sample of the model's replicas, turns
        node ids into candidates (selection's checks applied): the nodes the routing history
        says hold the longest run of the prompt are added through it when the sample missed
        them, so a conversation can go back to its replica whatever the fleet's size.
        """
        if len(candidates) < 2:
            return list(candidates), None
        loads = {c.node.node_id: self._loads.load(c.node.node_id) for c in candidates}
        sizes = {c.node.node_id: self._block_size(c.node.node_id, loads[c.node.node_id])
                 for c in candidates if self._exact(c)}
        # Token hashes serve only the exact index: without KV events, skip tokenizing.
        block_size = min(sizes.values(), default=None)
        prefix = self._prefixes.build(model, payload, block_size)
        if more is not None and (prefix.text_keys or prefix.token_hashes):
            candidates = self._with_holders(candidates, prefix, more, loads, sizes)
        hits = self._prefix_hits(candidates, prefix, sizes)
        _, adapter = split_adapter(model)
        out = []
        for c in candidates:
            node_id = c.node.node_id
            load = loads[node_id]
            running, waiting, kv_usage = (load.running, load.waiting, load.kv_usage) if load else (0, 0, 0.0)
            out.append(replace(
                c,
                running=running,
                waiting=waiting,
                kv_usage=kv_usage,
                prefix_hit=hits.get(node_id, 0.0),
                lora=self._lora_state(node_id, adapter, load),
                queue_ms=waiting * self.service_times.ms(node_id),
                recent=self.recent.get(node_id),
            ))
        return out, prefix

    def _with_holders(
        self,
        candidates: Sequence[Candidate],
        prefix: RequestPrefix,
        more: Callable[[Sequence[str]], list[Candidate]],
        loads: dict[str, NodeLoad | None],
        sizes: dict[str, int],
    ) -> Sequence[Candidate]:
        """`candidates` plus the usable holders of the prompt's longest known run left out
        (their loads and block sizes recorded alongside); `candidates` when none is.

        Holders come from the routing history (where this router, or with Redis any router,
        sent the prompt) and from the KV index (whose caches hold it, whoever sent it there).
        """
        have = loads.keys()
        named = self._history.holders(prefix.text_keys, _MAX_HOLDERS) if prefix.text_keys else []
        if self._exact_for is not None and prefix.token_hashes:
            named += self._kv_index.holders(prefix.token_hashes, _MAX_HOLDERS)
        missing = [n for n in dict.fromkeys(named) if n not in have]
        extra = more(missing) if missing else []
        for c in extra:
            loads[c.node.node_id] = load = self._loads.load(c.node.node_id)
            if self._exact(c):
                sizes[c.node.node_id] = self._block_size(c.node.node_id, load)
        return [*candidates, *extra] if extra else candidates

    def chosen(self, candidate: Candidate, model: str, prefix: RequestPrefix | None) -> Choice | None:
        """Remember that the request's prompt (and adapter) went to `candidate`."""
        node_id = candidate.node.node_id
        self.recent.add(node_id)
        _, adapter = split_adapter(model)
        if adapter is not None:
            self._recent_adapters.setdefault(node_id, {})[adapter] = self._clock.monotonic()
        if prefix is None:
            return None
        if prefix.text_keys:
            self._history.record(node_id, prefix.text_keys)
        return Choice(node_id, prefix.num_tokens, round(candidate.prefix_hit * prefix.num_tokens))

    def known_nodes(self) -> set[str]:
        """Nodes this object holds something about (service times, adapters sent)."""
        return set(self.service_times.nodes()) | set(self._recent_adapters) | set(self.recent.nodes())

    def forget_node(self, node_id: str) -> None:
        self._recent_adapters.pop(node_id, None)
        self.service_times.forget(node_id)
        self.recent.forget(node_id)

    def _exact(self, candidate: Candidate) -> bool:
        return self._exact_for is not None and candidate.node.kv_events and self._exact_for(candidate.node)

    def _block_size(self, node_id: str, load: NodeLoad | None) -> int:
        """A node's KV block size: from its events, else its metrics, else the default."""
        return self._kv_index.block_size(node_id) or (load.block_size if load else None) or DEFAULT_BLOCK_SIZE

    def _prefix_hits(
        self, candidates: Sequence[Candidate], prefix: RequestPrefix, sizes: Mapping[str, int]
    ) -> dict[str, float]:
        # Nodes that publish KV events are matched exactly when the request could be
        # tokenized (each against hashes at its own block size); the others (and all of
        # them without a tokenizer) by routing history.
        exact = [c.node.node_id for c in candidates if self._exact(c)] if prefix.token_hashes else []
        approx = [c.node.node_id for c in candidates if not (prefix.token_hashes and self._exact(c))]
        hits: dict[str, float] = {}
        by_size: dict[int, list[str]] = {}
        for node_id in exact:
            by_size.setdefault(sizes[node_id], []).append(node_id)
        for size, nodes in by_size.items():
            hashes = prefix.hashes_for(size)
            if not hashes:
                continue
            total = len(hashes)
            for node_id, blocks in self._kv_index.match(hashes, nodes).items():
                hits[node_id] = blocks / total
        if approx and prefix.text_keys:
            total = len(prefix.text_keys)
            for node_id, keys in self._history.match(prefix.text_keys, approx).items():
                hits[node_id] = keys / total
        return hits

    def _lora_state(self, node_id: str, adapter: str | None, load: NodeLoad | None) -> LoraState:
        if adapter is None:
            return LoraState.NOT_REQUESTED
        recent = self._recent_adapters.get(node_id, {})
        sent_at = recent.get(adapter)
        if sent_at is not None and self._clock.monotonic() - sent_at <= _ADAPTER_RECENT_S:
            return LoraState.LOADED
        if load is not None and adapter in load.active_adapters:
            return LoraState.LOADED
        if load is not None:
            in_use = len(load.active_adapters | {a for a, t in recent.items() if self._clock.monotonic() - t <= _ADAPTER_RECENT_S})
            return LoraState.FREE_SLOT if in_use < load.max_loras else LoraState.NONE
        return LoraState.NONE
