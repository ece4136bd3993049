"""Stateful models served as Triton serves them (issue 44, part 4), against a real daemon that imported a Triton
repository, over both fronts with tritonclient: implicit state kept by the daemon between a sequence's
requests, equal to running each sequence alone in plain ORT; Triton's refusals; the idle timeout; what
metadata and ModelConfig say."""

from __future__ import annotations

import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import stop_cleanly
from test_triton_repo import put_model, start_importing

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

WIDTH = 4
RNN_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]
sequence_batching {
  oldest { max_candidate_sequences: 16 max_queue_delay_microseconds: 2000 }
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ]
  state [ { input_name: "h" output_name: "h_next" data_type: TYPE_FP32 dims: [ 4 ]
            initial_state { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true name: "zeros" } } ]
}
"""
IDLE_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 0
sequence_batching {
  max_sequence_idle_microseconds: 2000000
  state [ { input_name: "h" output_name: "h_next" data_type: TYPE_FP32 dims: [ 1, 4 ] } ]
  control_input [ { name: "START" control [ { kind: CONTROL_SEQUENCE_START fp32_false_true: [ 0, 1 ] } ] } ]
}
"""


def rnn(batched: bool) -> onnx.ModelProto:
    """h_next = tanh(x W + h U) (+ START, which a state starting at zeros must not need), y = sum(h_next)."""
    rng = np.random.default_rng(3)
    w, u = (numpy_helper.from_array(rng.normal(size=(WIDTH, WIDTH)).astype(np.float32) * 0.5, n) for n in "WU")
    f32 = lambda n, d: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", d] if batched else [1, d])  # noqa
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("MatMul", ["h", "U"], ["hu"]),
             helper.make_node("Add", ["xw", "hu"], ["pre"]), helper.make_node("Mul", ["START", "zero"], ["s0"]),
             helper.make_node("Add", ["pre", "s0"], ["pre1"]), helper.make_node("Tanh", ["pre1"], ["h_next"]),
             helper.make_node("MatMul", ["h_next", "ones"], ["y"])]
    zero = numpy_helper.from_array(np.zeros((1,), np.float32), "zero")
    ones = numpy_helper.from_array(np.ones((WIDTH, 1), np.float32), "ones")
    g = helper.make_graph(nodes, "rnn", [f32("x", WIDTH), f32("h", WIDTH), f32("START", 1)],
                          [f32("y", 1), f32("h_next", WIDTH)], initializer=[w, u, zero, ones])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("sequences")
    repo = root / "models"
    for name, model, config in (("rnn", rnn(True), RNN_CONFIG), ("rnn_idle", rnn(False), IDLE_CONFIG)):
        put_model(repo, name, model, config)
    d, grpc_at, http_at = start_importing(root, repo)
    try:
        assert "2 versions imported" in d.log_path.read_text(), d.log_path.read_text()[-3000:]
        yield {"daemon": d, "grpc": grpc_at, "http": http_at, "repo": repo}
    finally:
        stop_cleanly(d)


def infer(front: str, url: str, model: str, x: np.ndarray, **sequence):
    """One request with tritonclient: `y`, or the server's error."""
    mod = grpcclient if front == "grpc" else httpclient
    with mod.InferenceServerClient(url) as client:
        t = mod.InferInput("x", list(x.shape), "FP32")
        t.set_data_from_numpy(x)
        return client.infer(model, [t], **sequence).as_numpy("y")


