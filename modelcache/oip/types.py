"""The protocol's tensor datatypes and model descriptions as plain dicts: no I/O, no transport.

Datatype names are v2's (FP32, BYTES, ...); Triton's model configuration names them TYPE_FP32 and
TYPE_STRING. Shapes use -1 for a dimension the model leaves free.
"""

from __future__ import annotations

import math
import struct

import numpy as np

from ..errors import InputError
from ..triton_protos.datatypes import V2_BY_NUMPY, numpy_type_of, triton_type  # noqa: F401  (the fronts' names)

NUMPY_BY_V2 = {"BOOL": np.dtype(bool), "UINT8": np.dtype("uint8"), "UINT16": np.dtype("uint16"),
               "UINT32": np.dtype("uint32"), "UINT64": np.dtype("uint64"), "INT8": np.dtype("int8"),
               "INT16": np.dtype("int16"), "INT32": np.dtype("int32"), "INT64": np.dtype("int64"),
               "FP16": np.dtype("float16"), "FP32": np.dtype("float32"), "FP64": np.dtype("float64"),
               "BYTES": np.dtype(object)}
_LENGTH = struct.Struct("<I")


def v2_datatype(numpy_name: str) -> str:
    """A manifest's dtype as a v2 name; ORT's own type string (a sequence, a map) where v2 has none."""
    return V2_BY_NUMPY.get(numpy_name, numpy_name)


_DATATYPE_OF: dict = {}   # numpy dtype -> v2 name: asking numpy for a dtype's name costs ~15 us a tensor


def array_datatype(a: np.ndarray) -> str:
    """The v2 datatype of an output array (strings and bytes are BYTES)."""
    dt = a.dtype
    name = _DATATYPE_OF.get(dt)
    if name is None:
        name = _DATATYPE_OF[dt] = V2_BY_NUMPY.get(dt.name, "BYTES" if dt.kind in "OUS" else dt.name.upper())
    return name


def v2_shape(shape: list) -> list[int]:
    """Fixed dims as they are, symbolic ones (a name or None) as -1."""
    return [d if isinstance(d, int) and d >= 0 else -1 for d in shape]


def tensor_metadata(entries: list[dict]) -> list[dict]:
    return [{"name": e["name"], "datatype": v2_datatype(e["dtype"]), "shape": v2_shape(e["shape"] or [])}
            for e in entries]


def model_config(name: str, inputs: list[dict], outputs: list[dict]) -> dict:
    """Triton's model configuration (its config.pbtxt as JSON) of a model added without one, as tritonclient's
    get_model_config reads it. max_batch_size 0 with dims the model's whole shapes (a free first dim is -1): no
    request is refused for its number of rows, which a max_batch_size would promise; the daemon still batches
    requests. (A model imported from a Triton repository answers with the configuration it was imported with.)"""
    def entry(e: dict) -> dict:
        return {"name": e["name"], "data_type": triton_type(e["dtype"]), "dims": v2_shape(e["shape"] or []),
                "is_shape_tensor": False}

    return {"name": name, "platform": "onnxruntime_onnx", "backend": "onnxruntime",
            "version_policy": {"all": {}}, "max_batch_size": 0,
            "input": [{**entry(e), "format": "FORMAT_NONE", "optional": False} for e in inputs],
            "output": [entry(e) for e in outputs]}


