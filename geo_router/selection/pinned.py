"""A Responses follow-up's candidates: only the replica that stored the response.

vLLM keeps a stored response in the memory of the process that made it
(geo_router.ingress.responses), so a follow-up (`previous_response_id`, GET, cancel) can run
on that replica only, and only if the tenant's residency allows it there: it is picked from
the tenant's own candidates, never added to them.
"""

from __future__ import annotations

from ..errors import NoHealthyReplica
from ..ingress.responses import ResponseNotFound, StoredResponse
from ..state.table import LoadedTable
from .candidates import Candidate


def pinned(loaded: LoadedTable, candidates: list[Candidate], stored: StoredResponse, model: str) -> list[Candidate]:
    """Only the replica holding a stored response can continue it."""
    pinned = [c for c in candidates if c.node.node_id == stored.node_id]
    if pinned:
        return pinned
    if stored.node_id in loaded.nodes_by_id:
        # Still in the fleet, not usable now (ejected, draining): worth a retry later.
        raise NoHealthyReplica(model, 5)
    raise ResponseNotFound(stored.inner_id, param="previous_response_id")
