"""Triton's gRPC service (inference.GRPCInferenceService) and grpc.health.v1's Check over the shared operations.

Each method parses its message and calls oip/operations.py, as the HTTP routes do; a daemon error becomes its
gRPC status (oip's table: unknown model NOT_FOUND, bad tensors INVALID_ARGUMENT, no daemon or a full tier
UNAVAILABLE, a deadline DEADLINE_EXCEEDED) with one line of details, never a trace. ModelStreamInfer keeps
every request of a stream in flight at once, so they batch in the daemon like concurrent unary calls; an
error answers its own request on the stream (error_message) and the stream goes on.
"""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from google.protobuf import json_format

from ..errors import ModelCacheError, ModelNotFound
from ..oip.operations import Operations, parse_version, status_of
from ..oip.shared_memory import CUDA_REFUSED
from ..triton_protos import grpc_service_pb2 as pb, health_pb2, model_config_pb2
from . import codec

log = logging.getLogger("modelcache.grpc")
SERVICE = "inference.GRPCInferenceService"


def one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


def answers(handler):
    """Errors of a unary method as its status: typed ones with theirs, the rest INTERNAL without a trace."""
    @functools.wraps(handler)
    async def wrapped(self, request, context):
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except ModelCacheError as e:
            await context.abort(grpc.StatusCode[status_of(e)[1]], one_line(e))
        except Exception as e:
            log.error("internal error in %s", handler.__name__, exc_info=True)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}")
    return wrapped


def _deadline_us(timeout_us: int | None, context) -> float | None:
    """The request's own `timeout` parameter or the call's gRPC deadline, whichever ends first."""
    remaining = context.time_remaining()
    if remaining is None:
        return timeout_us
    remaining_us = max(1.0, remaining * 1e6)
    return remaining_us if timeout_us is None else min(timeout_us, remaining_us)


