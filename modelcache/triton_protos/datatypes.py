"""Triton's datatype names for the tensors modelcache keeps: v2's (FP32, BYTES, ...), the model configuration's
(TYPE_FP32, TYPE_STRING, ...), and numpy's as manifests carry them (float32, object). Here, beside Triton's
protos, so that the daemon's side (ensembles) and the fronts name types alike."""

from __future__ import annotations

# numpy dtype name (as manifests carry it) <-> v2 datatype name
V2_BY_NUMPY = {"bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
               "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64", "float16": "FP16",
               "float32": "FP32", "float64": "FP64", "object": "BYTES", "str": "BYTES", "bfloat16": "BF16"}


def triton_type(numpy_name: str) -> str:
    """Triton's DataType enum name: TYPE_ and the v2 name, BYTES being TYPE_STRING; TYPE_INVALID where v2
    has none (a sequence or a map)."""
    v2 = V2_BY_NUMPY.get(numpy_name)
    return "TYPE_INVALID" if v2 is None else "TYPE_STRING" if v2 == "BYTES" else f"TYPE_{v2}"


def numpy_type_of(triton_name: str) -> str | None:
    """A Triton DataType enum name (TYPE_FP32, TYPE_STRING) as a manifest's dtype (float32, object); None for one
    ONNX has no tensor of."""
    return _NUMPY_BY_TRITON.get(triton_name)


_NUMPY_BY_TRITON = {triton_type(n): n for n in V2_BY_NUMPY if n != "str"}
