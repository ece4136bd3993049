"""The Open Inference Protocol front (`modelcache http`), driven by Triton's own client against a real daemon.

Every test runs a real daemon subprocess and a real `modelcache http` subprocess on a free
loopback port (--port 0, read from its READY line); outputs are compared with plain ONNX Runtime.
"""

from __future__ import annotations

import http.client
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import onnxruntime as ort
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")   # in the [test] extra
from tritonclient.utils import InferenceServerException  # noqa: E402

from conftest import DaemonProcess, stop_cleanly, wait_until  # noqa: E402


class HttpFront:
    """A `modelcache http` subprocess for the daemon `d`."""

    def __init__(self, d: DaemonProcess):
        self.log_path = d.root / "http.log"
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "modelcache.cli", "http", "--port", "0"], env=d.env,
                                     stdout=subprocess.PIPE, stderr=self.log)
        deadline = time.monotonic() + 30
        line = b""
        while time.monotonic() < deadline and self.proc.poll() is None:
            if select.select([self.proc.stdout], [], [], 0.5)[0]:
                line = self.proc.stdout.readline()
                if line.startswith(b"READY "):
                    break
        if not line.startswith(b"READY "):
            self.stop()
            raise RuntimeError(f"modelcache http did not get ready: {line!r}\n{self.log_path.read_text()}")
        self.url = line.split()[1].decode()             # http://127.0.0.1:PORT
        self.hostport = self.url[len("http://"):]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        self.log.close()
        return self.proc.returncode

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """(status, headers, body) of one request on a fresh connection."""
        conn = http.client.HTTPConnection(self.hostport, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, dict(r.getheaders()), r.read()
        finally:
            conn.close()


@pytest.fixture
def served(tmp_path, zoo_file):
    """(daemon, front, {name: .onnx path}) with tiny-cnn (a free batch dim) and tiny-embed (int64 and bool
    inputs) added; the daemon batches dynamically so concurrent requests can share a run."""
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_BATCHING": "dynamic", "MODELCACHE_MAX_BATCH": "8",
                                           "MODELCACHE_MAX_QUEUE_DELAY_MS": "30"}).start()
    front = None
    try:
        files = {"cnn": zoo_file("tiny-cnn"), "embed": zoo_file("tiny-embed")}
        with d.client() as c:
            for name, path in files.items():
                c.add(path, name)
        front = HttpFront(d)
        yield d, front, files
    finally:
        rc = front.stop() if front is not None else 0
        stop_cleanly(d)
        assert rc == 0, front.log_path.read_text()


def reference(src: str, feeds: dict) -> list:
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_health_and_metadata(served):
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport)
    assert c.is_server_live() and c.is_server_ready()
    meta = c.get_server_metadata()
    assert meta["name"] == "modelcache" and "binary_tensor_data" in meta["extensions"]
    # client shared memory is off unless the operator allows it (Triton's default since 2.69): said, and refused
    assert "system_shared_memory" not in meta["extensions"]
    with pytest.raises(InferenceServerException) as e:
        c.register_system_shared_memory("r", "/anything", 4)
    assert int(e.value.status()) == 403 and "client_shared_memory = true" in str(e.value)
    assert c.get_system_shared_memory_status() == []
    cnn = c.get_model_metadata("cnn")
    assert cnn["versions"] == ["1"] and cnn["platform"] == "onnxruntime_onnx"
    assert cnn["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    assert cnn["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]
    assert c.get_model_metadata("cnn", model_version="1") == cnn
    embed = c.get_model_metadata("embed")
    assert {i["datatype"] for i in embed["inputs"]} == {"INT64", "BOOL"}
    assert c.is_model_ready("cnn") and c.is_model_ready("cnn", "1")
    assert not c.is_model_ready("nope")
    with pytest.raises(InferenceServerException) as e:
        c.get_model_metadata("nope")
    assert int(e.value.status()) == 404
    assert "nope" in e.value.message()


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_equals_plain_ort(served, binary):
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport)
    x = np.random.default_rng(1).standard_normal((3, 3, 32, 32)).astype(np.float32)
    inp = tritonhttp.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    r = c.infer("cnn", [inp], outputs=[tritonhttp.InferRequestedOutput("logits", binary_data=binary)],
                request_id="req-7")
    np.testing.assert_allclose(r.as_numpy("logits"), reference(files["cnn"], {"input": x})[0], rtol=1e-4, atol=1e-5)
    assert r.get_response()["id"] == "req-7"
    # int64 ids and a bool mask, in JSON and in binary
    from modelcache import zoo
    feeds = zoo.sample_inputs(files["embed"], batch=2, seed=3)
    inputs = []
    for name, value in feeds.items():
        i = tritonhttp.InferInput(name, list(value.shape), {"int64": "INT64", "bool": "BOOL"}[value.dtype.name])
        i.set_data_from_numpy(value, binary_data=binary)
        inputs.append(i)
    r = c.infer("embed", inputs, outputs=None if binary else
                [tritonhttp.InferRequestedOutput(o.name, binary_data=False) for o in
                 ort.InferenceSession(files["embed"]).get_outputs()])
    want = reference(files["embed"], feeds)
    for o, ref in zip(ort.InferenceSession(files["embed"]).get_outputs(), want):
        np.testing.assert_allclose(r.as_numpy(o.name), ref, rtol=1e-4, atol=1e-5)


