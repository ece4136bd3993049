"""modelcache.client.device: device exports mapped as ORT initializers with no copy (real ORT, real shared memory)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import uuid as uuidlib
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelcache.client.device import attach_weights, cuda_device_id, fake_gpu_count, handle_cache, requested_device
from modelcache.cuda import DeviceError, cuda_runtime, normalize_uuid
from modelcache.errors import ModelCacheError, ProtocolError
from modelcache.session_options import attach_session_options

ROOT = Path(__file__).resolve().parents[1]
ALIGN = 256


# -- helpers --------------------------------------------------------------------------------------------

def pack(arrays: dict) -> tuple[bytes, list]:
    """Arrays laid out at 256-byte-aligned offsets, as the daemon packs a device arena; (bytes, tensor rows)."""
    blob, rows = bytearray(), []
    for name, a in arrays.items():
        blob += b"\0" * (-len(blob) % ALIGN)
        rows.append([name, a.dtype.name, list(a.shape), 0, len(blob), a.nbytes])
        blob += a.tobytes()
    blob += b"\0" * (-len(blob) % ALIGN or ALIGN)  # never an empty file
    return bytes(blob), rows


@pytest.fixture
def shm_file():
    """shm_file(data) -> path of a new /dev/shm file holding `data` (a fake device allocation); removed after."""
    made = []

    def make(data: bytes) -> str:
        path = f"/dev/shm/modelcache-test-device.{os.getpid()}.{uuidlib.uuid4().hex}"
        with open(path, "wb") as f:
            f.write(data)
        made.append(path)
        return path

    yield make
    for p in made:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def mappings_of(path: str) -> list[int]:
    """Start addresses of this process's mappings of `path` (from /proc/self/maps)."""
    starts = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].strip() == path:
                starts.append(int(parts[0].split("-")[0], 16))
    return starts


def weights_for_model(rng) -> dict:
    return {"W": rng.standard_normal((4, 3)).astype(np.float32),
            "B": rng.standard_normal(3).astype(np.float32),
            "W16": rng.standard_normal((4, 3)).astype(np.float16)}


def model_bytes() -> bytes:
    """Y = reshape((X @ W + B) + float(half(X) @ W16), [3, 2]): the weights are zero stubs for attach to
    override (add_initializer replaces only declared initializers); the int64 shape stays inline."""
    stubs = [numpy_helper.from_array(np.zeros((4, 3), np.float32), "W"),
             numpy_helper.from_array(np.zeros(3, np.float32), "B"),
             numpy_helper.from_array(np.zeros((4, 3), np.float16), "W16"),
             numpy_helper.from_array(np.array([3, 2], np.int64), "shape")]
    nodes = [helper.make_node("MatMul", ["X", "W"], ["xw"]),
             helper.make_node("Add", ["xw", "B"], ["y1"]),
             helper.make_node("Cast", ["X"], ["x16"], to=TensorProto.FLOAT16),
             helper.make_node("MatMul", ["x16", "W16"], ["y2h"]),
             helper.make_node("Cast", ["y2h"], ["y2"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["y1", "y2"], ["y"]),
             helper.make_node("Reshape", ["y", "shape"], ["Y"])]
    graph = helper.make_graph(nodes, "attach", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 2])], stubs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def expected(x, w) -> np.ndarray:
    y2 = (x.astype(np.float16).astype(np.float32) @ w["W16"].astype(np.float32))
    return ((x @ w["W"] + w["B"]) + y2).reshape(3, 2)


# -- the fake device, end to end ---------------------------------------------------------------------------

