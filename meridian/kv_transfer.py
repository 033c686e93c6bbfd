"""The prefill/decode hand-off: vLLM's `kv_transfer_params`, as the router, the torch engine
and vLLM's NIXL connector exchange them.

The router sends the request to a prefill worker with `max_tokens: 1`, `stream: false` and
`prefill_request_params()`; the prefill worker computes the prompt's KV, keeps its blocks
for a lease, and answers with `kv_transfer_params` saying where they are (the answer's one
token is discarded). The router then sends the original request to a decode worker with
those params; the decode worker pulls the blocks and generates from the prompt's last token.

The keys are vLLM's (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py):
`do_remote_decode` / `do_remote_prefill` say which side a request is, and the `remote_*`
keys name the prefill engine, its blocks and its side channel. The torch engine uses the
same keys (`remote_host` / `remote_port` are its HTTP listener, `remote_request_id` the
blocks' handle) so that one router serves both engines. The router never interprets the
`remote_*` values: it checks their shape and size (a node's answer is not trusted to be
small) and hands them on.
"""

from __future__ import annotations

from typing import Any

import msgspec

# The prefill request's params: vLLM's own proxy sends exactly these.
PREFILL_REQUEST_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Largest `kv_transfer_params` a router accepts from a prefill worker, encoded: block ids
# of a 128k-token prompt at 16 tokens per block are ~60 KB of JSON.
MAX_PARAMS_BYTES = 256 * 1024


class KVTransferError(ValueError):
    """A prefill answer without usable `kv_transfer_params`."""


def prefill_request_params() -> dict[str, Any]:
    """A fresh copy of PREFILL_REQUEST_PARAMS, for a request body to own."""
    return dict(PREFILL_REQUEST_PARAMS)


def decode_params(answer: Any) -> dict[str, Any]:
    """The `kv_transfer_params` a prefill worker's answer (its decoded JSON) hands to the
    decode worker: an object marked `do_remote_prefill`, within MAX_PARAMS_BYTES.

    Raises KVTransferError when there are none (a node without a KV connector answers the
    prefill as an ordinary one-token request) or they are malformed."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict):
        raise KVTransferError("the prefill answer has no kv_transfer_params")
    if params.get("do_remote_prefill") is not True:
        raise KVTransferError("the prefill answer's kv_transfer_params are not for a decode worker")
    if len(msgspec.json.encode(params)) > MAX_PARAMS_BYTES:
        raise KVTransferError(f"the prefill answer's kv_transfer_params exceed {MAX_PARAMS_BYTES} bytes")
    return params


def is_prefill_request(params: Any) -> bool:
    """Whether a request's `kv_transfer_params` ask this node to prefill for another."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def is_decode_request(params: Any) -> bool:
    """Whether a request's `kv_transfer_params` hand this node another's prefilled KV."""
    return isinstance(params, dict) and params.get("do_remote_prefill") is True
