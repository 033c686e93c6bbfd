"""What the torch engine refuses before it queues a request: limits a request can be
checked against without the worker thread (pure; EngineRequestError naming the limit)."""

from __future__ import annotations

from data_plane.engine.base import EngineRequestError, GenerationRequest
from data_plane.sampling import SamplingError, check_sampling


def check_request(request: GenerationRequest, *, max_model_len: int, capacity_tokens: int,
                  vocab_size: int) -> None:
    """Raise EngineRequestError when `request` cannot be served by an engine of these limits."""
    params = request.sampling_params
    n_prompt = len(request.prompt_token_ids)
    if n_prompt == 0:
        raise EngineRequestError("the prompt is empty")
    if params.max_tokens < 1:
        raise EngineRequestError("max_tokens must be at least 1")
    try:
        check_sampling(params.temperature, params.top_p, params.top_k)
    except SamplingError as exc:
        raise EngineRequestError(str(exc)) from None
    total = n_prompt + params.max_tokens
    if total > max_model_len:
        raise EngineRequestError(
            f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
            f"the maximum context length {max_model_len}"
        )
    if total > capacity_tokens:
        raise EngineRequestError(
            f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the "
            f"KV cache capacity of this node ({capacity_tokens} tokens)"
        )
    if any(t < 0 or t >= vocab_size for t in request.prompt_token_ids):
        raise EngineRequestError(f"prompt token ids must be in [0, {vocab_size})")
