"""The router's gRPC listener: KServe v2 inference, `grpc.health.v1` and server reflection.

It runs in the router app's event loop, started and stopped by the app's lifespan (so it
shares every part of the app: routing table, fleet state, limits), on `grpc_port` when that
is set. Limits, as the HTTP listener's: a message is at most `max_request_bytes` (larger is
RESOURCE_EXHAUSTED), at most `grpc_max_concurrent_rpcs` calls run at once (more are
RESOURCE_EXHAUSTED at once, before any work), `grpc_max_streams_per_connection` concurrent
streams per HTTP/2 connection, and keepalive pings find dead peers. TLS when the router has
a certificate (`tls_cert_file`, `tls_key_file`), as its HTTP listener then has.

Health: the overall service ("") and `inference.GRPCInferenceService` are SERVING once a
routing table is loaded and NOT_SERVING while none is, and on shutdown NOT_SERVING first,
so that a load balancer stops sending before the listener stops.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import grpc
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from meridian.settings.router import RouterSettings

from . import kserve_v2_pb2 as pb
from . import kserve_v2_pb2_grpc as pb_grpc
from .service import InferenceService

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
_GRACE_S = 5.0


class GrpcListener:
    """One gRPC server of one router app."""

    def __init__(self, settings: RouterSettings, service: InferenceService) -> None:
        self._settings = settings
        self._service = service
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._marking: asyncio.Future[None] | None = None
        self.port: int | None = None

    async def start(self) -> None:
        s = self._settings
        assert s.grpc_port is not None
        server = grpc.aio.server(
            maximum_concurrent_rpcs=s.grpc_max_concurrent_rpcs,
            options=[
                ("grpc.max_receive_message_length", s.max_request_bytes),
                ("grpc.max_send_message_length", max(s.max_request_bytes, 4 * 1024 * 1024)),
                ("grpc.max_concurrent_streams", s.grpc_max_streams_per_connection),
                ("grpc.keepalive_time_ms", 20_000),
                ("grpc.keepalive_timeout_ms", 20_000),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
                ("grpc.max_connection_idle_ms", int(s.ws_idle_timeout_s * 1000)),
            ],
        )
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self._service, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        _enable_reflection(server)
        address = f"{s.grpc_host or s.host}:{s.grpc_port}"
        if s.tls_cert_file and s.tls_key_file:
            credentials = grpc.ssl_server_credentials([await asyncio.to_thread(_key_pair, s.tls_key_file,
                                                                               s.tls_cert_file)])
            self.port = server.add_secure_port(address, credentials)
        else:
            self.port = server.add_insecure_port(address)
        await server.start()
        self._server = server
        log.info("router: gRPC (KServe v2) on %s", address if s.grpc_port else f"port {self.port}")

    def table_loaded(self) -> None:
        """A routing table is in force: SERVING (once the listener runs)."""
        if self._server is not None:
            self._marking = asyncio.ensure_future(self.serving(True))

    async def serving(self, ready: bool) -> None:
        """Tell health checkers whether inference can be served."""
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self._health.set(name, status)

    async def stop(self) -> None:
        if self._server is None:
            return
        await self._health.enter_graceful_shutdown()
        await self._server.stop(_GRACE_S)
        self._server = None


def _key_pair(key: Path, cert: Path) -> tuple[bytes, bytes]:
    return key.read_bytes(), cert.read_bytes()


def _enable_reflection(server: grpc.aio.Server) -> None:
    """Server reflection over the KServe messages' own descriptor pool (kserve_v2_pb2 keeps
    them out of the default one), with the health service's file added to it."""
    pool = pb.DESCRIPTOR.pool
    health_file = descriptor_pb2.FileDescriptorProto()
    health_pb2.DESCRIPTOR.CopyToProto(health_file)
    try:
        pool.Add(health_file)
    except (TypeError, ValueError):
        pass  # added by an earlier listener of this process
    names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server, pool=pool)