class InferenceService:
    def __init__(self, ops: Operations):
        self.ops = ops

    @answers
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)   # the front answers: it is live

    @answers
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=await self.ops.ready() is None)

    @answers
    async def ModelReady(self, request, context):
        try:
            why = await self.ops.model_ready(request.name, parse_version(request.version))
        except ModelNotFound:
            return pb.ModelReadyResponse(ready=False)   # as Triton: an unknown model is not ready, not an error
        return pb.ModelReadyResponse(ready=why is None)

    @answers
    async def ServerMetadata(self, request, context):
        return json_format.ParseDict(self.ops.server_metadata(), pb.ServerMetadataResponse())

    @answers
    async def ModelMetadata(self, request, context):
        meta = await self.ops.model_metadata(request.name, parse_version(request.version))
        return json_format.ParseDict(meta, pb.ModelMetadataResponse())

    @answers
    async def ModelConfig(self, request, context):
        config = await self.ops.model_config(request.name, parse_version(request.version))
        return pb.ModelConfigResponse(config=json_format.ParseDict(config, model_config_pb2.ModelConfig(),
                                                                   ignore_unknown_fields=True))

    @answers
    async def ModelStatistics(self, request, context):
        entries = await self.ops.model_stats(request.name or None, parse_version(request.version))
        return json_format.ParseDict({"model_stats": entries}, pb.ModelStatisticsResponse())

    @answers
    async def RepositoryIndex(self, request, context):
        index = await self.ops.repository_index(request.ready)
        return json_format.ParseDict({"models": index}, pb.RepositoryIndexResponse())

    @answers
    async def RepositoryModelLoad(self, request, context):
        # (each parameter's value, whichever of its kinds it has: `config` a string, `file:` ones bytes)
        await self.ops.load(request.model_name, {k: getattr(v, v.WhichOneof("parameter_choice") or "string_param")
                                                 for k, v in request.parameters.items()})
        return pb.RepositoryModelLoadResponse()

    @answers
    async def RepositoryModelUnload(self, request, context):
        await self.ops.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()

    async def _infer(self, request, context, order: tuple | None = None) -> codec.InferAnswer:
        req = codec.decode_request(request)
        outputs, ran = await self.ops.infer(req.name, parse_version(req.version), req.feeds, req.output_names,
                                            _deadline_us(req.timeout_us, context), req.classes, req.sequence,
                                            order, req.priority)
        in_regions = self.ops.write_outputs(outputs, req.output_regions)
        return codec.encode_response(req, ran, outputs, in_regions)

    @answers
    async def ModelInfer(self, request, context):
        return await self._infer(request, context)

    async def ModelStreamInfer(self, request_iterator, context):
        """Every request read is answered as soon as it is done, in whatever order they finish (each reply
        carries its request's id, as Triton's), and reaches the daemon in the order it was read (a sequence's
        requests must); the stream ends once the client closed its side and every request is answered."""
        replies: asyncio.Queue = asyncio.Queue()
        in_flight: set = set()
        loop = asyncio.get_running_loop()

        async def answer(request, order):
            try:
                reply = await self._infer(request, context, order)   # (codec.write_stream_answer writes it)
            except ModelCacheError as e:
                reply = self._stream_error(request, one_line(e))
            except Exception as e:
                log.error("internal error in ModelStreamInfer", exc_info=True)
                reply = self._stream_error(request, f"internal error: {type(e).__name__}")
            finally:
                if not order[1].done():   # (refused before it was sent: the next one may go)
                    order[1].set_result(None)
            replies.put_nowait(reply)

        async def read():
            previous = None   # set once the request read before this one was sent to the daemon
            try:
                async for request in request_iterator:
                    sent = loop.create_future()
                    task = asyncio.create_task(answer(request, (previous, sent)))
                    previous = sent
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
                while in_flight:
                    await asyncio.gather(*list(in_flight))
            finally:
                replies.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            await reader   # (its failure, e.g. a request over the size limit, ends the call with its status)
        finally:
            reader.cancel()
            for task in list(in_flight):
                task.cancel()

    @answers
    async def SystemSharedMemoryStatus(self, request, context):
        """Triton's system shared-memory extension (oip/shared_memory.py): every region, or one (NOT_FOUND)."""
        regions = {r["name"]: pb.SystemSharedMemoryStatusResponse.RegionStatus(**r)
                   for r in self.ops.regions.status(request.name)}
        return pb.SystemSharedMemoryStatusResponse(regions=regions)

    @answers
    async def SystemSharedMemoryRegister(self, request, context):
        self.ops.regions.register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @answers
    async def SystemSharedMemoryUnregister(self, request, context):
        self.ops.regions.unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    @answers
    async def CudaSharedMemoryStatus(self, request, context):
        """None is ever registered (GPU regions are not served): an empty status, as the HTTP front's."""
        if request.name:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"Unable to find cuda shared memory region: "
                                                           f"'{request.name}'")
        return pb.CudaSharedMemoryStatusResponse()

    @answers
    async def CudaSharedMemoryUnregister(self, request, context):
        return pb.CudaSharedMemoryUnregisterResponse()

    @answers
    async def CudaSharedMemoryRegister(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, CUDA_REFUSED)

    @answers
    async def LogSettings(self, request, context):
        """Triton's logging extension: the settings a request names (each a bool, uint32 or string parameter) are
        updated (none: only read), all of them answered."""
        update = {k: getattr(v, v.WhichOneof("parameter_choice")) for k, v in request.settings.items()
                  if v.WhichOneof("parameter_choice")}
        settings = await self.ops.log_settings(update)
        reply = pb.LogSettingsResponse()
        for k, v in settings.items():
            kind = "bool_param" if type(v) is bool else "uint32_param" if type(v) is int else "string_param"
            setattr(reply.settings[k], kind, v)
        return reply

    @staticmethod
    def _stream_error(request, message: str) -> pb.ModelStreamInferResponse:
        return pb.ModelStreamInferResponse(error_message=message, infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id))


async def _unimplemented(self, request, context):
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not supported by modelcache: trace settings are Triton's own")

InferenceService.TraceSetting = _unimplemented


class HealthService:
    """grpc.health.v1: SERVING while the daemon answers, for the server ("") and the inference service."""

    def __init__(self, ops: Operations):
        self.ops = ops

    async def Check(self, request, context):
        if request.service not in ("", SERVICE):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service[:80]!r}; "
                                                           f"this server has {SERVICE!r}")
        ready = await self.ops.ready() is None
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)
