"""Triton ensembles whose steps are ONNX models (issue 44, part 5): the wiring checked (no daemon), then a real
daemon that imported a Triton repository with an ensemble of three steps (two in parallel, then one that takes
both) and an ensemble with a Python-backend step: outputs equal to plain ORT running the steps by hand, over
both fronts; each step batched with its model's own requests; the skipped ensemble's one line; metadata,
config and the index as Triton answers; the ensemble kept across a restart and removed by `modelcache rm`."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import stop_cleanly, wait_until
from modelcache.errors import InputError
from modelcache.executor.ensemble import Ensemble
from test_triton_repo import put_model, start_importing

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


def step(model: str, inputs: dict, outputs: dict) -> dict:
    return {"model_name": model, "model_version": -1, "input_map": inputs, "output_map": outputs}


def ensemble_config(steps: list) -> dict:
    return {"platform": "ensemble", "input": [{"name": "RAW"}], "output": [{"name": "OUT"}],
            "ensemble_scheduling": {"step": steps}}


def test_the_wiring_is_checked():
    ok = Ensemble.of("e", 1, ensemble_config([step("b", {"x": "mid"}, {"y": "OUT"}),
                                               step("a", {"x": "RAW"}, {"y": "mid"})]))
    assert [s.model for s in ok.order()] == ["a", "b"]           # in the order their tensors allow
    assert ok.version == 1 and Ensemble.of("e", 3, ok.config).version == 3   # (not a step's model_version)
    with pytest.raises(InputError, match="takes ensemble tensor 'nowhere'"):
        Ensemble.of("e", 1, ensemble_config([step("a", {"x": "nowhere"}, {"y": "OUT"})]))
    with pytest.raises(InputError, match="output 'OUT' is made by no step"):
        Ensemble.of("e", 1, ensemble_config([step("a", {"x": "RAW"}, {"y": "mid"})]))
    with pytest.raises(InputError, match="'mid' is made twice"):
        Ensemble.of("e", 1, ensemble_config([step("a", {"x": "RAW"}, {"y": "mid"}),
                                              step("b", {"x": "RAW"}, {"y": "mid"}),
                                              step("c", {"x": "mid"}, {"y": "OUT"})]))
    with pytest.raises(InputError, match="wait on each other"):
        Ensemble.of("e", 1, ensemble_config([step("a", {"x": "RAW", "z": "loop"}, {"y": "OUT"}),
                                              step("b", {"x": "OUT"}, {"y": "loop"})]))


# -- against a daemon --------------------------------------------------------------------------------------------

def linear(name: str, n_in: int, n_out: int, seed: int, activation: str | None = None,
           second_input: bool = False) -> onnx.ModelProto:
    """y = act(x W) (+ z, with second_input), [batch, n] each."""
    w = numpy_helper.from_array(np.random.default_rng(seed).normal(size=(n_in, n_out)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw" if activation or second_input else "y"])]
    last = "xw"
    if second_input:
        nodes.append(helper.make_node("Add", ["xw", "z"], ["y" if not activation else "s"]))
        last = "s"
    if activation:
        nodes.append(helper.make_node(activation, [last], ["y"]))
    io = lambda n, d: helper.make_tensor_value_info(n, TensorProto.FLOAT, ["b", d])   # noqa: E731
    inputs = [io("x", n_in)] + ([io("z", n_out)] if second_input else [])
    g = helper.make_graph(nodes, name, inputs, [io("y", n_out)], initializer=[w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


STEP_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {n_in} ] }} {extra} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {n_out} ] }} ]
"""
ENSEMBLE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 6 ] } ]
output [ { name: "PROB" data_type: TYPE_FP32 dims: [ 3 ] }, { name: "FEATURES" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "embed" model_version: -1 input_map { key: "x" value: "RAW" } output_map { key: "y" value: "FEATURES" } },
    { model_name: "skip" model_version: -1 input_map { key: "x" value: "RAW" } output_map { key: "y" value: "shortcut" } },
    { model_name: "head" model_version: 1
      input_map [ { key: "x" value: "FEATURES" }, { key: "z" value: "shortcut" } ]
      output_map { key: "y" value: "PROB" } }
  ]
}
"""
WITH_PYTHON = """
platform: "ensemble"
max_batch_size: 8
input [ { name: "RAW" data_type: TYPE_FP32 dims: [ 6 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "preprocess" model_version: -1 input_map { key: "IN" value: "RAW" } output_map { key: "OUT" value: "pre" } },
  { model_name: "embed" model_version: -1 input_map { key: "x" value: "pre" } output_map { key: "y" value: "OUT" } }
] }
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("ensembles")
    repo = root / "models"
    steps = {"embed": (linear("embed", 6, 4, 1, "Relu"), 6, 4, ""),
             "skip": (linear("skip", 6, 3, 2), 6, 3, ""),
             "head": (linear("head", 4, 3, 3, "Softmax", second_input=True), 4, 3,
                      ', { name: "z" data_type: TYPE_FP32 dims: [ 3 ] }')}
    for name, (model, n_in, n_out, extra) in steps.items():
        put_model(repo, name, model, STEP_CONFIG.format(n_in=n_in, n_out=n_out, extra=extra))
    for name, config in (("pipeline", ENSEMBLE), ("with_python", WITH_PYTHON)):
        put_model(repo, name, None, config)
    put_model(repo, "preprocess", None, 'backend: "python"\n')
    (repo / "preprocess" / "1" / "model.py").write_text("# a Python backend model\n")
    d, grpc_at, http_at = start_importing(root, repo)
    try:
        yield {"daemon": d, "grpc": grpc_at, "http": http_at, "repo": repo, "root": root}
    finally:
        if d.proc is not None and d.proc.poll() is None:
            stop_cleanly(d)