def test_batched_model_under_concurrent_requests(served):
    """Eight requests at once through the front: the daemon's dynamic batching forms batches of them,
    and each caller gets its own rows back."""
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport, concurrency=8)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal((1 + k % 3, 3, 32, 32)).astype(np.float32) for k in range(8)]
    pending = []
    for x in xs:
        inp = tritonhttp.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        pending.append(c.async_infer("cnn", [inp]))
    sess = ort.InferenceSession(files["cnn"], providers=["CPUExecutionProvider"])
    for x, p in zip(xs, pending):
        out = p.get_result().as_numpy("logits")
        assert out.shape == (x.shape[0], 10)
        np.testing.assert_allclose(out, sess.run(None, {"input": x})[0], rtol=1e-4, atol=1e-5)
    c.close()
    with d.client() as mc:
        ex = mc.stats().executor
    assert ex["served"] >= 8


def test_errors_are_v2_errors(served):
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport)
    x = np.zeros((1, 3, 32, 32), np.float32)
    inp = tritonhttp.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as e:          # unknown model
        c.infer("nope", [inp])
    assert int(e.value.status()) == 404
    bad = tritonhttp.InferInput("input", [1, 3, 31, 32], "FP32")  # a shape the model does not take
    bad.set_data_from_numpy(np.zeros((1, 3, 31, 32), np.float32))
    with pytest.raises(InferenceServerException) as e:
        c.infer("cnn", [bad])
    assert int(e.value.status()) == 400 and "shape" in e.value.message()
    with pytest.raises(InferenceServerException) as e:           # a deadline that cannot be met (1 us)
        c.infer("cnn", [inp], timeout=1)
    assert int(e.value.status()) == 504 and "deadline" in e.value.message()
    cases = [
        (b"{not json", {}),                                                      # malformed body
        (b'{"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [1, 2]}]}', {}),
        (b'{"inputs": [{"name": "input", "shape": [1], "datatype": "FP99", "data": [1]}]}', {}),
        (b'{"inputs": [{"name": "input", "shape": [1, 3, 32, 32], "datatype": "FP32", '
         b'"parameters": {"binary_data_size": 12288}}]}' + b"\0" * 100, {"Inference-Header-Content-Length": "96"}),
        (b'{"inputs": []}', {}),
    ]
    for body, headers in cases:
        status, hdrs, payload = front.request("POST", "/v2/models/cnn/infer", body, headers)
        assert status == 400, (body[:60], payload)
        doc = json.loads(payload)
        assert set(doc) == {"error"} and "Traceback" not in doc["error"]
    status, _, payload = front.request("GET", "/v2/no/such/route")
    assert status == 404 and set(json.loads(payload)) == {"error"}
    status, _, payload = front.request("GET", "/v2/models/cnn/versions/x")
    assert status == 400 and "version" in json.loads(payload)["error"]
    status, _, payload = front.request("GET", "/v2/models/cnn/versions/9")
    assert status == 404


