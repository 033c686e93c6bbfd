"""Whether a broken stream moves, and where: pure decisions, no I/O.

A stream moves only inside the candidates the request was given (residency and the
tenant's zone were applied to those before any policy, so a continuation can never leave
the zone), never back to a node that failed it, to a node in the failed node's region
first (its KV and LoRA affinity were scored for the same prompt), then to the rest in the
policy's order (nearest first). It does not move past the per-request limit, or when the
router's migration budget is spent: a failing fleet must not be flooded with re-prefills.

A stream with tool calls (plan.tools) is resumed by replaying the node's tool-call parser on
the continuation's text (tool_calls.py), and the router replays one: vLLM's `pythonic`.
Each node advertises its parser in its registration (RoutingNode.tool_call_parser), so such
a stream moves only off a node that advertises pythonic (another parser's calls, hermes'
`<tool_call>` or mistral's `[TOOL_CALLS]`, would be replayed wrongly: TOOL_FORMAT) and only
to replicas that advertise it too (none left: NO_REPLICA). A node that advertises nothing
(an older node, no auto tool choice) is not assumed to be pythonic.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from enum import StrEnum

from meridian.contracts import RoutingNode

from ...selection.candidates import Candidate

# The one tool-call format the router replays (vLLM's --tool-call-parser name).
REPLAYED_TOOL_PARSER = "pythonic"


class BreakReason(StrEnum):
    """Why the piece of a stream on a node ended early (the `reason` label of migrations)."""

    CONNECTION = "connection"  # reset, refused, closed: the node died or went away
    SERVER_ERROR = "server_error"  # the node sent an error event, or a 5xx to a continuation
    STALLED = "stalled"  # no event within the inter-token timeout (gray failure)


class Refusal(StrEnum):
    """Why a broken stream was not moved (the `why` label of refused migrations)."""

    NOT_RESUMABLE = "not_resumable"  # no token ids, reasoning, or tool calls not in pythonic form
    TOOL_FORMAT = "tool_format"  # tool calls read by a parser the router does not replay
    LIMIT = "limit"  # the request moved as often as it may
    BUDGET = "budget"  # the router's migration budget is spent
    NO_REPLICA = "no_replica"  # no other replica in the tenant's zone (that replays tool calls)
    DEADLINE = "deadline"  # the request's own time is up


@dataclass(frozen=True, slots=True)
class Move:
    candidate: Candidate


@dataclass(frozen=True, slots=True)
class Refuse:
    why: Refusal


def replays_tool_calls(node: RoutingNode) -> bool:
    """Whether the router can replay the tool calls of a stream `node` serves."""
    return node.tool_call_parser == REPLAYED_TOOL_PARSER


def tool_replicas(candidates: Sequence[Candidate]) -> list[Candidate]:
    """The candidates a tool-call stream may continue on."""
    return [c for c in candidates if replays_tool_calls(c.node)]


def next_replica(
    candidates: Sequence[Candidate], failed: Collection[str], from_region: str, is_ejected: Callable[[str], bool],
    is_suspect: Callable[[str], bool] = lambda _: False,
) -> Candidate | None:
    """The replica a stream continues on: same region first, then the policy's order;
    replicas under suspicion (frozen-looking: their own streams went silent) only when no
    other is left, since trying one costs a stream the inter-token timeout again."""
    usable = [c for c in candidates if c.node.node_id not in failed and not is_ejected(c.node.node_id)]
    for group in ([c for c in usable if not is_suspect(c.node.node_id)], usable):
        for c in group:
            if c.region.name == from_region:
                return c
        if group:
            return group[0]
    return None


def decide(
    *, resumable: bool, migrations: int, max_migrations: int, replica: Candidate | None, time_left_s: float,
    tool_format: bool = True,
) -> Move | Refuse:
    """Move to `replica`, or refuse and say why; `tool_format`: the stream has no tool
    calls, or its node's parser is the one the router replays. The router's budget is asked
    after a Move (geo_router.forwarding.migration.budget): it may make the move wait its turn, and a
    refusal for another reason must not spend it."""
    if not resumable:
        return Refuse(Refusal.NOT_RESUMABLE)
    if not tool_format:
        return Refuse(Refusal.TOOL_FORMAT)
    if time_left_s <= 0:
        return Refuse(Refusal.DEADLINE)
    if migrations >= max_migrations:
        return Refuse(Refusal.LIMIT)
    if replica is None:
        return Refuse(Refusal.NO_REPLICA)
    return Move(replica)
