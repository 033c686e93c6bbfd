"""A bare grpc.aio server: the least a gRPC call can cost a Python process.

    python -m bench.grpc_bare PORT     (bench.protocols starts it: its path `grpc bare`)

Its ModelInfer answers at once with an empty response, on uvloop as the router's listener
runs: no authentication, no routing, no node. What bench.protocols measures of it is
grpc.aio's own CPU per call (its C core, the completion queue handed to asyncio, the
messages), the floor under the router's `grpc` path at the same rate.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import uvloop

from bench.common import stop_process
from geo_router.ingress.kserve import kserve_v2_pb2 as pb
from geo_router.ingress.kserve import kserve_v2_pb2_grpc as pb_grpc
from meridian.ports import free_port


class _Bare(pb_grpc.GRPCInferenceServiceServicer):
    async def ModelInfer(self, request: pb.ModelInferRequest, context: Any) -> pb.ModelInferResponse:  # noqa: N802
        return pb.ModelInferResponse(model_name=request.model_name, id=request.id)


async def _serve(port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(_Bare(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


@contextlib.contextmanager
def bare_server() -> Iterator[tuple[int, int]]:
    """A bare server in a process group of its own: its port and process id (= group id)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bench.grpc_bare", str(port)], start_new_session=True)
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        channel.close()
        yield port, proc.pid
    finally:
        stop_process(proc)


if __name__ == "__main__":
    uvloop.run(_serve(int(sys.argv[1])))
