"""grpc method handlers for a service, built from the service's descriptor in the generated *_pb2 module.

protoc's *_pb2_grpc modules (1,150 lines for Triton's two services) write the same table out by hand, plus
client stubs and a servicer base class a server does not need. A method the servicer lacks is left out, and
grpc answers it UNIMPLEMENTED itself.
"""

from __future__ import annotations

import grpc
from google.protobuf import message_factory

# (client streams, server streams) -> grpc's constructor of that kind of handler
_HANDLER_OF = {(False, False): grpc.unary_unary_rpc_method_handler,
               (False, True): grpc.unary_stream_rpc_method_handler,
               (True, False): grpc.stream_unary_rpc_method_handler,
               (True, True): grpc.stream_stream_rpc_method_handler}


def method_handlers(service, servicer, readers: dict | None = None, writers: dict | None = None) -> dict:
    """{method name: handler} of every method of `service` (a ServiceDescriptor) that `servicer` implements; its
    requests parsed by protobuf, or by `readers[method name]` (bytes -> what the method takes), its replies
    serialized by protobuf or by `writers[method name]` (what the method returns -> bytes)."""
    handlers = {}
    for method in service.methods:
        implementation = getattr(servicer, method.name, None)
        if implementation is None:
            continue
        request = message_factory.GetMessageClass(method.input_type)
        reply = message_factory.GetMessageClass(method.output_type)
        make = _HANDLER_OF[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(implementation, request_deserializer=(readers or {}).get(method.name,
                                                                                                request.FromString),
                                     response_serializer=(writers or {}).get(method.name, reply.SerializeToString))
    return handlers


def add_service(server, service, servicer, readers: dict | None = None, writers: dict | None = None) -> None:
    """Serve `servicer`'s methods of `service` on `server` (a grpc.aio.Server)."""
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        service.full_name, method_handlers(service, servicer, readers, writers)),))