def plain_ort(path, xs: list) -> list:
    """Each step's y for one sequence alone, in plain ORT, the state carried by hand."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    h, out = np.zeros((1, WIDTH), np.float32), []
    for k, x in enumerate(xs):
        y, h = sess.run(["y", "h_next"], {"x": x, "h": h, "START": np.full((1, 1), float(k == 0), np.float32)})
        out.append(y)
    return out


def test_a_thousand_requests_over_16_interleaved_sequences_equal_plain_ort(served):
    """16 sequences, each on its own client thread (8 over gRPC, 8 over HTTP), 1,000 requests in all, batched
    across sequences by the daemon; every step's output equals running that sequence alone in plain ORT."""
    rng = np.random.default_rng(0)
    lengths = [62] * 8 + [63] * 8          # 1,000
    inputs = {s: [rng.normal(size=(1, WIDTH)).astype(np.float32) for _ in range(n)] for s, n in enumerate(lengths)}
    got: dict = {}
    errors: list = []

    def run(s: int):
        front = "grpc" if s % 2 else "http"
        mod = grpcclient if front == "grpc" else httpclient
        seq_id = 5000 + s if s % 4 != 1 else f"user-{s}"      # uint64 ids, and string ids over gRPC
        try:
            with mod.InferenceServerClient(served[front]) as client:
                out = []
                for k, x in enumerate(inputs[s]):
                    t = mod.InferInput("x", [1, WIDTH], "FP32")
                    t.set_data_from_numpy(x)
                    r = client.infer("rnn", [t], sequence_id=seq_id, sequence_start=k == 0,
                                     sequence_end=k == len(inputs[s]) - 1)
                    out.append(r.as_numpy("y"))
                got[s] = out
        except Exception as e:   # (reported below, with the sequence)
            errors.append((s, e))

    threads = [threading.Thread(target=run, args=(s,)) for s in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    path = served["repo"] / "rnn" / "1" / "model.onnx"
    for s, xs in inputs.items():
        want = plain_ort(path, xs)
        assert len(got[s]) == len(want)
        for k, (a, b) in enumerate(zip(got[s], want)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"sequence {s}, step {k}")
    assert sum(len(v) for v in got.values()) == 1000
    with grpcclient.InferenceServerClient(served["grpc"]) as client:   # the same engine and metrics as every request
        stats = client.get_inference_statistics("rnn", as_json=True)["model_stats"][0]
    print(f"rnn: {stats['inference_count']} requests in {stats['execution_count']} runs")
    assert int(stats["inference_count"]) >= 1000
    assert int(stats["execution_count"]) < int(stats["inference_count"])   # sequences batched together


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_triton_refusals_over_both_fronts(served, front):
    url, x = served[front], np.ones((1, WIDTH), np.float32)
    with pytest.raises(InferenceServerException, match="must specify the START flag on the first request"):
        infer(front, url, "rnn", x, sequence_id=777)
    with pytest.raises(InferenceServerException, match="must specify a non-zero or non-empty correlation ID"):
        infer(front, url, "rnn", x)
    with pytest.raises(InferenceServerException, match="must specify batch-size 1"):
        infer(front, url, "rnn", np.ones((2, WIDTH), np.float32), sequence_id=778, sequence_start=True)
    # the daemon is still up, and a sequence still runs
    assert infer(front, url, "rnn", x, sequence_id=779, sequence_start=True, sequence_end=True).shape == (1, 1)


def test_a_control_input_sent_by_the_client_is_refused(served):
    mod = grpcclient
    with mod.InferenceServerClient(served["grpc"]) as client:
        a, b = mod.InferInput("x", [1, WIDTH], "FP32"), mod.InferInput("START", [1, 1], "FP32")
        a.set_data_from_numpy(np.ones((1, WIDTH), np.float32))
        b.set_data_from_numpy(np.ones((1, 1), np.float32))
        # (the configuration lists x alone: refused as Triton's core refuses an input it does not list)
        with pytest.raises(InferenceServerException, match="expected 1 inputs but got 2 inputs for model 'rnn'"):
            client.infer("rnn", [a, b], sequence_id=1, sequence_start=True)


def test_an_idle_sequence_ends_after_max_sequence_idle_microseconds(served):
    x = np.ones((1, WIDTH), np.float32)
    first = infer("http", served["http"], "rnn_idle", x, sequence_id=42, sequence_start=True)
    second = infer("http", served["http"], "rnn_idle", x, sequence_id=42)   # within 2 s: the state carried
    assert not np.allclose(first, second)
    time.sleep(3.0)   # (2 s idle, and the reaper runs on the next turn of the owner loop)
    with pytest.raises(InferenceServerException, match="sequence 42 to model 'rnn_idle' must specify the START"):
        infer("grpc", served["grpc"], "rnn_idle", x, sequence_id=42)
    assert "dropped after" in served["daemon"].log_path.read_text()


def test_metadata_and_config_say_what_triton_says(served):
    with grpcclient.InferenceServerClient(served["grpc"]) as client:
        meta = client.get_model_metadata("rnn", as_json=True)
        config = client.get_model_config("rnn", as_json=True)["config"]
        idle = client.get_model_config("rnn_idle", as_json=True)["config"]
    assert [i["name"] for i in meta["inputs"]] == ["x"] and [o["name"] for o in meta["outputs"]] == ["y"]
    sb = config["sequence_batching"]
    assert int(sb["max_sequence_idle_microseconds"]) == 1_000_000      # Triton's default, filled in
    assert [int(b) for b in sb["oldest"]["preferred_batch_size"]] == [8]
    assert int(idle["sequence_batching"]["max_sequence_idle_microseconds"]) == 2_000_000
    assert [i["name"] for i in idle["input"]] == ["x"]                  # auto-completed, without START and h


def test_a_grpc_stream_keeps_each_sequences_order(served):
    """Two sequences of 100 requests each, interleaved on one gRPC stream with no wait between them: the front
    sends them to the daemon in the order read (a request waiting on the way must not let the next one pass)."""
    import queue
    rng = np.random.default_rng(4)
    xs = {s: [rng.normal(size=(1, WIDTH)).astype(np.float32) for _ in range(100)] for s in (31, 32)}
    got: queue.Queue = queue.Queue()
    with grpcclient.InferenceServerClient(served["grpc"]) as client:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        for k in range(100):
            for s in (31, 32):
                t = grpcclient.InferInput("x", [1, WIDTH], "FP32")
                t.set_data_from_numpy(xs[s][k])
                client.async_stream_infer("rnn", [t], request_id=f"{s}_{k}", sequence_id=s, sequence_start=k == 0,
                                          sequence_end=k == 99)
        answers = [got.get(timeout=60) for _ in range(200)]
        client.stop_stream()
    assert not [e for _, e in answers if e is not None]
    outputs = {tuple(map(int, r.get_response().id.split("_"))): r.as_numpy("y") for r, _ in answers}
    path = served["repo"] / "rnn" / "1" / "model.onnx"
    for s in (31, 32):
        for k, want in enumerate(plain_ort(path, xs[s])):
            np.testing.assert_allclose(outputs[(s, k)], want, rtol=1e-5, atol=1e-6, err_msg=f"sequence {s}, step {k}")
