"""v2 REST bodies <-> numpy: JSON `data` and the binary-tensor extension. No I/O here.

The binary-tensor extension (Triton's, which tritonclient uses by default): the body is a JSON
header of `Inference-Header-Content-Length` bytes, then each input that has a
`binary_data_size` parameter, raw and in the order the header lists them. Outputs asked for
with `binary_data` come back the same way. BYTES elements in binary are each a 4-byte
little-endian length and the bytes, as in gRPC's raw contents (oip/types.py reads and writes them).
"""

from __future__ import annotations

import json
import math

import numpy as np

from ..errors import InputError
from ..oip.classification import class_count
from ..oip.inputs import priority_of, sequence_of
from ..oip.shared_memory import RegionInput, RegionRef
from ..oip.types import NUMPY_BY_V2, array_datatype, decode_bytes_elements, raw_view

class InferRequest:
    """A decoded v2 infer request: feeds, the outputs asked for, and how each is to come back."""

    __slots__ = ("id", "feeds", "output_names", "binary_outputs", "binary_default", "timeout_us", "classes",
                 "sequence", "priority", "output_regions")

    def __init__(self):
        self.id = None
        self.feeds: dict = {}
        self.output_names: list | None = None     # None: every output
        self.binary_outputs: dict = {}            # name -> bool, for outputs named in the request
        self.binary_default = False               # the request-level binary_data_output
        self.timeout_us = None
        self.classes: dict = {}                   # output -> its top N classes asked for (classification)
        self.sequence = None                      # a stateful model's {id, start, end} (oip/inputs.sequence_of)
        self.priority = None                      # its priority level (executor/queues.py), None: the default
        self.output_regions: dict = {}            # output -> the RegionRef it is to be written to (shared memory)


def decode_request(body, header_length: str | None) -> InferRequest:
    """The body of POST .../infer (bytes, or a memoryview of where it was received: its binary tensors are then
    arrays over it), with the Inference-Header-Content-Length header's value (or None)."""
    if header_length is not None:
        try:
            n = int(header_length)
        except ValueError:
            raise InputError(f"Inference-Header-Content-Length {header_length[:40]!r} is not a number") from None
        if not 0 <= n <= len(body):
            raise InputError(f"Inference-Header-Content-Length {n} does not fit a body of {len(body)} bytes")
        head, binary = bytes(body[:n]), memoryview(body)[n:]   # (body: bytes, or a received body's memoryview)
    else:
        head, binary = bytes(body), memoryview(b"")
    try:
        doc = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InputError("the request body must be a JSON object")
    req = InferRequest()
    req.id = doc.get("id")
    params = _parameters(doc, "request")
    req.binary_default = bool(params.get("binary_data_output", False))
    timeout = params.get("timeout")
    if timeout is not None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout < 0:
            raise InputError(f"parameter timeout {timeout!r}: give microseconds, a number >= 0")
        req.timeout_us = timeout
    req.sequence = sequence_of(params.get("sequence_id"), params.get("sequence_start"), params.get("sequence_end"))
    req.priority = priority_of(params.get("priority"))
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise InputError("the request needs \"inputs\": a list of tensors")
    offset = 0
    for entry in inputs:
        name, array, used = _decode_input(entry, binary, offset)
        if name in req.feeds:
            raise InputError(f"input {name!r} is given twice")
        req.feeds[name] = array
        offset += used
    if offset != len(binary):
        raise InputError(f"the body has {len(binary) - offset} bytes after the tensors its header describes")
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise InputError("\"outputs\" must be a list")
        req.output_names = []
        for o in outputs:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InputError("each requested output needs a \"name\"")
            oparams = _parameters(o, f"output {o['name']!r}")
            if "classification" in oparams:
                req.classes[o["name"]] = class_count(oparams["classification"], o["name"])
            ref = RegionRef.of(oparams, f"output {o['name']!r}")
            if ref is not None:
                req.output_regions[o["name"]] = ref
            req.output_names.append(o["name"])
            req.binary_outputs[o["name"]] = bool(oparams.get("binary_data", req.binary_default))
    return req


