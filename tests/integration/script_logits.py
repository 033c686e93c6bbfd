"""A test-only vLLM logits processor: a request that carries a script writes it, exactly.

A random-weight tiny model never writes a tool call by itself. With this processor loaded
(`--logits-processors script_logits:ScriptLogitsProcessor`, this folder on vLLM's
PYTHONPATH), a request with `vllm_xargs: {"script": [token ids], "script_end": id}` makes
vLLM's engine pick, greedily, script[k] where k is the length of the longest suffix of
(prompt ids + output ids) that begins the script, then `script_end` (EOS) once the script
is written. So a continuation whose prompt is the original prompt plus part of the script
writes the rest, as a real model would; requests without a script are untouched.

Imported by vLLM's process only (it needs torch and vllm, which the router's venv lacks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.sampling_params import SamplingParams
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor


def next_scripted(seq: list[int], script: list[int], end: int) -> int:
    for k in range(min(len(seq), len(script)), 0, -1):
        if seq[-k:] == script[:k]:
            return script[k] if k < len(script) else end
    return script[0]


class ScriptLogitsProcessor(AdapterLogitsProcessor):
    """Forces a request's script (SamplingParams.extra_args["script"]) token by token."""

    def is_argmax_invariant(self) -> bool:
        return False  # it decides the argmax: it must run for greedy requests too

    def new_req_logits_processor(self, params: SamplingParams) -> Callable[..., torch.Tensor] | None:
        extra: dict[str, Any] = params.extra_args or {}
        if not extra.get("script"):
            return None
        script = [int(t) for t in extra["script"]]
        end = int(extra["script_end"])

        def force(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            token = next_scripted([*prompt_ids, *output_ids], script, end)
            forced = torch.full_like(logits, float("-inf"))
            forced[token] = 0.0
            return forced

        return force
