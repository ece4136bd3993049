"""The v2 tensor codec alone (modelcache/http/codec.py): hand-built bodies, no server."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

pytest.importorskip("httptools")   # the [http] extra; the codec itself needs only numpy
from modelcache.errors import InputError  # noqa: E402
from modelcache.http import codec  # noqa: E402
from modelcache.oip import types  # noqa: E402


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
      "outputs": [{"name": "y", "parameters": {"classification": 0}}]}, b"", "classification 0: ask for a number"),
    ({"inputs": [{"name": "x", "shape": [1], "datatype": "FP32", "data": [1]}],
      "outputs": [{"name": "y", "parameters": {"classification": "3"}}]}, b"", "classification '3'"),
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


def test_large_binary_outputs_are_pieces_viewing_the_arrays_not_a_joined_copy():
    big = np.arange(100_000, dtype=np.float32).reshape(2, -1)[:, ::2]   # (not contiguous: made so once)
    small = np.array([1, 2], np.int64)
    body, n = codec.encode_response("m", 1, None, {"big": big, "small": small}, ["big", "small"], {}, True)
    assert isinstance(body, list) and len(body) == 3 and len(body[0]) == n
    assert all(isinstance(piece, memoryview) for piece in body[1:])   # (views: not copied before they are sent)
    joined = b"".join(body)
    assert np.array_equal(np.frombuffer(joined[n:n + big.nbytes], np.float32).reshape(big.shape), big)
    assert np.array_equal(np.frombuffer(joined[n + big.nbytes:], np.int64), small)
    assert json.loads(body[0])["outputs"][0]["parameters"]["binary_data_size"] == big.nbytes


def test_metadata_names_and_free_dims():
    meta = types.tensor_metadata([{"name": "ids", "dtype": "int64", "shape": ["batch", None, 16]},
                                  {"name": "m", "dtype": "bool", "shape": []}])
    assert meta == [{"name": "ids", "datatype": "INT64", "shape": [-1, -1, 16]},
                    {"name": "m", "datatype": "BOOL", "shape": []}]


def json_input(datatype: str, data: list, shape: list | None = None) -> bytes:
    return json.dumps({"inputs": [{"name": "x", "shape": shape or [len(data)], "datatype": datatype,
                                   "data": data}]}).encode()


@pytest.mark.parametrize("datatype, data, why", [
    ("INT64", [1.7, 2.2, 3.9], "INT64 data must be integers; element 0 is 1.7"),
    ("INT32", [1, 2.5], "INT32 data must be integers; element 1 is 2.5"),
    ("INT8", [1, 128], r"INT8 data must be within \[-128, 127\]; element 1 is 128"),
    ("INT16", [-40000], r"INT16 data must be within \[-32768, 32767\]; element 0 is -40000"),
    ("INT64", [2 ** 63], "element 0 is 9223372036854775808"),
    ("INT64", [True], "INT64 data must be numbers; element 0 is true"),
    ("UINT8", [300], r"UINT8 data must be within \[0, 255\]; element 0 is 300"),
    ("UINT16", [0, -1], r"UINT16 data must be within \[0, 65535\]; element 1 is -1"),
    ("UINT32", [0.5], "UINT32 data must be integers; element 0 is 0.5"),
    ("UINT64", [-1], r"UINT64 data must be within \[0, 18446744073709551615\]; element 0 is -1"),
    ("FP16", [1.0, 70000.0], "FP16 data must be within"),
    ("FP32", [1e39], "FP32 data must be within"),
    ("FP64", [1, None], "FP64 data must be numbers; element 1 is null"),
    ("FP32", [False], "FP32 data must be numbers; element 0 is false"),
    ("BOOL", [True, 1], "BOOL data must be true or false; element 1 is 1"),
    ("BOOL", ["true"], 'BOOL data must be true or false; element 0 is "true"'),
    ("BYTES", ["a", 3], "BYTES data must be strings; element 1 is 3"),
    ("INT64", [[1, 2], [3]], r"3 elements for shape \[2, 2\]"),
])
def test_json_data_that_its_datatype_cannot_hold_is_refused(datatype, data, why):
    """numpy would convert each of these (1.7 -> 1, 300 -> 44 as uint8, -1 -> 2**64-1); the codec refuses them."""
    shape = [2, 2] if isinstance(data[0], list) else None
    with pytest.raises(InputError, match=why) as e:
        codec.decode_request(json_input(datatype, data, shape), None)
    assert str(e.value).startswith("input 'x': ")


@pytest.mark.parametrize("datatype, data, dtype", [
    ("INT64", [1.0, -2, 2 ** 62], np.int64), ("UINT64", [2 ** 64 - 1], np.uint64), ("UINT8", [0, 255], np.uint8),
    ("INT8", [-128, 127], np.int8), ("FP16", [65504.0, -1], np.float16), ("FP32", [1, 2.5], np.float32),
    ("FP64", [float("inf")], np.float64), ("BOOL", [True, False], np.bool_), ("BYTES", ["a", ""], object),
])
def test_json_data_within_its_datatype_decodes_exactly(datatype, data, dtype):
    arr = codec.decode_request(json_input(datatype, data), None).feeds["x"]
    assert arr.dtype == np.dtype(dtype) and arr.tolist() == data


def test_binary_bool_bytes_other_than_0_or_1_are_refused():
    body, n = binary_body({"inputs": [{"name": "m", "shape": [3], "datatype": "BOOL",
                                       "parameters": {"binary_data_size": 3}}]}, bytes([1, 0, 2]))
    with pytest.raises(InputError, match="BOOL binary data must be bytes 0 or 1; element 2 is 2"):
        codec.decode_request(body, n)


def test_model_config_and_stats_entries():
    cfg = types.model_config("m", [{"name": "s", "dtype": "object", "shape": ["n"]},
                                   {"name": "h", "dtype": "float16", "shape": [2, None]}],
                             [{"name": "seq", "dtype": "seq(tensor(float))", "shape": []}])
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [("s", "TYPE_STRING", [-1]),
                                                                              ("h", "TYPE_FP16", [2, -1])]
    assert cfg["output"][0]["data_type"] == "TYPE_INVALID" and cfg["max_batch_size"] == 0
    idle = types.model_stat("m", 3, None)
    assert (idle["version"], idle["last_inference"], idle["inference_stats"]["success"]) == \
        ("3", 0, {"count": 0, "ns": 0})
    used = types.model_stat("m", 3, {"success": 2, "success_s": 0.5, "samples": 5, "queue_s": 0.1, "run_s": 0.3,
                                     "failed": 1, "failed_s": 0.01, "executions": 1, "idle_s": 2.0,
                                     "last_unix_ms": 3000})
    s = used["inference_stats"]
    assert (used["last_inference"], used["inference_count"], used["execution_count"]) == (3000, 5, 1)
    assert s["success"] == {"count": 2, "ns": 500_000_000} and s["fail"] == {"count": 1, "ns": 10_000_000}
    assert s["queue"]["ns"] == 100_000_000 and s["compute_infer"]["ns"] == 300_000_000
