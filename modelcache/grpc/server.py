"""Run the gRPC front: grpc.aio's server on host:port, one DaemonLink to the daemon's serve lane.

grpc's core parses HTTP/2 and enforces max_receive_message_length (the daemon's max_message_size) from a
message's length prefix, so a request over the limit is refused with RESOURCE_EXHAUSTED before its body is
buffered. Replies may be as large as the model makes them.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from ..errors import ConfigError
from ..oip.lifecycle import SHUTDOWN_TIMEOUT_S, until_stopped
from ..oip.link import DaemonLink
from ..oip.operations import Operations
from ..triton_protos import grpc_service_pb2, health_pb2
from .codec import read_infer_request, write_infer_answer, write_stream_answer
from .handlers import add_service
from .service import HealthService, InferenceService

log = logging.getLogger("modelcache.grpc")


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve(settings, host: str, port: int, on_ready=None, reserved=None) -> None:
    """Serve until SIGTERM or SIGINT; `on_ready(host:port)` once the port accepts calls. `reserved`: a socket
    holding host:port (address.reserve_tcp: bound with SO_REUSEPORT, not listening), which grpc binds beside;
    closed at the stop."""
    logging.getLogger("grpc").setLevel(logging.WARNING)   # its debug lines: one per call, even with ours at debug
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", settings.max_message_bytes()),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 1),   # beside the socket that holds the port (see address.reserve_tcp)
    ])
    ops = Operations(DaemonLink(settings.socket, settings.request_timeout_s, front="grpc"), settings)
    # (an infer request's raw contents read as views of what came; its answer's written from the output arrays)
    infer_reader = {"ModelInfer": read_infer_request, "ModelStreamInfer": read_infer_request}
    add_service(server, grpc_service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"], InferenceService(ops),
                infer_reader, {"ModelInfer": write_infer_answer, "ModelStreamInfer": write_stream_answer})
    add_service(server, health_pb2.DESCRIPTOR.services_by_name["Health"], HealthService(ops))
    try:
        bound = server.add_insecure_port(address(host, port))
    except RuntimeError:
        bound = 0
    if not bound:   # (the port is held for us: only a rare failure of grpc's own gets here)
        raise ConfigError(f"port {port}: grpc cannot listen on {address(host, port)}")
    await server.start()
    where = address(host, bound)
    log.info("Triton gRPC protocol on %s for the daemon at %s", where, settings.socket)
    if on_ready:
        on_ready(where)
    try:
        await until_stopped()
    finally:
        await server.stop(SHUTDOWN_TIMEOUT_S)   # in-flight calls finish, new ones are refused
        await ops.close()
        if reserved is not None:
            reserved.close()
    log.info("gRPC front stopped")


def run(settings, host: str, port: int, on_ready=None, reserved=None) -> None:
    asyncio.run(serve(settings, host, port, on_ready, reserved))
