"""Triton's gRPC front (`modelcache grpc`, the daemon's grpc_port), driven by tritonclient.grpc unchanged.

One daemon per module runs both fronts as its children (http_port and grpc_port, free loopback ports);
outputs are compared with plain ONNX Runtime. The front's own error paths (no daemon, a port in use) start
their own processes.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

grpcclient = pytest.importorskip("tritonclient.grpc")   # in the [test] extra
import grpc  # noqa: E402
import tritonclient.grpc.aio as grpcaio  # noqa: E402
from tritonclient.grpc import service_pb2  # noqa: E402   (tritonclient's own copy of Triton's messages)
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import DaemonProcess, stop_cleanly, wait_until  # noqa: E402

MAX_MESSAGE = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def strings_model(path: str) -> str:
    """Identity over a free-length BYTES (string) tensor: no zoo model takes strings."""
    g = helper.make_graph([helper.make_node("Identity", ["text"], ["same"])], "g",
                          [helper.make_tensor_value_info("text", TensorProto.STRING, ["n"])],
                          [helper.make_tensor_value_info("same", TensorProto.STRING, ["n"])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), path)
    return path


def wait_live(client) -> None:
    def live():
        try:
            return client.is_server_live()
        except InferenceServerException:
            return False
    wait_until(live, 30, "the daemon's gRPC front")


@pytest.fixture(scope="module")
def served(tmp_path_factory, zoo_file):
    """(daemon, "host:port" of its gRPC front, "host:port" of its HTTP front, {name: .onnx path}); the daemon
    batches dynamically so concurrent requests can share a run, and takes requests up to 1 MiB."""
    root = tmp_path_factory.mktemp("grpc")
    ports = {"grpc": free_port(), "http": free_port()}
    d = DaemonProcess(root, extra_env={"MODELCACHE_GRPC_PORT": str(ports["grpc"]),
                                       "MODELCACHE_HTTP_PORT": str(ports["http"]),
                                       "MODELCACHE_BATCHING": "dynamic", "MODELCACHE_MAX_BATCH": "8",
                                       "MODELCACHE_MAX_QUEUE_DELAY_MS": "20",
                                       "MODELCACHE_MAX_MESSAGE_SIZE": str(MAX_MESSAGE)}).start()
    try:
        files = {"cnn": zoo_file("tiny-cnn"), "embed": zoo_file("tiny-embed"),
                 "strings": strings_model(str(root / "strings.onnx"))}
        with d.client() as c:
            for name, path in files.items():
                c.add(path, name)
        grpc_at, http_at = f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['http']}"
        c = grpcclient.InferenceServerClient(grpc_at)
        wait_live(c)
        c.close()
        yield d, grpc_at, http_at, files
    finally:
        stop_cleanly(d)
    for port in ports.values():   # the fronts went with the daemon
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


@pytest.fixture
def client(served):
    c = grpcclient.InferenceServerClient(served[1])
    yield c
    c.close()


def reference(src: str, feeds: dict) -> list:
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


def cnn_input(x: np.ndarray):
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return inp


def status_of(call) -> tuple:
    """(gRPC status name, message) of a call tritonclient raised on."""
    with pytest.raises(InferenceServerException) as e:
        call()
    return e.value.status(), e.value.message()


def test_health_and_the_standard_health_service(served, client):
    assert client.is_server_live() and client.is_server_ready()
    from modelcache.triton_protos import health_pb2
    with grpc.insecure_channel(served[1]) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check",   # as any health prober calls it
                                    request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                    response_deserializer=health_pb2.HealthCheckResponse.FromString)
        for service in ("", "inference.GRPCInferenceService"):
            assert check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as e:
            check(health_pb2.HealthCheckRequest(service="nope"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_metadata_and_config(served, client):
    meta = client.get_server_metadata()
    assert meta.name == "modelcache" and "model_repository" in meta.extensions
    cnn = client.get_model_metadata("cnn", as_json=True)
    assert cnn["versions"] == ["1"] and cnn["platform"] == "onnxruntime_onnx"
    assert cnn["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "3", "32", "32"]}]
    assert client.get_model_metadata("cnn", model_version="1", as_json=True) == cnn
    config = client.get_model_config("cnn", as_json=True)["config"]
    assert config["name"] == "cnn" and config["backend"] == "onnxruntime"
    assert config["input"][0]["data_type"] == "TYPE_FP32" and config["output"][0]["dims"] == ["-1", "10"]
    assert client.is_model_ready("cnn") and client.is_model_ready("cnn", "1")
    assert not client.is_model_ready("nope")
    code, message = status_of(lambda: client.get_model_metadata("nope"))
    assert code == "StatusCode.NOT_FOUND" and "nope" in message and "\n" not in message
    code, message = status_of(lambda: client.get_model_config("cnn", model_version="x"))
    assert code == "StatusCode.INVALID_ARGUMENT" and "not a number" in message


def test_infer_equals_plain_ort(served, client):
    _, _, _, files = served
    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    r = client.infer("cnn", [cnn_input(x)], outputs=[grpcclient.InferRequestedOutput("logits")], request_id="req-7")
    np.testing.assert_allclose(r.as_numpy("logits"), reference(files["cnn"], {"input": x})[0], rtol=1e-4, atol=1e-5)
    response = r.get_response()
    assert (response.id, response.model_name, response.model_version) == ("req-7", "cnn", "1")
    # int64 ids and a bool mask
    from modelcache import zoo
    feeds = zoo.sample_inputs(files["embed"], batch=2, seed=3)
    inputs = []
    for name, value in feeds.items():
        i = grpcclient.InferInput(name, list(value.shape), {"int64": "INT64", "bool": "BOOL"}[value.dtype.name])
        i.set_data_from_numpy(value)
        inputs.append(i)
    r = client.infer("embed", inputs)
    want = reference(files["embed"], feeds)
    out = r.get_response().outputs[0].name
    np.testing.assert_allclose(r.as_numpy(out), want[0], rtol=1e-4, atol=1e-5)


def test_bytes_tensors(client):
    words = np.array(["x", "", "yz é", "long " * 40], dtype=object)
    i = grpcclient.InferInput("text", [4], "BYTES")
    i.set_data_from_numpy(words)
    r = client.infer("strings", [i])
    assert r.get_response().outputs[0].datatype == "BYTES"
    assert [v.decode() for v in r.as_numpy("same")] == list(words)


def test_typed_contents_are_taken_and_replies_are_raw(served):
    """A hand-written client may send fp32_contents; the reply is raw_output_contents, which as_numpy reads."""
    _, grpc_at, _, files = served
    x = np.random.default_rng(2).standard_normal((1, 3, 32, 32)).astype(np.float32)
    request = service_pb2.ModelInferRequest(model_name="cnn")
    t = request.inputs.add(name="input", datatype="FP32", shape=[1, 3, 32, 32])
    t.contents.fp32_contents.extend(x.ravel().tolist())
    with grpc.insecure_channel(grpc_at) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=service_pb2.ModelInferRequest.SerializeToString,
                                   response_deserializer=service_pb2.ModelInferResponse.FromString)
        reply = call(request)
        assert len(reply.raw_output_contents) == 1 and not reply.outputs[0].HasField("contents")
        got = np.frombuffer(reply.raw_output_contents[0], np.float32).reshape(list(reply.outputs[0].shape))
        np.testing.assert_allclose(got, reference(files["cnn"], {"input": x})[0], rtol=1e-4, atol=1e-5)
        request.inputs[0].contents.fp32_contents.append(1.0)   # one element too many
        with pytest.raises(grpc.RpcError) as e:
            call(request)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "3072 elements" in e.value.details()


def test_errors_are_status_codes_in_one_line(served, client):
    x = np.zeros((1, 3, 32, 32), np.float32)
    code, message = status_of(lambda: client.infer("nope", [cnn_input(x)]))
    assert code == "StatusCode.NOT_FOUND"
    wrong = grpcclient.InferInput("input", [1, 3, 16, 16], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 3, 16, 16), np.float32))
    code, message = status_of(lambda: client.infer("cnn", [wrong]))
    assert code == "StatusCode.INVALID_ARGUMENT" and "input" in message and "\n" not in message
    f64 = grpcclient.InferInput("input", [1, 3, 32, 32], "FP64")
    f64.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float64))
    assert status_of(lambda: client.infer("cnn", [f64]))[0] == "StatusCode.INVALID_ARGUMENT"
    # over max_message_size: refused by grpc's core from the length prefix, the front unharmed
    big = np.zeros((120, 3, 32, 32), np.float32)   # 1.4 MiB
    code, message = status_of(lambda: client.infer("cnn", [cnn_input(big)]))
    assert code == "StatusCode.RESOURCE_EXHAUSTED"
    assert client.infer("cnn", [cnn_input(x)]).as_numpy("logits").shape == (1, 10)
    # a deadline that passes in the daemon's queue: the `timeout` parameter (us) and the call's own
    code, message = status_of(lambda: client.infer("cnn", [cnn_input(x)], timeout=1))
    assert code == "StatusCode.DEADLINE_EXCEEDED", message
    assert status_of(lambda: client.infer("cnn", [cnn_input(x)], client_timeout=1e-4))[0] == \
        "StatusCode.DEADLINE_EXCEEDED"


def test_async_infer_batches_in_the_daemon(served, client):
    """Concurrent calls (tritonclient's async_infer and its asyncio client) reach the engine together and
    share runs: fewer executions than inferences."""
    _, grpc_at, _, files = served
    before = client.get_inference_statistics("cnn").model_stats[0]
    xs = [np.random.default_rng(k).standard_normal((1, 3, 32, 32)).astype(np.float32) for k in range(16)]
    answers: queue.Queue = queue.Queue()
    for k, x in enumerate(xs[:8]):
        client.async_infer("cnn", [cnn_input(x)], lambda result, error, k=k: answers.put((k, result, error)),
                           request_id=str(k))
    got = dict()
    for _ in range(8):
        k, result, error = answers.get(timeout=60)
        assert error is None, error
        got[k] = result.as_numpy("logits")

    async def many():
        async with grpcaio.InferenceServerClient(grpc_at) as c:
            results = await asyncio.gather(*(c.infer("cnn", [cnn_input(x)]) for x in xs[8:]))
            return {8 + k: r.as_numpy("logits") for k, r in enumerate(results)}
    got.update(asyncio.run(many()))
    want = reference(files["cnn"], {"input": np.concatenate(xs)})[0]
    for k in range(16):
        np.testing.assert_allclose(got[k][0], want[k], rtol=1e-4, atol=1e-5)
    after = client.get_inference_statistics("cnn").model_stats[0]
    inferences = after.inference_count - before.inference_count
    executions = after.execution_count - before.execution_count
    assert inferences == 16 and executions < inferences, (inferences, executions)
    # batch_stats: the executions by their batch size, as Triton's (rows the batches held add up to the inferences)
    sizes = {b.batch_size: b.compute_infer.count for b in after.batch_stats}
    earlier = {b.batch_size: b.compute_infer.count for b in before.batch_stats}
    grew = {size: n - earlier.get(size, 0) for size, n in sizes.items() if n > earlier.get(size, 0)}
    assert sum(grew.values()) == executions and sum(size * n for size, n in grew.items()) == 16, grew
    assert any(size > 1 for size in grew), grew
    assert all(b.compute_infer.ns > 0 and b.compute_input.count == b.compute_infer.count for b in after.batch_stats)


def test_stream_infer_many_in_flight(served, client):
    """One stream, many requests in flight: each answered by id; an error answers its own request and the
    stream goes on."""
    _, _, _, files = served
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    xs = {str(k): np.random.default_rng(10 + k).standard_normal((1, 3, 32, 32)).astype(np.float32)
          for k in range(12)}
    try:
        for rid, x in xs.items():
            client.async_stream_infer("cnn", [cnn_input(x)], request_id=rid)
        client.async_stream_infer("nope", [cnn_input(xs["0"])], request_id="bad")
        got, errors = {}, []
        for _ in range(len(xs) + 1):
            result, error = answers.get(timeout=60)
            if error is not None:
                errors.append(error)
            else:
                got[result.get_response().id] = result.as_numpy("logits")
    finally:
        client.stop_stream()
    assert len(errors) == 1 and "nope" in errors[0].message()
    sess = ort.InferenceSession(files["cnn"], providers=["CPUExecutionProvider"])
    for rid, x in xs.items():
        np.testing.assert_allclose(got[rid], sess.run(None, {"input": x})[0], rtol=1e-4, atol=1e-5)


def test_statistics(client):
    x = np.zeros((2, 3, 32, 32), np.float32)
    client.infer("cnn", [cnn_input(x)])
    stats = client.get_inference_statistics("cnn", as_json=True)["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("cnn", "1")]
    s = stats[0]
    assert int(s["inference_count"]) >= 2 and int(s["inference_stats"]["success"]["count"]) >= 1
    assert int(s["inference_stats"]["compute_infer"]["ns"]) > 0
    every = client.get_inference_statistics(as_json=True)["model_stats"]
    assert {s["name"] for s in every} == {"cnn", "embed", "strings"}
    assert status_of(lambda: client.get_inference_statistics("nope"))[0] == "StatusCode.NOT_FOUND"


def test_repository_index_load_unload(client):
    index = {m.name: m for m in client.get_model_repository_index().models}
    assert set(index) == {"cnn", "embed", "strings"} and index["embed"].state == "READY"
    client.unload_model("embed")
    try:
        assert not client.is_model_ready("embed")
        index = {m.name: m for m in client.get_model_repository_index().models}
        assert (index["embed"].state, index["embed"].reason) == ("UNAVAILABLE", "unloaded")
        ids = grpcclient.InferInput("ids", [1, 4], "INT64")
        ids.set_data_from_numpy(np.zeros((1, 4), np.int64))
        code, message = status_of(lambda: client.infer("embed", [ids]))
        assert code == "StatusCode.INVALID_ARGUMENT" and "unloaded" in message
    finally:
        client.load_model("embed")
    assert client.is_model_ready("embed")
    assert status_of(lambda: client.load_model("nope"))[0] == "StatusCode.NOT_FOUND"
    code, message = status_of(lambda: client.load_model("embed", config='{"max_batch_size": 2}'))
    assert code == "StatusCode.INVALID_ARGUMENT" and "a config override applies to the model's files" in message


def test_grpc_and_http_fronts_answer_alike(served):
    """Both fronts of one daemon, the same operations: the same outputs, metadata and configuration."""
    import tritonclient.http as httpclient
    _, grpc_at, http_at, _ = served
    x = np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype(np.float32)
    hc = httpclient.InferenceServerClient(http_at)
    gc = grpcclient.InferenceServerClient(grpc_at)
    try:
        hi = httpclient.InferInput("input", list(x.shape), "FP32")
        hi.set_data_from_numpy(x)
        np.testing.assert_array_equal(hc.infer("cnn", [hi]).as_numpy("logits"),
                                      gc.infer("cnn", [cnn_input(x)]).as_numpy("logits"))
        http_config = hc.get_model_config("cnn")
        grpc_config = gc.get_model_config("cnn", as_json=True)["config"]
        assert http_config["input"][0]["dims"] == [int(d) for d in grpc_config["input"][0]["dims"]]
        assert http_config["name"] == grpc_config["name"] and http_config["backend"] == grpc_config["backend"]
    finally:
        hc.close()
        gc.close()


def start_front(d: DaemonProcess, port: int = 0) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "grpc", "--port", str(port)], env=d.env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY "):
        proc.kill()
        raise RuntimeError(f"modelcache grpc did not get ready: {line!r} {proc.stderr.read()}")
    return proc, line.split()[1]


def test_no_daemon_is_unavailable_and_not_ready(tmp_path, zoo_file):
    """The standalone front outlives its daemon: live, not ready, calls UNAVAILABLE in one line; a daemon
    started again on the same socket is found by the next call."""
    d = DaemonProcess(tmp_path).start()
    with d.client() as c:
        c.add(zoo_file("tiny-cnn"), "cnn")
    front, at = start_front(d)
    client = grpcclient.InferenceServerClient(at)
    try:
        assert client.is_model_ready("cnn")
        assert d.stop() == 0
        assert client.is_server_live() and not client.is_server_ready()
        code, message = status_of(lambda: client.get_model_metadata("cnn"))
        assert code == "StatusCode.UNAVAILABLE" and "daemon" in message and "\n" not in message
        d2 = DaemonProcess(tmp_path).start()
        try:
            assert client.is_model_ready("cnn") and client.is_server_ready()
        finally:
            stop_cleanly(d2)
    finally:
        client.close()
        front.terminate()
        assert front.wait(30) == 0
        stderr = front.stderr.read()
        assert "Traceback" not in stderr, stderr
        d.kill()


def test_ports_in_use_are_one_line(tmp_path):
    """A port the front cannot have: `modelcache grpc` and the daemon's grpc_port each refuse in one line."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        d = DaemonProcess(tmp_path).start()
        try:
            r = subprocess.run([sys.executable, "-m", "modelcache.cli", "grpc", "--port", str(port)], env=d.env,
                               capture_output=True, text=True, timeout=60)
            last = r.stderr.strip().splitlines()[-1]
            assert r.returncode == 1 and last.startswith("modelcache: ") and f"--port {port}" in last, r.stderr
            assert "Traceback" not in r.stderr
        finally:
            stop_cleanly(d)
        d2 = DaemonProcess(tmp_path / "d2", extra_env={"MODELCACHE_GRPC_PORT": str(port)})
        d2.root.mkdir()
        with pytest.raises(RuntimeError) as e:
            d2.start()
        assert f"grpc_port {port}" in str(e.value) and "Traceback" not in str(e.value)