def test_fake_device_session_runs_on_mapped_weights_without_a_copy(shm_file):
    rng = np.random.default_rng(0)
    w = weights_for_model(rng)
    blob, rows = pack(w)
    path = shm_file(blob)
    x = rng.standard_normal((2, 4)).astype(np.float32)

    so = attach_session_options()
    weights = attach_weights(so, "fake", "fake-1", [path.encode()], rows)
    try:
        assert weights.device_index == 1
        assert weights.provider_options == "CPUExecutionProvider"
        [base] = mappings_of(path)
        for name, _, _, _, offset, _ in rows:
            assert weights.values[name].data_ptr() == base + offset  # no copy
        sess = ort.InferenceSession(model_bytes(), so, providers=[weights.provider_options])
        np.testing.assert_allclose(sess.run(None, {"X": x})[0], expected(x, w), rtol=1e-2, atol=1e-2)

        # The daemon writing its allocation changes the running session's result at once: ORT reads the mapping.
        b_offset = next(r[4] for r in rows if r[0] == "B")
        with open(path, "r+b") as f:
            f.seek(b_offset)
            f.write((w["B"] + 100).astype(np.float32).tobytes())
        np.testing.assert_allclose(sess.run(None, {"X": x})[0], expected(x, {**w, "B": w["B"] + 100}),
                                   rtol=1e-2, atol=1e-2)
        del sess
    finally:
        weights.release()
    assert mappings_of(path) == []


def test_handle_cache_opens_once_and_unmaps_after_the_last_release(shm_file):
    w = weights_for_model(np.random.default_rng(1))
    blob, rows = pack(w)
    path = shm_file(blob)
    handle = path.encode()
    cache = handle_cache()

    first = attach_weights(attach_session_options(), "fake", "fake-0", [handle], rows)
    second = attach_weights(attach_session_options(), "fake", "fake-0", [handle], rows)
    try:
        assert cache.refs("fake", handle) == 2
        assert len(mappings_of(path)) == 1  # one mapping for both
        assert first.values["W"].data_ptr() == second.values["W"].data_ptr()
        first.release()
        first.release()  # idempotent
        assert cache.refs("fake", handle) == 1
        assert len(mappings_of(path)) == 1
        np.testing.assert_array_equal(second.values["W"].numpy(), w["W"])  # still readable
    finally:
        first.release()
        second.release()
    assert cache.refs("fake", handle) == 0
    assert mappings_of(path) == []


def test_handles_are_released_when_attach_fails(shm_file):
    blob, rows = pack({"A": np.ones(4, np.float32)})
    path = shm_file(blob)
    good_path = shm_file(blob)
    bad = rows + [["C", "float32", [1 << 20], 0, 0, 4 << 20]]  # lies beyond the allocation
    with pytest.raises(ProtocolError, match="beyond"):
        attach_weights(attach_session_options(), "fake", "fake-0", [path.encode(), good_path.encode()], bad)
    assert handle_cache().refs("fake", path.encode()) == 0
    assert handle_cache().refs("fake", good_path.encode()) == 0
    assert mappings_of(path) == []


@pytest.mark.parametrize("row, match", [
    (["A", "complex64", [2], 0, 0, 16], "dtype"),
    (["A", "float32", [3], 0, 0, 16], "not 16 bytes"),
    (["A", "float32", [4], 1, 0, 16], "handle index"),
    (["A", "float32", [4], 0, 2, 16], "aligned"),
    (["A", "float32"], "malformed"),
])
def test_malformed_tensor_rows_are_rejected_before_anything_is_opened(shm_file, row, match):
    path = shm_file(b"\0" * ALIGN)
    with pytest.raises(ProtocolError, match=match):
        attach_weights(attach_session_options(), "fake", "fake-0", [path.encode()], [row])
    assert mappings_of(path) == []


def test_unknown_kind_and_bad_fake_uuid_are_clear_errors():
    with pytest.raises(ProtocolError, match="kind"):
        attach_weights(attach_session_options(), "rocm", "x", [], [])
    with pytest.raises(DeviceError, match="fake-<index>"):
        attach_weights(attach_session_options(), "fake", "gpu-0", [], [])


# -- DLPack dtypes ------------------------------------------------------------------------------------------

