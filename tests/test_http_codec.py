"""The v2 tensor codec alone (modelcache/http/codec.py): hand-built bodies, no server."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

pytest.importorskip("aiohttp")   # the [http] extra; the codec itself needs only numpy
from modelcache.errors import InputError  # noqa: E402
from modelcache.http import codec  # noqa: E402


def binary_body(header: dict, *blobs: bytes) -> tuple[bytes, str]:
    head = json.dumps(header).encode()
    return head + b"".join(blobs), str(len(head))


def test_json_nested_and_flat_data_decode_alike():
    flat = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]}]}
    nested = {"inputs": [{"name": "x", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]}]}
    a = codec.decode_request(json.dumps(flat).encode(), None).feeds["x"]
    b = codec.decode_request(json.dumps(nested).encode(), None).feeds["x"]
    assert a.dtype == np.int64 and np.array_equal(a, b) and a.shape == (2, 2)


def test_binary_inputs_in_header_order_with_bytes_and_fp16():
    h = np.arange(6, dtype=np.float16).reshape(2, 3)
    words = [b"ab", "\u00e9".encode()]
    raw = b"".join(struct.pack("<I", len(w)) + w for w in words)
    body, n = binary_body({"id": "r1", "parameters": {"binary_data_output": True, "timeout": 5000},
                           "inputs": [{"name": "h", "shape": [2, 3], "datatype": "FP16",
                                       "parameters": {"binary_data_size": h.nbytes}},
                                      {"name": "s", "shape": [2], "datatype": "BYTES",
                                       "parameters": {"binary_data_size": len(raw)}}]}, h.tobytes(), raw)
    req = codec.decode_request(body, n)
    assert np.array_equal(req.feeds["h"], h) and list(req.feeds["s"]) == ["ab", "\u00e9"]
    assert req.id == "r1" and req.binary_default and req.timeout_us == 5000 and req.output_names is None


@pytest.mark.parametrize("header, extra, why", [
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": [1.0]}]}, b"", "elements"),
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32", "data": ["a", "b"]}]}, b"", "numbers"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "BOOL", "data": [1]}]}, b"", "true or false"),
    ({"inputs": [{"name": "x", "shape": [-1], "datatype": "FP32", "data": []}]}, b"", "dims"),
    ({"inputs": [{"name": "x", "shape": [2], "datatype": "FP32",
                  "parameters": {"binary_data_size": 8}}]}, b"\0" * 4, "runs past"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32",
                  "parameters": {"binary_data_size": 4}}]}, b"\0" * 8, "after the tensors"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]},
                 {"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}]}, b"", "twice"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
      "outputs": [{"name": "y", "parameters": {"classification": 3}}]}, b"", "classification"),
])
def test_malformed_requests_say_what_is_wrong(header, extra, why):
    body, n = binary_body(header, extra)
    with pytest.raises(InputError, match=why):
        codec.decode_request(body, n)


def test_response_mixes_json_and_binary_outputs():
    outputs = {"a": np.array([[1.5, 2.5]], np.float32), "b": np.array([7, 8, 9], np.int64),
               "s": np.array(["x", "yz"], dtype=object)}
    body, n = codec.encode_response("m", 2, "id9", outputs, ["a", "b", "s"], {"a": True, "s": True}, False)
    doc = json.loads(body[:n])
    assert doc["model_version"] == "2" and doc["id"] == "id9"
    a, b, s = doc["outputs"]
    assert (a["datatype"], a["parameters"]["binary_data_size"]) == ("FP32", 8) and b["data"] == [7, 8, 9]
    assert np.array_equal(np.frombuffer(body[n:n + 8], np.float32), [1.5, 2.5])
    assert body[n + 8:] == struct.pack("<I", 1) + b"x" + struct.pack("<I", 2) + b"yz"
    plain, none = codec.encode_response("m", None, None, outputs, ["b"], {}, False)
    assert none is None and json.loads(plain) == {"model_name": "m", "outputs": [
        {"name": "b", "datatype": "INT64", "shape": [3], "data": [7, 8, 9]}]}


def test_metadata_names_and_free_dims():
    meta = codec.tensor_metadata([{"name": "ids", "dtype": "int64", "shape": ["batch", None, 16]},
                                  {"name": "m", "dtype": "bool", "shape": []}])
    assert meta == [{"name": "ids", "datatype": "INT64", "shape": [-1, -1, 16]},
                    {"name": "m", "datatype": "BOOL", "shape": []}]
