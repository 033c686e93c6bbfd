"""The torch node's side of meridian.kv_transfer: whether it takes part, which side a
request's `kv_transfer_params` put it on, and what a prefill answer hands the decode node.

A node takes part when it has a role (prefill or decode) or a KV connector; like vLLM's
`kv_both`, such a node serves either side. A co-located node without a connector cannot
honour the params, so it refuses them with a 400 naming them rather than serving the
request as if they had been honoured. Params that ask for neither side (vLLM's `{}` or
all flags false) ask for nothing and are ignored, as vLLM does.

What a prefill answer says (vLLM's NixlConnector keys, so one router serves both engines):
`remote_engine_id` the node id, `remote_host`/`remote_port` the node's advertised listener
(the decode node pulls `GET http://host:port/v1/kv/{remote_request_id}` with the cluster
token), `remote_block_ids` the held blocks, `remote_num_tokens` the prompt tokens they hold.
"""

from __future__ import annotations

import enum
from typing import Any

from data_plane.agent import advertised_endpoint, default_node_id
from data_plane.engine.base import KVHold
from data_plane.server.errors import BadRequestError
from meridian.contracts import KVConnector, NodeRole
from meridian.kv_transfer import is_decode_request, is_prefill_request
from meridian.settings.node import NodeSettings

PARAM = "kv_transfer_params"


class KVSide(enum.Enum):
    NONE = "none"  # served as any request
    PREFILL = "prefill"  # hold the prompt's KV for a decode node
    DECODE = "decode"  # pull the prompt's KV from a prefill node


def takes_part(settings: NodeSettings) -> bool:
    """Whether a torch node serves `kv_transfer_params`; a ValueError for a connector the
    torch engine does not have."""
    if settings.kv_connector not in (None, KVConnector.MERIDIAN):
        raise ValueError(
            f"the torch engine moves KV with {KVConnector.MERIDIAN.value}, not {settings.kv_connector.value}"
        )
    return settings.role is not NodeRole.BOTH or settings.kv_connector is not None


def kv_side(params: dict[str, Any] | None, *, enabled: bool, stream: bool) -> KVSide:
    """Which side of a hand-off a request is; a 400 for one this node cannot serve."""
    prefill, decode = is_prefill_request(params), is_decode_request(params)
    if not (prefill or decode):
        return KVSide.NONE
    if not enabled:
        raise BadRequestError(
            f"`{PARAM}` asks for a prefill/decode hand-off, but this node is co-located "
            "(role both) without a KV connector", param=PARAM, code="unsupported_parameter",
        )
    if prefill and decode:
        raise BadRequestError(f"`{PARAM}` cannot ask for both do_remote_decode and do_remote_prefill",
                              param=PARAM)
    if prefill and stream:
        raise BadRequestError(f"a prefill request (`{PARAM}.do_remote_decode`) must not be streamed",
                              param="stream")
    return KVSide.PREFILL if prefill else KVSide.DECODE


def prefill_answer(settings: NodeSettings, hold: KVHold) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill answer hands to the decode node."""
    host, port = advertised_endpoint(settings)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": default_node_id(settings),
        "remote_block_ids": list(hold.block_ids),
        "remote_host": host,
        "remote_port": port,
        "remote_request_id": hold.handle,
        "remote_num_tokens": hold.num_tokens,
        "tp_size": 1,
    }