def test_raw_binary_request_and_selected_output(served):
    """The binary-tensor extension by hand, as another language's client would send it."""
    d, front, files = served
    x = np.random.default_rng(4).standard_normal((2, 3, 32, 32)).astype(np.float32)
    head = json.dumps({"inputs": [{"name": "input", "shape": [2, 3, 32, 32], "datatype": "FP32",
                                   "parameters": {"binary_data_size": x.nbytes}}],
                       "outputs": [{"name": "logits", "parameters": {"binary_data": True}}]}).encode()
    status, hdrs, payload = front.request("POST", "/v2/models/cnn/versions/1/infer", head + x.tobytes(),
                                          {"Inference-Header-Content-Length": str(len(head)),
                                           "Content-Type": "application/octet-stream"})
    assert status == 200, payload
    n = int(hdrs["Inference-Header-Content-Length"])
    doc = json.loads(payload[:n])
    assert doc["model_version"] == "1" and doc["outputs"][0]["shape"] == [2, 10]
    out = np.frombuffer(payload[n:], np.float32).reshape(2, 10)
    np.testing.assert_allclose(out, reference(files["cnn"], {"input": x})[0], rtol=1e-4, atol=1e-5)


def test_model_repository_extension(served):
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport)
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert index["cnn"]["state"] == "READY" and index["cnn"]["version"] == "1"
    c.load_model("cnn")
    with d.client() as mc:
        assert {m["name"]: m for m in mc.list()}["cnn"]["tier"] != "disk"
        c.unload_model("cnn")
        assert {m["name"]: m for m in mc.list()}["cnn"]["tier"] == "disk"
    with pytest.raises(InferenceServerException) as e:
        c.load_model("nope")
    assert int(e.value.status()) == 404


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_live(client) -> None:
    """Until the daemon's HTTP front (its child, started once the daemon listens) answers."""
    def live():
        try:
            return client.is_server_live()
        except Exception:
            return False
    wait_until(live, 30, "the daemon's HTTP front")


def maps_onnxruntime(pid: int) -> bool:
    """Whether the process has imported ONNX Runtime (its extension module is mapped)."""
    with open(f"/proc/{pid}/maps") as f:
        return "onnxruntime_pybind11_state" in f.read()


def test_daemon_starts_and_stops_the_front(tmp_path, zoo_file):
    """http_port: the daemon runs the front as its child and stops it with itself. A daemon with a front imports
    ONNX Runtime as it starts, not in the first request's session (Engine.start)."""
    port = _free_port()
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_HTTP_PORT": str(port)}).start()
    try:
        with d.client() as c:
            c.add(zoo_file("tiny-cnn"), "cnn")
        tc = tritonhttp.InferenceServerClient(f"127.0.0.1:{port}")
        wait_live(tc)
        assert tc.get_model_metadata("cnn")["name"] == "cnn"
        tc.close()
        wait_until(lambda: maps_onnxruntime(d.proc.pid), 30, "the daemon's import of onnxruntime")
    finally:
        stop_cleanly(d)
    with pytest.raises(OSError):   # the port is closed: the front went with the daemon
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_the_daemons_front_reads_the_daemons_config_file(tmp_path):
    """A daemon started with --config FILE: its front child reads the same file (here: client_shared_memory,
    which only the front reads), not only the environment it inherits."""
    port = _free_port()
    config = tmp_path / "modelcache.toml"
    config.write_text(f"http_port = {port}\nclient_shared_memory = true\n")
    d = DaemonProcess(tmp_path, args=("--config", str(config))).start()
    try:
        tc = tritonhttp.InferenceServerClient(f"127.0.0.1:{port}")
        wait_live(tc)
        assert "system_shared_memory" in tc.get_server_metadata()["extensions"]
        tc.close()
    finally:
        stop_cleanly(d)


