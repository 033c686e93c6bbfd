"""The vLLM adapter: `vllm serve` as a supervised child process behind the Engine protocol.

Nothing here imports vLLM: the child is a separate program (settings.vllm_executable),
so a CPU node and the tests run without it.
"""

from data_plane.engine.vllm.command import KVEventsEndpoints, build_serve_argv, spec_from_settings
from data_plane.engine.vllm.engine import VllmEngine
from data_plane.engine.vllm.relay import KVEventRelay, decode_vllm_batch
from data_plane.engine.vllm.supervisor import ChildState, RestartPolicy, VllmFailedError, VllmSupervisor

__all__ = [
    "ChildState",
    "KVEventRelay",
    "KVEventsEndpoints",
    "RestartPolicy",
    "VllmEngine",
    "VllmFailedError",
    "VllmSupervisor",
    "build_serve_argv",
    "decode_vllm_batch",
    "spec_from_settings",
]
