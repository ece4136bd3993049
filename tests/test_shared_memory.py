"""Triton's system shared-memory extension on both fronts (oip/shared_memory.py), driven by tritonclient's own
shared-memory utilities against a daemon that allows it (client_shared_memory) and imported Triton's QA `simple` model (INT32 add and subtract): the
tensors stay in /dev/shm objects the client made, the request names them. And what a client gets wrong: a
missing or foreign object, spans past a region's end, an output that does not fit, an object truncated after
it was registered; each a clear error, the front up, the next request answered.
"""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest

from conftest import stop_cleanly
from test_triton_examples import SIMPLE_CONFIG, simple
from test_triton_repo import put_model, start_importing

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
shm = pytest.importorskip("tritonclient.utils.shared_memory")
from tritonclient.utils import InferenceServerException  # noqa: E402

from modelcache.errors import InputError, ModelNotFound  # noqa: E402
from modelcache.oip.shared_memory import RegionInput, RegionRef, Regions  # noqa: E402

N = 16 * 4   # bytes of one [1, 16] INT32 tensor


@pytest.fixture(scope="module")
def fronts(tmp_path_factory):
    """(HTTP host:port, gRPC host:port) of a daemon serving `simple`."""
    root = tmp_path_factory.mktemp("shm")
    repo = root / "models"
    put_model(repo, "simple", simple(False), SIMPLE_CONFIG.format(t="TYPE_INT32"))
    d, grpc_at, http_at = start_importing(root, repo, {"MODELCACHE_CLIENT_SHARED_MEMORY": "1"})
    try:
        yield http_at, grpc_at
    finally:
        stop_cleanly(d)


@pytest.fixture
def regions():
    """Make regions with tritonclient's utility under unique keys; every one destroyed (unlinked) after."""
    made = []

    def make(size: int):
        key = f"/mc-test-{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key[1:], key, size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


def inputs_in_region(module, handle, name: str):
    """INPUT0 = 0..15, INPUT1 = ones, written to the region at 0 and N; InferInputs naming them there."""
    a, b = np.arange(16, dtype=np.int32), np.ones(16, dtype=np.int32)
    shm.set_shared_memory_region(handle, [a])
    shm.set_shared_memory_region(handle, [b], offset=N)
    ins = [module.InferInput("INPUT0", [1, 16], "INT32"), module.InferInput("INPUT1", [1, 16], "INT32")]
    ins[0].set_shared_memory(name, N)
    ins[1].set_shared_memory(name, N, offset=N)
    return a, b, ins


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_inputs_and_outputs_stay_in_the_clients_regions(fronts, regions, protocol):
    module = httpclient if protocol == "http" else grpcclient
    client = module.InferenceServerClient(fronts[0] if protocol == "http" else fronts[1])
    assert "system_shared_memory" in (client.get_server_metadata()["extensions"] if protocol == "http"
                                      else client.get_server_metadata().extensions)
    client.unregister_system_shared_memory()
    client.unregister_cuda_shared_memory()   # (Triton's examples clear both kinds first: none is held here)
    in_key, in_handle = regions(2 * N)
    out_key, out_handle = regions(2 * N)
    client.register_system_shared_memory("in", in_key, 2 * N)
    client.register_system_shared_memory("out", out_key, 2 * N)
    a, b, ins = inputs_in_region(module, in_handle, "in")
    outs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outs[0].set_shared_memory("out", N)
    outs[1].set_shared_memory("out", N, offset=N)
    result = client.infer("simple", ins, outputs=outs)
    got0 = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16])
    got1 = shm.get_contents_as_numpy(out_handle, np.int32, [1, 16], offset=N)
    np.testing.assert_array_equal(got0[0], a + b)
    np.testing.assert_array_equal(got1[0], a - b)
    out0 = result.get_output("OUTPUT0")   # as Triton answers it: datatype and shape, no data, no parameters
    if protocol == "http":
        assert out0 == {"name": "OUTPUT0", "datatype": "INT32", "shape": [1, 16]}
    else:
        assert out0.datatype == "INT32" and list(out0.shape) == [1, 16] and not out0.parameters
        assert list(result.get_response().raw_output_contents) == [b"", b""]
    status = client.get_system_shared_memory_status()
    if protocol == "http":
        by_name = {r["name"]: r for r in status}
        assert by_name["in"] == {"name": "in", "key": in_key, "offset": 0, "byte_size": 2 * N}
    else:
        assert status.regions["out"].key == out_key and status.regions["out"].byte_size == 2 * N
    client.unregister_system_shared_memory("in")
    status = client.get_system_shared_memory_status()
    assert [r["name"] for r in status] == ["out"] if protocol == "http" else list(status.regions) == ["out"]
    client.unregister_system_shared_memory()
    assert not (client.get_system_shared_memory_status() if protocol == "http"
                else client.get_system_shared_memory_status().regions)


