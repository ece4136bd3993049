"""gRPC infer messages <-> numpy: ModelInferRequest's raw or typed contents in, raw_output_contents out. No I/O.

Inputs come either all in `raw_input_contents` (one entry per input, in order: what tritonclient sends) or
each in its typed `contents` (fp32_contents, int64_contents, ...: a hand-written client's choice). Outputs go
back in `raw_output_contents` only: tritonclient's as_numpy reads raw or bytes contents, and typed replies
would reach it as empty arrays. BYTES raw data is a 4-byte little-endian length and the bytes per element.

An infer request is read off the wire by `read_infer_request` (grpc's deserializer for ModelInfer and
ModelStreamInfer): its raw contents stay views of the bytes grpc handed over, and protobuf parses the rest. Parsed
whole, protobuf copied each raw content into its arena and again into a bytes object when it was read: two more
copies of every tensor, in fresh memory a large one page-faults into (`benchmarks/inputs/run.py --fronts grpc`).
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import InputError
from ..oip.classification import class_count
from ..oip.inputs import priority_of, sequence_of
from ..oip.shared_memory import RegionInput, RegionRef
from ..oip.types import NUMPY_BY_V2, array_datatype, array_of_raw, raw_view
from ..triton_protos import grpc_service_pb2 as pb

# v2 datatype -> the InferTensorContents field that carries it typed (FP16 and BF16 only travel raw)
TYPED_FIELD = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
               "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
               "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
               "FP64": "fp64_contents", "BYTES": "bytes_contents"}


RAW_INPUT_CONTENTS = 7   # ModelInferRequest's field number (grpc_service.proto)


class InferMessage:
    """A ModelInferRequest as read off the wire: the message without its raw contents, and those as views of the
    received bytes (None: they are the message's own, if any). Its name, version and id are the message's."""

    __slots__ = ("msg", "raws")

    def __init__(self, msg: pb.ModelInferRequest, raws: list | None = None):
        self.msg, self.raws = msg, raws

    model_name = property(lambda self: self.msg.model_name)
    model_version = property(lambda self: self.msg.model_version)
    id = property(lambda self: self.msg.id)


def read_infer_request(data: bytes) -> InferMessage:
    """grpc's request deserializer for the infer methods: `data`'s top-level fields walked (a varint key each, then
    its value: a few fields, whatever the tensors' size), its raw_input_contents kept as views of `data`, the other
    fields' bytes parsed by protobuf. What does not walk as protobuf is parsed whole, for protobuf's own error."""
    view, raws, kept, pos, n = memoryview(data), [], [], 0, len(data)
    try:
        while pos < n:
            start = pos
            key, pos = _varint(data, pos)
            wire = key & 7
            if wire == 2:
                length, pos = _varint(data, pos)
                end = pos + length
                if end > n:
                    raise ValueError("a field runs past the message")
                if key >> 3 == RAW_INPUT_CONTENTS:
                    raws.append(view[pos:end])
                    pos = end
                    continue
                pos = end
            elif wire == 0:
                pos = _varint(data, pos)[1]
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                raise ValueError(f"wire type {wire}")
            if pos > n:
                raise ValueError("a field runs past the message")
            if kept and kept[-1][1] == start:
                kept[-1][1] = pos
            else:
                kept.append([start, pos])
    except ValueError:
        raws = []
    if not raws:
        return InferMessage(pb.ModelInferRequest.FromString(data))
    return InferMessage(pb.ModelInferRequest.FromString(b"".join(view[a:b] for a, b in kept)), raws)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    """(the varint at data[pos], the position after it)."""
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("a varint runs past the message")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


class InferRequest:
    """A decoded ModelInferRequest: what the shared infer operation takes."""

    __slots__ = ("name", "version", "id", "feeds", "output_names", "timeout_us", "classes", "sequence",
                 "priority", "output_regions")

    def __init__(self, name: str, version: str, request_id: str):
        self.name, self.version, self.id = name, version, request_id
        self.feeds: dict = {}
        self.output_names: list | None = None   # None: every output
        self.timeout_us: int | None = None
        self.classes: dict = {}                 # output -> its top N classes asked for (classification)
        self.sequence = None                    # a stateful model's {id, start, end} (oip/inputs.sequence_of)
        self.priority: int | None = None        # its priority level (executor/queues.py), None: the default
        self.output_regions: dict = {}          # output -> the RegionRef it is to be written to (shared memory)


def decode_request(msg: "pb.ModelInferRequest | InferMessage") -> InferRequest:
    raws = None
    if isinstance(msg, InferMessage):
        msg, raws = msg.msg, msg.raws
    req = InferRequest(msg.model_name, msg.model_version, msg.id)
    if not msg.model_name:
        raise InputError("the request names no model (model_name)")
    params = msg.parameters
    if "timeout" in params:
        p = params["timeout"]
        timeout = getattr(p, p.WhichOneof("parameter_choice") or "int64_param")
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise InputError(f"parameter timeout {timeout!r}: give microseconds, an int64_param >= 0")
        req.timeout_us = timeout or None
    req.sequence = sequence_of(*(_param(params, k) for k in ("sequence_id", "sequence_start", "sequence_end")))
    req.priority = priority_of(_param(params, "priority"))
    if not msg.inputs:
        raise InputError("the request has no inputs")
    raw = raws if raws is not None else msg.raw_input_contents
    refs = [RegionRef.of(_plain(t.parameters), f"input {t.name!r}") if t.parameters else None for t in msg.inputs]
    fed_raw = [t for t, ref in zip(msg.inputs, refs) if ref is None]   # raw contents are theirs, in order
    if raw and len(raw) != len(fed_raw):
        raise InputError(f"raw_input_contents has {len(raw)} entries for {len(fed_raw)} inputs not in shared "
                         "memory: give one per such input, in order, or use each input's contents")
    k = 0
    for tensor, ref in zip(msg.inputs, refs):
        name = tensor.name
        if name in req.feeds:
            raise InputError(f"input {name!r} is given twice")
        if ref is None:
            req.feeds[name] = _decode_input(tensor, raw[k] if raw else None)
            k += 1
            continue
        if tensor.HasField("contents"):
            raise InputError(f"input {name!r} has both a shared_memory_region and data")
        dtype = NUMPY_BY_V2.get(tensor.datatype)
        if dtype is None or any(d < 0 for d in tensor.shape):
            raise InputError(f"input {name!r}: datatype {tensor.datatype!r} and shape {list(tensor.shape)} must "
                             f"be one of {', '.join(NUMPY_BY_V2)} and dims >= 0")
        req.feeds[name] = RegionInput(name, ref, tensor.datatype, dtype, list(tensor.shape))
    if msg.outputs:
        req.output_names = []
        for o in msg.outputs:
            if "classification" in o.parameters:
                p = o.parameters["classification"]
                req.classes[o.name] = class_count(getattr(p, p.WhichOneof("parameter_choice") or "int64_param"),
                                                  o.name)
            ref = RegionRef.of(_plain(o.parameters), f"output {o.name!r}")
            if ref is not None:
                req.output_regions[o.name] = ref
            req.output_names.append(o.name)
    return req


def _param(params, key: str):
    """A request parameter's value, whichever of InferParameter's fields carries it; None when absent."""
    if key not in params:
        return None
    p = params[key]
    choice = p.WhichOneof("parameter_choice")
    return None if choice is None else getattr(p, choice)


def _plain(params) -> dict:
    """A tensor's InferParameter map as plain values."""
    return {k: _param(params, k) for k in params}


def _decode_input(tensor, raw: bytes | None) -> np.ndarray:
    name, datatype, shape = tensor.name, tensor.datatype, list(tensor.shape)
    dtype = NUMPY_BY_V2.get(datatype)
    if dtype is None:
        raise InputError(f"input {name!r}: datatype {datatype!r} is not one of {', '.join(NUMPY_BY_V2)}")
    if any(d < 0 for d in shape):
        raise InputError(f"input {name!r}: shape {shape} has a negative dim")
    count = math.prod(shape)
    if raw is not None:
        if tensor.HasField("contents"):
            raise InputError(f"input {name!r} has both contents and raw_input_contents")
        return array_of_raw(raw, dtype, shape, name, "raw data")
    field = TYPED_FIELD.get(datatype)
    if field is None:
        raise InputError(f"input {name!r}: {datatype} travels only in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InputError(f"input {name!r}: {len(values)} elements in {field} for shape {shape} ({count} elements)")
    if dtype.kind == "O":
        arr = np.empty(count, dtype=object)
        arr[:] = [v.decode("utf-8", "surrogateescape") for v in values]
        return arr.reshape(shape)
    if dtype.kind in "iu":   # int_contents carries INT8 and INT16 as int32: refuse what the type cannot hold
        info = np.iinfo(dtype)
        wide = np.asarray(values, dtype=np.int64 if dtype.kind == "i" else np.uint64)
        bad = np.flatnonzero((wide < info.min) | (wide > info.max))
        if bad.size:
            raise InputError(f"input {name!r}: {datatype} data must be within [{info.min}, {info.max}]; "
                             f"element {int(bad[0])} is {int(wide[bad[0]])}")
    return np.asarray(values, dtype=dtype).reshape(shape)


RAW_OUTPUT_CONTENTS_KEY = b"\x32"   # ModelInferResponse's field 6, length-delimited (grpc_service.proto)
STREAM_INFER_RESPONSE_KEY = b"\x12"   # ModelStreamInferResponse's field 2 (infer_response), length-delimited


class InferAnswer:
    """A ModelInferResponse without its raw output contents (`msg`), and those as views of the output arrays
    (`raws`, in the outputs' order). `write_infer_answer` writes them out with one copy each; protobuf would copy
    each into its message, then into the serialized bytes. A stream's answer is one too (`write_stream_answer`)."""

    __slots__ = ("msg", "raws")

    def __init__(self, msg: pb.ModelInferResponse, raws: list):
        self.msg, self.raws = msg, raws

    def message(self) -> pb.ModelInferResponse:
        """The whole message, raw contents in it."""
        self.msg.raw_output_contents.extend(bytes(r) for r in self.raws)
        self.raws = []
        return self.msg

    def parts(self) -> list:
        """The serialized message in pieces: its fields, then each raw content as field 6 (protobuf reads fields in
        any order, a repeated one's in the order they come)."""
        parts = [self.msg.SerializeToString()]
        for raw in self.raws:
            parts += [RAW_OUTPUT_CONTENTS_KEY, _varint_bytes(len(raw)), raw]
        return parts


def write_infer_answer(answer: "InferAnswer | pb.ModelInferResponse") -> bytes:
    """grpc's response serializer for ModelInfer."""
    if not isinstance(answer, InferAnswer):
        return answer.SerializeToString()
    return b"".join(answer.parts())


def write_stream_answer(answer: "InferAnswer | pb.ModelStreamInferResponse") -> bytes:
    """grpc's response serializer for ModelStreamInfer: an answer is a ModelStreamInferResponse whose only field is
    the ModelInferResponse (an error's is built whole: it has no tensors)."""
    if not isinstance(answer, InferAnswer):
        return answer.SerializeToString()
    parts = answer.parts()
    return b"".join([STREAM_INFER_RESPONSE_KEY, _varint_bytes(sum(len(p) for p in parts)), *parts])


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_response(req: InferRequest, version: int | None, outputs: dict,
                    in_regions=frozenset()) -> InferAnswer:
    """The reply: every output asked for (all when none was), raw; `in_regions`: those already written to shared
    memory, whose raw contents are empty, as Triton's (tritonclient finds an output's raw contents by its
    position among the outputs)."""
    order = req.output_names if req.output_names is not None else list(outputs)
    tensors, raw = [], []
    for name in order:
        a = np.asarray(outputs[name])
        tensors.append(pb.ModelInferResponse.InferOutputTensor(name=name, datatype=array_datatype(a),
                                                               shape=a.shape))
        raw.append(b"" if name in in_regions else raw_view(a))
    return InferAnswer(pb.ModelInferResponse(model_name=req.name, model_version="" if version is None
                                             else str(version), id=req.id, outputs=tensors), raw)