def _parameters(obj: dict, what: str) -> dict:
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise InputError(f"{what} parameters must be a JSON object")
    return params


def _decode_input(entry, binary: memoryview, offset: int) -> tuple[str, np.ndarray | RegionInput, int]:
    """(name, array or where in shared memory it is, binary bytes it used) of one input."""
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
        raise InputError("each input needs a \"name\"")
    name = entry["name"]
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        raise InputError(f"input {name!r}: \"shape\" must be a list of dims >= 0")
    datatype = entry.get("datatype")
    dtype = NUMPY_BY_V2.get(datatype) if isinstance(datatype, str) else None
    if dtype is None:
        raise InputError(f"input {name!r}: datatype {datatype!r} is not one of {', '.join(NUMPY_BY_V2)}")
    count = math.prod(shape)
    params = _parameters(entry, f"input {name!r}")
    ref = RegionRef.of(params, f"input {name!r}")
    if ref is not None:
        if "data" in entry or "binary_data_size" in params:
            raise InputError(f"input {name!r} has both a shared_memory_region and data")
        return name, RegionInput(name, ref, datatype, dtype, shape), 0
    size = params.get("binary_data_size")
    if size is not None:
        if "data" in entry:
            raise InputError(f"input {name!r} has both \"data\" and binary_data_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or offset + size > len(binary):
            raise InputError(f"input {name!r}: binary_data_size {size!r} runs past the body's "
                             f"{len(binary) - offset} remaining bytes")
        raw = binary[offset:offset + size]
        if dtype.kind == "O":
            return name, decode_bytes_elements(raw, count, name).reshape(shape), size
        if size != count * dtype.itemsize:
            raise InputError(f"input {name!r}: {size} bytes for {count} {datatype} elements "
                             f"({count * dtype.itemsize} bytes)")
        arr = np.frombuffer(raw, dtype=dtype)
        if dtype.kind == "b":   # a bool byte other than 0 or 1 is no value numpy or ORT defines
            as_bytes = np.frombuffer(raw, dtype=np.uint8)
            _first(name, datatype, as_bytes, as_bytes > 1, "binary data must be bytes 0 or 1")
        return name, arr.reshape(shape), size
    data = entry.get("data")
    if not isinstance(data, list):
        raise InputError(f"input {name!r} needs \"data\" (a list) or a binary_data_size parameter")
    flat = _flatten(data) if list in set(map(type, data)) else data
    if len(flat) != count:
        raise InputError(f"input {name!r}: {len(flat)} elements for shape {shape} ({count} elements)")
    return name, _json_array(name, datatype, dtype, flat).reshape(shape), 0


def _json_array(name: str, datatype: str, dtype: np.dtype, flat: list) -> np.ndarray:
    """A JSON `data` list as `dtype`, refusing what the datatype cannot hold exactly rather than converting it
    (numpy would truncate 1.7 to an INT64 1 and wrap 300 to a UINT8 44): the error names the first bad value."""
    kinds = set(map(type, flat))
    if dtype.kind == "O":
        _only(name, datatype, flat, kinds, (str,), "strings")
        arr = np.empty(len(flat), dtype=object)
        arr[:] = flat
        return arr
    if dtype.kind == "b":
        _only(name, datatype, flat, kinds, (bool,), "true or false")
        return np.array(flat, dtype=dtype)
    _only(name, datatype, flat, kinds, (int, float), "numbers")   # (bool is not an int here: its own type)
    if dtype.kind in "iu":
        if float in kinds:
            f = np.asarray(flat, dtype=np.float64)
            _first(name, datatype, flat, ~(np.isfinite(f) & (f == np.trunc(f))), "data must be integers")
        info = np.iinfo(dtype)
        if flat and (min(flat) < info.min or max(flat) > info.max):
            _first(name, datatype, flat, [not info.min <= v <= info.max for v in flat],
                   f"data must be within [{info.min}, {info.max}]")
        return np.array(flat, dtype=dtype)
    try:
        wide = np.asarray(flat, dtype=np.float64)
    except OverflowError:   # an integer past float64's range
        _first(name, datatype, flat, [isinstance(v, int) and abs(v) > 2 ** 1023 for v in flat], "data is out of range")
    with np.errstate(over="ignore"):
        arr = wide.astype(dtype)
    _first(name, datatype, flat, np.isinf(arr) & ~np.isinf(wide), f"data must be within +-{np.finfo(dtype).max}")
    return arr


def _only(name: str, datatype: str, flat: list, kinds: set, allowed: tuple, what: str) -> None:
    if not kinds.issubset(allowed):
        _first(name, datatype, flat, [type(v) not in allowed for v in flat], f"data must be {what}")


def _first(name: str, datatype: str, values, bad, why: str) -> None:
    """InputError naming the first of `values` that `bad` (a mask: a list or an array) marks, if any."""
    if isinstance(bad, np.ndarray):
        marked = np.flatnonzero(bad)
        k = int(marked[0]) if marked.size else None
    else:
        k = next((i for i, b in enumerate(bad) if b), None)
    if k is None:
        return
    v = values[k].item() if isinstance(values, np.ndarray) else values[k]
    shown = json.dumps(v) if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__
    raise InputError(f"input {name!r}: {datatype} {why}; element {k} is {shown[:40]}")


def _flatten(data: list) -> list:
    """Row-major flattening of nested lists (v2 allows `data` either flat or nested)."""
    out, stack = [], [iter(data)]
    while stack:
        for v in stack[-1]:
            if isinstance(v, list):
                if len(stack) > 32:
                    raise InputError("\"data\" nests deeper than 32")
                stack.append(iter(v))
                break
            out.append(v)
        else:
            stack.pop()
    return out


JOIN_MAX_BYTES = 64 << 10   # a body of binary outputs this small is joined into one bytes; a larger one is not


def encode_response(model: str, version: int | None, request_id, outputs: dict, order: list,
                    binary: dict, binary_default: bool, in_regions=frozenset()) -> tuple[bytes | list, int | None]:
    """(body, JSON header length or None when no output is binary). `order` lists the outputs to send;
    `in_regions`: those already written to shared memory, given by datatype and shape alone (as Triton gives
    them: perf_analyzer reads an output's parameters as a binary one's). A body with binary outputs over
    JOIN_MAX_BYTES is a list of its pieces (the header, then views of the outputs), written out one after the
    other (http1.encode): joining them copied every output once more."""
    entries, blobs = [], []
    for name in order:
        value = outputs[name]
        a = np.asarray(value)
        entry = {"name": name, "datatype": array_datatype(a), "shape": list(a.shape)}
        entries.append(entry)
        if name in in_regions:
            continue
        if binary.get(name, binary_default):
            raw = raw_view(a)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        elif a.dtype.kind in "OUS":
            entry["data"] = [_as_str(v) for v in a.ravel().tolist()]
        else:
            entry["data"] = a.ravel().tolist()
    doc = {"model_name": model, "outputs": entries}
    if version is not None:   # the version that ran
        doc["model_version"] = str(version)
    if request_id is not None:
        doc["id"] = request_id
    head = json.dumps(doc, separators=(",", ":"), allow_nan=True).encode()
    if not blobs:
        return head, None
    if sum(map(len, blobs)) > JOIN_MAX_BYTES:
        return [head, *blobs], len(head)
    return b"".join([head, *blobs]), len(head)


def _as_str(v) -> str:
    return v.decode("utf-8", "surrogateescape") if isinstance(v, bytes) else str(v)