def test_grpc_mixes_regions_with_raw_contents(fronts, regions):
    """One input in a region, one in raw_input_contents (which then has one entry); one output in a region,
    the other raw, found by tritonclient at its position."""
    client = grpcclient.InferenceServerClient(fronts[1])
    key, handle = regions(N)
    client.register_system_shared_memory("mix", key, N)
    try:
        a, b = np.arange(16, dtype=np.int32)[None] * 3, np.full((1, 16), 5, np.int32)
        shm.set_shared_memory_region(handle, [a])
        ins = [grpcclient.InferInput("INPUT0", [1, 16], "INT32"), grpcclient.InferInput("INPUT1", [1, 16], "INT32")]
        ins[0].set_shared_memory("mix", N)
        ins[1].set_data_from_numpy(b)
        outs = [grpcclient.InferRequestedOutput("OUTPUT0"), grpcclient.InferRequestedOutput("OUTPUT1")]
        outs[0].set_shared_memory("mix", N)   # (the input's bytes are read before the output is written)
        result = client.infer("simple", ins, outputs=outs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
        np.testing.assert_array_equal(shm.get_contents_as_numpy(handle, np.int32, [1, 16]), a + b)
    finally:
        client.unregister_system_shared_memory()


def refused(call, *words: str) -> str:
    with pytest.raises(InferenceServerException) as e:
        call()
    text = str(e.value)
    for w in words:
        assert w in text, text
    return text


def test_what_a_client_gets_wrong_is_refused_and_the_front_goes_on(fronts, regions):
    client = httpclient.InferenceServerClient(fronts[0])
    key, handle = regions(2 * N)
    missing = f"/mc-test-absent-{uuid.uuid4().hex[:8]}"
    refused(lambda: client.register_system_shared_memory("r", missing, N), "Unable to open", missing)
    refused(lambda: client.register_system_shared_memory("r", key, 3 * N), "runs past the end")
    refused(lambda: client.register_system_shared_memory("r", "/modelcache-io.0.1.2", N), "modelcache's own")
    refused(lambda: client.register_system_shared_memory("r", "/a/b", N), "one shared-memory object")
    link = f"/dev/shm/mc-test-link-{uuid.uuid4().hex[:8]}"
    os.symlink(f"/dev/shm{key}", link)
    try:   # a symlink in /dev/shm (anyone may make one) must not lead the front to another file
        refused(lambda: client.register_system_shared_memory("r", "/" + os.path.basename(link), N), "Unable to open")
    finally:
        os.unlink(link)
    refused(lambda: client.get_system_shared_memory_status("nothing"), "Unable to find", "nothing")
    client.register_system_shared_memory("r", key, 2 * N)
    try:
        refused(lambda: client.register_system_shared_memory("r", key, N), "already in manager")
        _, _, ins = inputs_in_region(httpclient, handle, "r")
        ins[1].set_shared_memory("r", N, offset=2 * N)   # past the region's 2N bytes
        refused(lambda: client.infer("simple", ins), "INPUT1", "runs past region 'r'")
        ins[1].set_shared_memory("nope", N)
        refused(lambda: client.infer("simple", ins), "Unable to find system shared memory region: 'nope'")
        ins[1].set_shared_memory("r", N - 4, offset=N)
        refused(lambda: client.infer("simple", ins), "shared_memory_byte_size 60 for 16 INT32")
        ins[1].set_shared_memory("r", N, offset=N)
        small = httpclient.InferRequestedOutput("OUTPUT0")
        small.set_shared_memory("r", N - 1)
        refused(lambda: client.infer("simple", ins, outputs=[small]),
                "output 'OUTPUT0' (63 bytes) should be at least 64 bytes")
        os.truncate(f"/dev/shm{key}", N)   # the client shrinks its object under the registration
        refused(lambda: client.infer("simple", ins), "INPUT1", "truncated")
        os.truncate(f"/dev/shm{key}", 2 * N)
        _, _, ins = inputs_in_region(httpclient, handle, "r")
        assert client.infer("simple", ins).as_numpy("OUTPUT0").tolist()[0] == list(range(1, 17))
    finally:
        client.unregister_system_shared_memory()
    assert client.is_server_live()
    refused(lambda: client.register_cuda_shared_memory("c", b"", 0, N), "CUDA shared memory is not served")


# The registry on its own, over files in a test directory standing in for /dev/shm.

def test_regions_read_write_and_let_go(tmp_path):
    obj = tmp_path / "obj"
    obj.write_bytes(np.arange(8, dtype=np.float32).tobytes())
    regions = Regions(str(tmp_path))
    regions.register("r", "/obj", 8, 24)   # bytes 8..32 of the object: floats 2..7
    before = len(os.listdir("/proc/self/fd"))
    feeds = regions.read_inputs({"x": RegionInput("x", RegionRef("r", 8, 4), "FP32", np.dtype("float32"), [2]),
                                 "y": np.zeros(1)})
    assert feeds["x"].tolist() == [3.0, 4.0] and feeds["y"].tolist() == [0.0]
    regions.write_output("o", RegionRef("r", 8, 16), np.array([9, 10], np.float32).tobytes())
    assert np.frombuffer(obj.read_bytes(), np.float32).tolist() == [0, 1, 2, 3, 4, 5, 9, 10]
    with pytest.raises(InputError, match="past region 'r'"):
        regions.write_output("o", RegionRef("r", 16, 16), b"\0" * 16)
    assert len(os.listdir("/proc/self/fd")) == before
    regions.unregister("r")
    regions.unregister("never")   # (Triton's: no error)
    assert regions.status() == []
    with pytest.raises(ModelNotFound):
        regions.status("r")
    assert len(os.listdir("/proc/self/fd")) == before - 1   # its descriptor closed


def test_a_reference_needs_its_size_and_whole_numbers():
    assert RegionRef.of({}, "input 'x'") is None
    with pytest.raises(InputError, match="needs its shared_memory_byte_size"):
        RegionRef.of({"shared_memory_region": "r"}, "input 'x'")
    with pytest.raises(InputError, match="need a shared_memory_region"):
        RegionRef.of({"shared_memory_byte_size": 4}, "input 'x'")
    with pytest.raises(InputError, match="shared_memory_offset -1"):
        RegionRef.of({"shared_memory_region": "r", "shared_memory_byte_size": 4, "shared_memory_offset": -1}, "x")