def test_daemon_gone_is_503_and_not_ready(tmp_path, zoo_file):
    """The front outlives its daemon: live, but not ready, and requests get 503 (not a hang, not a 500);
    a daemon started again on the same socket is found by the next request."""
    d = DaemonProcess(tmp_path).start()
    front = HttpFront(d)
    try:
        with d.client() as c:
            c.add(zoo_file("tiny-cnn"), "cnn")
        assert front.request("GET", "/v2/models/cnn")[0] == 200
        assert not maps_onnxruntime(d.proc.pid)   # (no front of its own: ORT waits for a request it runs)
        assert d.stop() == 0
        status, _, payload = front.request("GET", "/v2/models/cnn")
        assert status == 503 and "daemon" in json.loads(payload)["error"]
        assert front.request("GET", "/v2/health/live")[0] == 200
        assert front.request("GET", "/v2/health/ready")[0] == 400
        d2 = DaemonProcess(tmp_path).start()
        try:
            assert front.request("GET", "/v2/models/cnn")[0] == 200
            assert front.request("GET", "/v2/health/ready")[0] == 200
        finally:
            stop_cleanly(d2)
    finally:
        assert front.stop() == 0, front.log_path.read_text()
        d.kill()


def _infer_body(name: str, datatype: str, shape: list, data: list, **more) -> bytes:
    inputs = [{"name": name, "datatype": datatype, "shape": shape, "data": data}]
    inputs += [{"name": k, "datatype": dt, "shape": sh, "data": v} for k, (dt, sh, v) in more.items()]
    return json.dumps({"inputs": inputs}).encode()


def test_json_values_their_datatype_cannot_hold_are_400(served):
    """Before: INT64 [1.7, 2.2, 3.9] ran as 1, 2, 3. Now the front names the input, datatype and value."""
    d, front, files = served
    mask = ("BOOL", [1, 3], [True, True, True])
    cases = [(_infer_body("ids", "INT64", [1, 3], [1.7, 2.2, 3.9], mask=mask), "'ids': INT64", "1.7"),
             (_infer_body("ids", "INT64", [1, 3], [1, 2, 3], mask=("BOOL", [1, 3], [True, 1, False])),
              "'mask': BOOL", "element 1 is 1"),
             (_infer_body("ids", "INT64", [1, 3], [1, 2, 2 ** 63], mask=mask), "'ids': INT64", str(2 ** 63)),
             (_infer_body("ids", "INT64", [1, 3], [1, 2, "3"], mask=mask), "'ids': INT64", '"3"'),
             (_infer_body("ids", "INT64", [1, 3], [1, 2], mask=mask), "'ids'", "2 elements for shape [1, 3]")]
    for body, what, value in cases:
        status, _, payload = front.request("POST", "/v2/models/embed/infer", body)
        message = json.loads(payload)["error"]
        assert status == 400 and what in message and value in message, (status, message)
    status, _, payload = front.request("POST", "/v2/models/embed/infer",   # integral floats are integers
                                       _infer_body("ids", "INT64", [1, 3], [1.0, 2, 3], mask=mask))
    assert status == 200, payload