def model_stat(name: str, version: int, served: dict | None) -> dict:
    """One version's entry of Triton's statistics extension from the engine's counters (executor/stats.py;
    None: no request yet). compute_input and compute_output: the daemon's decoding of a request's tensors and
    encoding of its answer (a request a front ran itself converts nothing: 0); batch_stats has each batch size's
    executions and their runs' time, with 0 ns for its compute_input and compute_output (not timed per batch).
    The response cache's hits and misses as Triton counts them (executor/stats.py)."""
    s = served or {}
    ok = s.get("success", 0)
    ran = ok - s.get("cache_hits", 0)   # (as Triton: a request answered from the response cache never computed)

    def stat(count: int, seconds: float) -> dict:
        return {"count": count, "ns": int(seconds * 1e9)}

    return {"name": name, "version": str(version), "last_inference": s.get("last_unix_ms") or 0,
            "inference_count": s.get("samples", 0), "execution_count": s.get("executions", 0),
            "inference_stats": {"success": stat(ok, s.get("success_s", 0.0)),
                                "fail": stat(s.get("failed", 0), s.get("failed_s", 0.0)),
                                "queue": stat(ok, s.get("queue_s", 0.0)),
                                "compute_input": stat(ran, s.get("input_s", 0.0)),
                                "compute_infer": stat(ran, s.get("run_s", 0.0)),
                                "compute_output": stat(ran, s.get("output_s", 0.0)),
                                "cache_hit": stat(s.get("cache_hits", 0), s.get("cache_hit_s", 0.0)),
                                "cache_miss": stat(s.get("cache_misses", 0), s.get("cache_miss_s", 0.0))},
            "batch_stats": [{"batch_size": int(rows), "compute_input": stat(count, 0.0),
                             "compute_infer": stat(count, run_s), "compute_output": stat(count, 0.0)}
                            for rows, (count, run_s) in sorted(s.get("batches", {}).items(),
                                                               key=lambda kv: int(kv[0]))]}


def decode_bytes_elements(raw: memoryview, count: int, name: str) -> np.ndarray:
    """BYTES as raw data (the HTTP binary extension's and gRPC's raw contents): [u32 little-endian length,
    bytes] per element; strings for the daemon (as tensors.encode sends them)."""
    arr = np.empty(count, dtype=object)
    pos = 0
    for k in range(count):
        if pos + 4 > len(raw):
            raise InputError(f"input {name!r}: binary BYTES data ends after {k} of {count} elements")
        (n,) = _LENGTH.unpack_from(raw, pos)
        pos += 4
        if pos + n > len(raw):
            raise InputError(f"input {name!r}: element {k} runs past its binary data")
        arr[k] = bytes(raw[pos:pos + n]).decode("utf-8", "surrogateescape")
        pos += n
    if pos != len(raw):
        raise InputError(f"input {name!r}: {len(raw) - pos} bytes after its {count} BYTES elements")
    return arr


def encode_bytes_elements(a: np.ndarray) -> bytes:
    """An array of strings or bytes as raw BYTES data (see decode_bytes_elements)."""
    return b"".join(_LENGTH.pack(len(b)) + b for b in (_as_bytes(v) for v in a.ravel().tolist()))


def array_of_raw(raw, dtype: np.dtype, shape: list, name: str, where: str) -> np.ndarray:
    """A tensor from its raw data (gRPC's raw contents, a shared-memory region): BYTES as decode_bytes_elements
    reads them, else exactly as many bytes as the shape holds; BOOL bytes 0 or 1 only. `where` names the data
    in the errors."""
    count = math.prod(shape)
    if dtype.kind == "O":
        return decode_bytes_elements(memoryview(raw), count, name).reshape(shape)
    if len(raw) != count * dtype.itemsize:
        raise InputError(f"input {name!r}: {len(raw)} bytes of {where} for {count} {v2_datatype(dtype.name)} elements "
                         f"({count * dtype.itemsize} bytes)")
    arr = np.frombuffer(raw, dtype=dtype)
    if dtype.kind == "b" and count and np.frombuffer(raw, dtype=np.uint8).max() > 1:
        raise InputError(f"input {name!r}: BOOL {where} must be bytes 0 or 1")
    return arr.reshape(shape)


def raw_view(a: np.ndarray):
    """An output's raw data, as the binary extension, gRPC's raw contents and shared memory carry it: a view of the
    array where they are its own memory (not BYTES), so that what is written out from it is not copied first."""
    return encode_bytes_elements(a) if a.dtype.kind in "OUS" else memoryview(np.ascontiguousarray(a)).cast("B")


def _as_bytes(v) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogateescape")