def by_hand(repo, raw: np.ndarray) -> dict:
    """The pipeline's outputs, each step run in plain ORT and wired by hand."""
    run = lambda name, feeds: ort.InferenceSession(str(repo / name / "1" / "model.onnx")).run(None, feeds)[0]  # noqa
    features = run("embed", {"x": raw})
    shortcut = run("skip", {"x": raw})
    return {"FEATURES": features, "PROB": run("head", {"x": features, "z": shortcut})}


def test_the_import_says_what_it_did_with_each_ensemble(served):
    log = served["daemon"].log_path.read_text()
    assert "pipeline: imported ensemble version 1 (embed -> skip -> head)" in log
    line = next(x for x in log.splitlines() if x.startswith("with_python:"))
    assert line == ("with_python: skipped: its step 'preprocess' is a Python backend model (backend python); "
                    "modelcache serves ensembles whose steps are all ONNX models")


@pytest.mark.parametrize("front", ["grpc", "http"])
def test_an_ensemble_answers_as_its_steps_run_by_hand(served, front):
    mod = grpcclient if front == "grpc" else httpclient
    raw = np.random.default_rng(5).normal(size=(3, 6)).astype(np.float32)
    with mod.InferenceServerClient(served[front]) as client:
        t = mod.InferInput("RAW", [3, 6], "FP32")
        t.set_data_from_numpy(raw)
        r = client.infer("pipeline", [t])
        only = client.infer("pipeline", [t], outputs=[mod.InferRequestedOutput("PROB")])
        with pytest.raises(InferenceServerException, match="unknown output 'shortcut'"):   # (inner tensors stay in)
            client.infer("pipeline", [t], outputs=[mod.InferRequestedOutput("shortcut")])
    want = by_hand(served["repo"], raw)
    for name in ("PROB", "FEATURES"):
        np.testing.assert_allclose(r.as_numpy(name), want[name], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(only.as_numpy("PROB"), want["PROB"], rtol=1e-5, atol=1e-6)
    assert only.as_numpy("FEATURES") is None


def test_a_steps_error_is_the_ensembles_answer_and_the_daemon_stays_up(served):
    with grpcclient.InferenceServerClient(served["grpc"]) as client:
        t = grpcclient.InferInput("RAW", [1, 5], "FP32")    # a row of 5 where embed takes 6
        t.set_data_from_numpy(np.ones((1, 5), np.float32))
        with pytest.raises(InferenceServerException, match="INVALID_ARGUMENT.*pipeline: step 'embed'"):
            client.infer("pipeline", [t])
        assert client.is_model_ready("pipeline")


def test_each_step_batches_with_its_models_own_requests(served):
    """Ensemble requests and direct requests to one of its steps, at once from 8 threads: the step model runs
    fewer times than it has requests."""
    rng = np.random.default_rng(9)
    errors = []

    def client_thread(k: int):
        try:
            with grpcclient.InferenceServerClient(served["grpc"]) as client:
                for _ in range(25):
                    x = rng.normal(size=(1, 6)).astype(np.float32)
                    t = grpcclient.InferInput("RAW" if k % 2 else "x", [1, 6], "FP32")
                    t.set_data_from_numpy(x)
                    client.infer("pipeline" if k % 2 else "embed", [t])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:2]
    with grpcclient.InferenceServerClient(served["grpc"]) as client:
        stats = client.get_inference_statistics("embed", as_json=True)["model_stats"][0]
    assert int(stats["inference_count"]) >= 200
    assert int(stats["execution_count"]) < int(stats["inference_count"])


def test_metadata_config_and_index_say_what_triton_says(served):
    with grpcclient.InferenceServerClient(served["grpc"]) as client:
        meta = client.get_model_metadata("pipeline", as_json=True)
        config = client.get_model_config("pipeline", as_json=True)["config"]
        index = {m["name"]: m for m in client.get_model_repository_index(as_json=True)["models"]}
    assert meta["platform"] == "ensemble" and [i["name"] for i in meta["inputs"]] == ["RAW"]
    assert [o["name"] for o in meta["outputs"]] == ["PROB", "FEATURES"]
    assert [o["shape"] for o in meta["outputs"]] == [["-1", "3"], ["-1", "4"]]
    assert config["platform"] == "ensemble" and len(config["ensemble_scheduling"]["step"]) == 3
    # The skipped ensemble: listed by its name alone, as Triton lists a model of its repository it has not loaded
    assert index["pipeline"]["state"] == "READY" and index["with_python"] == {"name": "with_python"}


def test_an_ensemble_survives_a_restart_and_rm_removes_it(served):
    d = served["daemon"]
    stop_cleanly(d)
    d.start()
    # (the import at start runs again and finds it unchanged; removing it before then would race it)
    wait_until(lambda: d.log_path.read_text().count("versions imported") >= 2, 120, "the import at restart")
    assert "pipeline@1: unchanged, not imported again" in d.log_path.read_text()
    with d.client() as c:
        assert c.describe("pipeline").model_config["platform"] == "ensemble"
        assert any(m["name"] == "pipeline" and m["tier"] == "ensemble" for m in c.list())
        c.remove("pipeline", 1)
        assert not any(m["name"] == "pipeline" for m in c.list())
    assert not list((served["root"] / "repo" / ".ensembles").glob("pipeline@*"))