def test_data_the_model_refuses_as_it_runs_is_the_callers_error(served, tmp_path):
    """An id past the embedding table's 100 rows passes every declared check and fails in ORT's Gather
    (INVALID_ARGUMENT): a 400 over HTTP and an InputError in Python serve mode, where it was a 500 and a bare
    ModelCacheError. A run that fails for another reason (a Reshape the model cannot do: ORT's FAIL) is a
    RunError, a 500. ORT's own coloured log line of the failure stays out of the daemon's log."""
    from modelcache.errors import InputError, ModelCacheError, RunError
    from onnx import TensorProto, helper, save

    d, front, files = served
    ids = np.array([[3, 150, 7]], np.int64)
    mask = np.ones((1, 3), bool)
    c = tritonhttp.InferenceServerClient(front.hostport)
    inputs = []
    for name, value, dt in (("ids", ids, "INT64"), ("mask", mask, "BOOL")):
        i = tritonhttp.InferInput(name, list(value.shape), dt)
        i.set_data_from_numpy(value)
        inputs.append(i)
    with pytest.raises(InferenceServerException) as e:
        c.infer("embed", inputs)
    assert int(e.value.status()) == 400
    assert "embed@1 refused the input" in e.value.message() and "Gather" in e.value.message()
    assert "idx=150" in e.value.message() and "[ONNXRuntimeError]" not in e.value.message()

    reshape = helper.make_graph(   # x of any length, as rows of 3: a length of 4 cannot be
        [helper.make_node("Reshape", ["x", "shape"], ["y"])], "rows3",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
        [helper.make_tensor("shape", TensorProto.INT64, [2], [-1, 3])])
    path = tmp_path / "rows3.onnx"
    save(helper.make_model(reshape, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    with d.client() as mc:
        mc.add(str(path), "rows3")
        with pytest.raises(InputError, match="embed@1 refused the input"):
            mc.infer("embed", {"ids": ids, "mask": mask})
        with pytest.raises(RunError, match="rows3@1: stage 0 failed: Reshape node") as e:
            mc.infer("rows3", {"x": np.zeros(4, np.float32)})
        assert not isinstance(e.value, InputError) and isinstance(e.value, ModelCacheError)
        out, _ = mc.infer("rows3", {"x": np.arange(6, dtype=np.float32)})
        assert out["y"].shape == (2, 3)
    status, _, payload = front.request("POST", "/v2/models/rows3/infer",
                                       _infer_body("x", "FP32", [4], [0.0, 1.0, 2.0, 3.0]))
    assert status == 500 and "stage 0 failed" in json.loads(payload)["error"]
    log = d.log_path.read_bytes()
    assert b"\x1b[" not in log and b"indices element out of data bounds" not in log, log[-2000:]


def test_a_body_declared_over_the_limit_is_refused_at_once(served):
    """Content-Length 16 GiB with 12 bytes sent: a 413 naming max_message_size before any body is read
    (it waited 5 s for the rest, then timed out)."""
    d, front, files = served
    host, port = front.hostport.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v2/models/cnn/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 17179869184\r\n\r\n{\"inputs\": [")
        s.settimeout(1.0)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        took_s = time.monotonic() - t0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and took_s < 1.0, (answer, took_s)
    assert "max_message_size" in json.loads(body)["error"] and "17179869184" in json.loads(body)["error"]
    assert front.request("GET", "/v2/health/live")[0] == 200   # and the front goes on


def test_unloaded_model_is_not_ready_until_loaded_again(served):
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport)
    x = np.zeros((1, 3, 32, 32), np.float32)
    inp = tritonhttp.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    with d.client() as mc:   # a second version, and both in memory: unload must take both out
        mc.add(files["cnn"], "cnn")
        mc.load("cnn", version=1)
        mc.load("cnn", version=2)
    c.unload_model("cnn")
    assert not c.is_model_ready("cnn") and not c.is_model_ready("cnn", "1") and c.is_model_ready("embed")
    status, _, payload = front.request("GET", "/v2/models/cnn/ready")
    assert status == 400 and "load" in json.loads(payload)["error"]
    index = {m["name"]: m for m in c.get_model_repository_index()}
    assert (index["cnn"]["state"], index["cnn"]["reason"]) == ("UNAVAILABLE", "unloaded")
    assert index["embed"]["state"] == "READY"
    with pytest.raises(InferenceServerException) as e:
        c.infer("cnn", [inp])
    assert int(e.value.status()) == 400 and "unloaded" in e.value.message()
    with d.client() as mc:   # no version of it stayed, or came back, in memory behind the front's back
        assert {m["version"]: m["tier"] for m in mc.list() if m["name"] == "cnn"} == {1: "disk", 2: "disk"}
    c.load_model("cnn")
    assert c.is_model_ready("cnn") and c.infer("cnn", [inp]).as_numpy("logits").shape == (1, 10)


def test_model_configuration_through_tritonclient(served):
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport)
    cfg = c.get_model_config("cnn")
    assert (cfg["name"], cfg["platform"], cfg["backend"], cfg["max_batch_size"]) == \
        ("cnn", "onnxruntime_onnx", "onnxruntime", 0)
    assert [(i["name"], i["data_type"], i["dims"]) for i in cfg["input"]] == [("input", "TYPE_FP32", [-1, 3, 32, 32])]
    assert [(o["name"], o["data_type"], o["dims"]) for o in cfg["output"]] == [("logits", "TYPE_FP32", [-1, 10])]
    assert c.get_model_config("cnn", "1") == cfg
    embed = c.get_model_config("embed")
    assert {i["name"]: i["data_type"] for i in embed["input"]} == {"ids": "TYPE_INT64", "mask": "TYPE_BOOL"}
    for args in (("nope",), ("cnn", "9")):
        with pytest.raises(InferenceServerException) as e:
            c.get_model_config(*args)
        assert int(e.value.status()) == 404
    assert {"model_configuration", "statistics"} <= set(c.get_server_metadata()["extensions"])