def _sample(dtype: str, shape) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "bool":
        return (np.arange(n) % 3 == 0).reshape(shape)
    if dtype == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return (np.arange(n, dtype=np.float32) - 2.5).astype(ml_dtypes.bfloat16).reshape(shape)
    info = np.iinfo(dtype) if np.dtype(dtype).kind in "iu" else None
    a = (np.arange(n) - (n // 2 if info is None or info.min < 0 else 0)).astype(dtype)
    if info is not None and n:
        a[-1] = info.max  # the top of the range survives too
    return a.reshape(shape)


ORT_TYPES = {"float16": "float16", "float32": "float", "float64": "double", "bfloat16": "bfloat16",
             "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64", "uint8": "uint8",
             "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "bool": "bool"}


def _bfloat16_as_float32(value) -> np.ndarray:
    """OrtValue.numpy() has no bfloat16: let ORT itself read the value, through a Cast to float32."""
    graph = helper.make_graph([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT)], "bf16",
                              [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run_with_ort_values(["y"], {"x": value})[0].numpy()


@pytest.mark.parametrize("dtype", list(ORT_TYPES))
def test_each_dtype_round_trips_through_dlpack(shm_file, dtype):
    arrays = {"m": _sample(dtype, (3, 5)), "s": _sample(dtype, ()), "e": _sample(dtype, (0, 4))}
    blob, rows = pack(arrays)
    path = shm_file(blob)
    weights = attach_weights(ort.SessionOptions(), "fake", "fake-0", [path.encode()], rows)
    try:
        [base] = mappings_of(path)
        for name, _, shape, _, offset, _ in rows:
            value = weights.values[name]
            assert value.data_type() == f"tensor({ORT_TYPES[dtype]})"
            assert value.shape() == shape
            if arrays[name].size:
                assert value.data_ptr() == base + offset
            got = value.numpy() if dtype != "bfloat16" else _bfloat16_as_float32(value)
            want = arrays[name] if dtype != "bfloat16" else arrays[name].astype(np.float32)
            assert got.shape == want.shape
            assert got.tobytes() == want.tobytes()
    finally:
        weights.release()


# -- which device to ask the daemon for ----------------------------------------------------------------------

@pytest.mark.parametrize("providers, device_id", [
    (None, None),
    ([], None),
    (["CPUExecutionProvider"], None),
    (["CUDAExecutionProvider", "CPUExecutionProvider"], 0),
    ([("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"], 1),
    ([("CUDAExecutionProvider", {"device_id": "2", "arena_extend_strategy": "kSameAsRequested"})], 2),
    ([("CUDAExecutionProvider", {})], 0),
    ([("CPUExecutionProvider", {"device_id": 3}), ("CUDAExecutionProvider", {"device_id": 1})], 1),
])
def test_cuda_device_id_from_providers(providers, device_id):
    assert cuda_device_id(providers) == device_id


@pytest.mark.parametrize("bad", [-1, "one", None])
def test_a_bad_cuda_device_id_is_a_clear_error(bad):
    with pytest.raises(DeviceError, match="device_id"):
        cuda_device_id([("CUDAExecutionProvider", {"device_id": bad})])


def test_requested_device_with_fake_gpus(monkeypatch):
    monkeypatch.setenv("MODELCACHE_FAKE_GPUS", "2x256M")
    assert requested_device(["CUDAExecutionProvider"]) == "cuda:fake-0"
    assert requested_device([("CUDAExecutionProvider", {"device_id": 1})]) == "cuda:fake-1"
    assert requested_device(["CPUExecutionProvider"]) is None
    with pytest.raises(DeviceError, match="declares 2"):
        requested_device([("CUDAExecutionProvider", {"device_id": 2})])


def test_requested_device_without_cuda_is_none_and_touches_nothing(monkeypatch):
    monkeypatch.delenv("MODELCACHE_FAKE_GPUS", raising=False)
    assert requested_device(["CPUExecutionProvider"]) is None
    assert requested_device(None) is None


@pytest.mark.parametrize("spec, count", [("2x256M", 2), ("1", 1), (" 4X1G", 4), ("1G", 1)])  # as the daemon reads it
def test_fake_gpu_count(spec, count):
    assert fake_gpu_count(spec) == count


def test_fake_gpu_count_rejects_garbage():
    with pytest.raises(DeviceError, match="MODELCACHE_FAKE_GPUS"):
        fake_gpu_count("lots")


def test_uuid_normalization():
    hexform = "5a1f0c2e9b7d4e3f8a6b1c2d3e4f5061"
    assert normalize_uuid("GPU-5a1f0c2e-9b7d-4e3f-8a6b-1c2d3e4f5061") == hexform
    assert normalize_uuid("GPU-5A1F0C2E-9B7D-4E3F-8A6B-1C2D3E4F5061") == hexform
    assert normalize_uuid(hexform) == hexform
    assert normalize_uuid("MIG-5a1f0c2e-9b7d-4e3f-8a6b-1c2d3e4f5061") == hexform
    assert normalize_uuid(bytes.fromhex(hexform).hex()) == hexform  # what the daemon sends (cupy's 16 bytes)
    for bad in ("GPU-1234", "fake-0", "", "zz" * 16):
        with pytest.raises(DeviceError, match="UUID"):
            normalize_uuid(bad)


# -- CUDA runtime without a GPU -----------------------------------------------------------------------------

def _run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def test_import_loads_neither_numpy_nor_onnxruntime_nor_cupy():
    r = _run_python("""
        import sys
        import modelcache.client.device
        import modelcache.cuda
        print([m for m in ("numpy", "onnxruntime", "cupy") if m in sys.modules])
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_missing_cuda_runtime_is_a_clear_error():
    # A fresh process, so that no libcudart is mapped yet; names the loader cannot find.
    r = _run_python("""
        from modelcache.cuda import CudaRuntime, DeviceError
        try:
            CudaRuntime(names=("libcudart.so.0-not-here",))
        except DeviceError as e:
            print("DeviceError:", e)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("DeviceError:")
    assert "libcudart" in r.stdout and "onnxruntime-gpu" in r.stdout and "[gpu]" in r.stdout


def _cudart_loadable() -> bool:
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


@pytest.mark.skipif(not _cudart_loadable(), reason="no libcudart here")
def test_the_cuda_runtime_already_loaded_is_the_one_used():
    # As after onnxruntime.preload_dlls(): a libcudart is mapped, so no name has to be found by the loader.
    r = _run_python("""
        import ctypes
        for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
            try:
                ctypes.CDLL(name)
                break
            except OSError:
                pass
        from modelcache.cuda import CudaRuntime
        CudaRuntime(names=("libcudart.so.0-not-here",))
        print("ok")
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


@pytest.mark.skipif(_cudart_loadable(), reason="a libcudart is loadable here; the error path is tested above")
def test_cuda_runtime_without_libcudart_raises_device_error():
    with pytest.raises(DeviceError, match="onnxruntime-gpu") as info:
        cuda_runtime()
    assert isinstance(info.value, ModelCacheError) and info.value.code == "device"


def test_cuda_runtime_checks_every_call():
    """Where a libcudart loads but no GPU works, the failing call and CUDA's own words are in the error."""
    try:
        runtime = cuda_runtime()
    except DeviceError:
        pytest.skip("no libcudart here")
    try:
        count = runtime.device_count()
    except DeviceError as e:
        assert "cudaGetDeviceCount" in str(e)
        return
    assert count >= 0
    with pytest.raises(DeviceError, match="CUDA_VISIBLE_DEVICES"):
        runtime.uuid_of(count)
    with pytest.raises(DeviceError, match="not visible"):
        runtime.index_of("GPU-00000000-0000-0000-0000-000000000000")


# -- a real GPU ---------------------------------------------------------------------------------------------

EXPORTER = """
import json, sys
import numpy as np
import cupy
from cupy.cuda import runtime

arrays = {name: np.load(path) for name, path in json.loads(sys.argv[1]).items()}
total = sum(-(-a.nbytes // 256) * 256 for a in arrays.values())
base = runtime.malloc(total)
rows, offset = [], 0
for name, a in arrays.items():
    a = np.ascontiguousarray(a)
    runtime.memcpy(base + offset, a.ctypes.data, a.nbytes, runtime.memcpyHostToDevice)
    rows.append([name, a.dtype.name, list(a.shape), 0, offset, a.nbytes])
    offset += -(-a.nbytes // 256) * 256
runtime.deviceSynchronize()
from modelcache.tiers.gpu import _runtime_uuid   # all 16 bytes: cupy's props["uuid"] stops at a zero byte
print(json.dumps({"uuid": _runtime_uuid(runtime.getDevice()), "handle": bytes(runtime.ipcGetMemHandle(base)).hex(),
                  "tensors": rows}), flush=True)
sys.stdin.readline()  # the importer maps the allocation while this process lives
runtime.free(base)
"""


def _gpu_ready() -> str | None:
    try:
        if cuda_runtime().device_count() == 0:
            return "no CUDA device"
    except DeviceError as e:
        return f"no usable CUDA runtime: {e}"
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return "onnxruntime has no CUDAExecutionProvider"
    return None


@pytest.mark.gpu
@pytest.mark.cuda_ep
def test_cuda_ipc_export_from_another_process_runs_on_the_gpu(tmp_path):
    why = _gpu_ready()
    if why:
        pytest.skip(why)
    rng = np.random.default_rng(2)
    w = weights_for_model(rng)
    files = {}
    for name, a in w.items():
        files[name] = str(tmp_path / f"{name}.npy")
        np.save(files[name], a)
    exporter = subprocess.Popen([sys.executable, "-c", EXPORTER, json.dumps(files)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = exporter.stdout.readline()
        if not line:
            err = exporter.stderr.read()
            if "No module named 'cupy'" in err:
                pytest.skip("cupy is not installed (the exporter needs it)")
            raise AssertionError(f"exporter failed:\n{err}")
        export = json.loads(line)
        handle = bytes.fromhex(export["handle"])
        x = rng.standard_normal((2, 4)).astype(np.float32)

        so = attach_session_options()
        weights = attach_weights(so, "cuda", export["uuid"], [handle], export["tensors"])
        second = attach_weights(attach_session_options(), "cuda", export["uuid"], [handle], export["tensors"])
        try:
            assert handle_cache().refs("cuda", handle) == 2  # opened once for both
            index = cuda_runtime().index_of(export["uuid"])
            assert weights.provider_options == ("CUDAExecutionProvider", {"device_id": index})
            base = handle_cache().acquire("cuda", handle, index)  # already open: hands back the same base
            handle_cache().release("cuda", handle)
            for name, _, _, _, offset, _ in export["tensors"]:
                assert weights.values[name].data_ptr() == base + offset
                assert weights.values[name].device_name().lower() == "cuda"
            assert "cupy" not in sys.modules  # the client side needs none

            sess = ort.InferenceSession(model_bytes(), so, providers=[weights.provider_options])
            assert sess.get_providers()[0] == "CUDAExecutionProvider"
            np.testing.assert_allclose(sess.run(None, {"X": x})[0], expected(x, w), rtol=1e-2, atol=1e-2)
            del sess
        finally:
            second.release()
            assert handle_cache().refs("cuda", handle) == 1
            weights.release()
        assert handle_cache().refs("cuda", handle) == 0
    finally:
        exporter.stdin.close()
        exporter.wait(30)


def test_the_cuda_provider_goes_first_over_device_weights():
    """CPU kernels must never get nodes whose weights live on the device: CUDA first, its options kept."""
    from modelcache.client.device import cuda_first
    cuda = ("CUDAExecutionProvider", {"device_id": 1, "cudnn_conv_algo_search": "DEFAULT"})
    assert cuda_first(["CPUExecutionProvider", cuda]) == [cuda, "CPUExecutionProvider"]
    assert cuda_first([cuda, "CPUExecutionProvider"]) == [cuda, "CPUExecutionProvider"]
    assert cuda_first(["A", "CUDAExecutionProvider", "B"]) == ["CUDAExecutionProvider", "A", "B"]
    assert cuda_first(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]


def test_the_daemons_device_uuid_is_read_whole_not_cut_at_a_zero_byte():
    from modelcache.tiers.gpu import device_uuid
    whole = "ab00cd" + "11" * 13

    def fails(index):
        raise RuntimeError("no libcudart here")

    assert device_uuid(0, bytes.fromhex("ab"), lambda i: whole) == whole          # cupy's cut value ignored
    assert device_uuid(0, bytes.fromhex(whole), fails) == whole                   # cupy's, when whole
    assert device_uuid(0, bytes.fromhex("ab"), fails) is None                     # neither: no tier, no wrong name