def test_statistics_through_tritonclient(served):
    """Counts and summed times from the daemon's engine; the unversioned infer reply says which version ran."""
    d, front, files = served
    c = tritonhttp.InferenceServerClient(front.hostport)
    [before] = c.get_inference_statistics("cnn")["model_stats"]
    assert (before["name"], before["version"], before["inference_count"], before["last_inference"]) == \
        ("cnn", "1", 0, 0)
    t0_ms = time.time() * 1e3
    for rows in (1, 2, 1):
        x = np.zeros((rows, 3, 32, 32), np.float32)
        inp = tritonhttp.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        assert c.infer("cnn", [inp]).get_response()["model_version"] == "1"
    status, _, _ = front.request("POST", "/v2/models/embed/infer", _infer_body(
        "ids", "INT64", [1, 2], [1, 500], mask=("BOOL", [1, 2], [True, True])))
    assert status == 400
    t1_ms = time.time() * 1e3
    [cnn] = c.get_inference_statistics("cnn")["model_stats"]
    s = cnn["inference_stats"]
    assert s["success"]["count"] == 3 and s["fail"]["count"] == 0 and cnn["inference_count"] == 4
    assert 1 <= cnn["execution_count"] <= 3
    batches = {b["batch_size"]: b["compute_infer"]["count"] for b in cnn["batch_stats"]}   # rows per execution
    assert sum(batches.values()) == cnn["execution_count"] and sum(k * n for k, n in batches.items()) == 4, batches
    assert 0 < s["compute_infer"]["ns"] <= s["success"]["ns"] and s["queue"]["ns"] <= s["success"]["ns"]
    assert t0_ms - 5 <= cnn["last_inference"] <= t1_ms + 5
    [one] = c.get_inference_statistics("cnn", "1")["model_stats"]
    # the moment itself, not "now less the idle time": two asks agree to the millisecond however slow the machine
    assert one["inference_stats"] == s and one["last_inference"] == cnn["last_inference"]
    every = {m["name"]: m for m in c.get_inference_statistics()["model_stats"]}
    assert set(every) == {"cnn", "embed"} and every["embed"]["inference_stats"]["fail"]["count"] == 1
    assert every["embed"]["inference_stats"]["success"]["count"] == 0
    for args in (("nope",), ("cnn", "9")):
        with pytest.raises(InferenceServerException) as e:
            c.get_inference_statistics(*args)
        assert int(e.value.status()) == 404


def test_unversioned_infer_reports_the_version_that_ran(served):
    d, front, files = served
    with d.client() as mc:
        mc.add(files["cnn"], "cnn")   # version 2
    x = np.zeros((1, 3, 32, 32), np.float32)
    body = _infer_body("input", "FP32", [1, 3, 32, 32], x.ravel().tolist())
    for path, version in (("/v2/models/cnn/infer", "2"), ("/v2/models/cnn/versions/1/infer", "1")):
        status, _, payload = front.request("POST", path, body)
        assert status == 200 and json.loads(payload)["model_version"] == version, payload
