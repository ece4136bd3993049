"""A Triton model repository imported as it is (`modelcache import-triton`, the daemon's triton_repository).

First the pure parts on repositories written here: config.pbtxt parsed against Triton's model_config.proto,
auto-completed where absent, checked against the ONNX model, mapped onto batching; the dynamic batcher's
preferred sizes. Then one daemon that imports a repository at start (zoo models with configs as Triton's
docs write them, a TensorRT entry, a broken model, a model whose second version ORT cannot build) and serves
it over HTTP and gRPC with each model's own batching.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from modelcache import zoo
from modelcache.calibration import check_serving
from modelcache.errors import InputError
from modelcache.executor.batching import Dynamic, Pending
from modelcache.store.packing import model_io
from modelcache.triton_repo.config import NotOnnx, config_to_json, plan_model, read_config

from conftest import DaemonProcess, stop_cleanly, wait_until

# As Triton's model_configuration.md writes them: a batching ONNX model with the dynamic batcher and two CPU
# instances, and the optimization block its ONNX Runtime section shows
CNN_CONFIG = """
name: "cnn"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest: { num_versions: 2 } }
input [
  {
    name: "input"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 32, 32 ]
  }
]
output [
  {
    name: "logits"
    data_type: TYPE_FP32
    dims: [ 10 ]
  }
]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 200000
}
instance_group [
  {
    count: 2
    kind: KIND_CPU
  }
]
optimization { execution_accelerators {
  cpu_execution_accelerator : [ {
    name : "openvino"
  } ]
}}
"""
# Triton's model_warmup: two runs of a batch of 2 zero rows, and one of a row from the model's warmup/ folder.
WARM_CONFIG = """
backend: "onnxruntime"
max_batch_size: 4
model_warmup [
  { name: "zeros" batch_size: 2 count: 2
    inputs { key: "input" value { data_type: TYPE_FP32 dims: [ 3, 32, 32 ] zero_data: true } } },
  { name: "a row" batch_size: 1
    inputs { key: "input" value { data_type: TYPE_FP32 dims: [ 3, 32, 32 ] input_data_file: "row.bin" } } }
]
optimization { graph { level: -1 } }
"""
TRT_CONFIG = """
platform: "tensorrt_plan"
max_batch_size: 8
input [ { name: "input0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "output0" data_type: TYPE_FP32 dims: [ 16 ] } ]
"""


def save(model, path: Path) -> str:
    """A zoo model (by name) or a hand-built one, at `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(model, str):
        zoo.save(zoo.build(model), str(path))
    else:
        onnx.save(model, str(path))
    return str(path)


def fixed_batch_model() -> onnx.ModelProto:
    """Identity over a [1, 4] tensor: its first dimension is fixed, so it cannot batch."""
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def unbuildable_cnn() -> onnx.ModelProto:
    """tiny-cnn's inputs and outputs around an op no runtime has: it reads as ONNX, and ORT refuses it."""
    g = helper.make_graph([helper.make_node("NoSuchOp", ["input"], ["logits"], domain="no.such")], "g",
                          [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 32, 32])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("no.such", 1)])


def write_repository(root: Path) -> Path:
    """The repository the daemon imports: what a Triton user has."""
    for v in (1, 2, 3):   # latest 2: versions 2 and 3
        (root / "cnn" / str(v)).mkdir(parents=True)
        zoo.save(zoo.build("tiny-cnn", seed=v), str(root / "cnn" / str(v) / "model.onnx"))
    (root / "cnn" / "config.pbtxt").write_text(CNN_CONFIG)
    save("tiny-embed", root / "embed" / "1" / "model.onnx")          # no config.pbtxt: auto-completed
    (root / "trt" / "1").mkdir(parents=True)
    (root / "trt" / "1" / "model.plan").write_bytes(b"\0" * 64)        # a TensorRT engine (not ONNX)
    (root / "trt" / "config.pbtxt").write_text(TRT_CONFIG)
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "model.onnx").write_bytes(b"not a model at all")
    save("tiny-cnn", root / "half" / "1" / "model.onnx")              # version 2 fails in ORT: no half import
    save(unbuildable_cnn(), root / "half" / "2" / "model.onnx")
    (root / "half" / "config.pbtxt").write_text('backend: "onnxruntime"\nversion_policy: { all { } }\n')
    save("tiny-cnn", root / "warm" / "1" / "model.onnx")
    (root / "warm" / "config.pbtxt").write_text(WARM_CONFIG)
    (root / "warm" / "warmup").mkdir()
    (root / "warm" / "warmup" / "row.bin").write_bytes(np.full((3, 32, 32), 0.5, np.float32).tobytes())
    return root


# -- planning a model directory, no daemon ---------------------------------------------------

def test_a_config_as_triton_documents_it(tmp_path):
    repo = write_repository(tmp_path / "models")
    plan = plan_model(repo / "cnn", model_io)
    assert [v for v, _ in plan.versions] == [2, 3]
    assert plan.serving == {"policy": "dynamic", "max_batch": 8, "max_queue_delay_ms": 200.0,
                            "preferred_batch_sizes": [4, 8], "device": "cpu"}
    check_serving(plan.serving)
    assert plan.not_honoured == ["instance_group.count", "optimization.execution_accelerators"]
    assert plan.opt_level is None   # (no graph level: the daemon's opt_level setting)
    c = plan.config
    assert (c["name"], c["platform"], c["backend"], c["max_batch_size"]) == ("cnn", "onnxruntime_onnx",
                                                                           "onnxruntime", 8)
    assert c["input"][0]["dims"] == [3, 32, 32] and c["input"][0]["data_type"] == "TYPE_FP32"
    db = c["dynamic_batching"]
    assert (db["preferred_batch_size"], db["max_queue_delay_microseconds"]) == ([4, 8], 200000)
    json.dumps(c)   # stored in the manifest as it is


def test_the_intra_op_thread_count_parameter_bounds_the_models_threads_and_others_are_listed_by_key(tmp_path):
    save("tiny-cnn", tmp_path / "p" / "1" / "model.onnx")
    config = tmp_path / "p" / "config.pbtxt"

    def params(**kv):
        return "max_batch_size: 8\n" + "".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n'
                                               for k, v in kv.items())
    config.write_text(params(intra_op_thread_count="1", inter_op_thread_count="2", enable_mem_arena="0"))
    plan = plan_model(tmp_path / "p", model_io)
    assert plan.serving["intra_op_threads"] == 1
    assert plan.not_honoured == ["parameters.enable_mem_arena", "parameters.inter_op_thread_count"]
    check_serving(plan.serving)
    config.write_text(params(intra_op_thread_count="0"))   # the backend's default: every core
    assert "intra_op_threads" not in plan_model(tmp_path / "p", model_io).serving
    config.write_text(params(intra_op_thread_count="two"))
    with pytest.raises(InputError, match="parameters intra_op_thread_count 'two': give a whole number"):
        plan_model(tmp_path / "p", model_io)


@pytest.mark.parametrize("level, opt_level", [(-1, "basic"), (0, "all"), (1, "extended"), (2, "disable"), (7, "all")])
def test_the_graph_optimization_level_is_the_one_the_model_is_packed_with(tmp_path, level, opt_level):
    save("tiny-cnn", tmp_path / "g" / "1" / "model.onnx")
    (tmp_path / "g" / "config.pbtxt").write_text(f"max_batch_size: 8\noptimization {{ graph {{ level: {level} }} }}")
    plan = plan_model(tmp_path / "g", model_io)
    assert plan.opt_level == opt_level and plan.not_honoured == []


def test_a_queue_policy_bounds_the_models_queue_and_a_delay_action_delays(tmp_path):
    save("tiny-cnn", tmp_path / "q" / "1" / "model.onnx")
    policy = "max_queue_size: 4 default_timeout_microseconds: 3000 allow_timeout_override: true"
    (tmp_path / "q" / "config.pbtxt").write_text(f"max_batch_size: 8\ndynamic_batching {{ default_queue_policy {{ {policy} }} }}")
    plan = plan_model(tmp_path / "q", model_io)
    assert (plan.serving["max_queue"], plan.serving["queue_timeout_ms"]) == (4, 3.0) and plan.not_honoured == []
    check_serving(plan.serving)
    assert "at most 4 queued, 3000 us in the queue" in plan.batching_text()
    assert plan.config["dynamic_batching"]["default_queue_policy"]["max_queue_size"] == 4   # ModelConfig says it
    # DELAY: a request past its queue timeout runs later, behind the others (executor/queues.py)
    (tmp_path / "q" / "config.pbtxt").write_text(
        "max_batch_size: 8\ndynamic_batching { default_queue_policy { timeout_action: DELAY "
        "default_timeout_microseconds: 3000 } }")
    plan = plan_model(tmp_path / "q", model_io)
    assert plan.serving["queue_timeout_ms"] == 3.0 and plan.serving["queue_delay"] is True
    assert "max_queue" not in plan.serving and plan.not_honoured == []
    assert "3000 us in the queue (then delayed)" in plan.batching_text()


def test_priority_levels_and_their_queue_policies_are_imported_and_checked_as_triton_checks_them(tmp_path):
    save("tiny-cnn", tmp_path / "p" / "1" / "model.onnx")
    config = tmp_path / "p" / "config.pbtxt"
    levels = ("priority_levels: 3 default_priority_level: 2 priority_queue_policy { key: 1 value { max_queue_size: 2 "
              "} } priority_queue_policy { key: 3 value { default_timeout_microseconds: 1000 timeout_action: DELAY } }")
    config.write_text(f"max_batch_size: 8\ndynamic_batching {{ {levels} }}")
    plan = plan_model(tmp_path / "p", model_io)
    assert (plan.serving["priority_levels"], plan.serving["default_priority"]) == (3, 2) and plan.not_honoured == []
    assert plan.serving["priority_queues"] == {"1": {"max_queue": 2},
                                               "3": {"queue_timeout_ms": 1.0, "queue_delay": True}}
    check_serving(plan.serving)
    assert "3 priority levels (default 2)" in plan.batching_text()
    for wrong, words in (("priority_levels: 2 default_priority_level: 3", r"default priority level must be in range "
                          r"\[1, 2\] for p"),
                         ("priority_levels: 2", r"default priority level must be in range \[1, 2\] for p"),
                         ("priority_levels: 2 default_priority_level: 1 priority_queue_policy { key: 5 value { } }",
                          r"priority queue policy must have priority level in range \[1, 2\] for p")):
        config.write_text(f"max_batch_size: 8\ndynamic_batching {{ {wrong} }}")
        with pytest.raises(InputError, match=words):
            plan_model(tmp_path / "p", model_io)


def test_absent_config_is_auto_completed_as_triton_does(tmp_path):
    repo = write_repository(tmp_path / "models")
    plan = plan_model(repo / "embed", model_io)
    c = plan.config
    assert c["max_batch_size"] == 4 and "dynamic_batching" in c   # Triton's default-max-batch-size
    assert [(t["name"], t["data_type"], t["dims"]) for t in c["input"]] == [("ids", "TYPE_INT64", [-1]),
                                                                            ("mask", "TYPE_BOOL", [-1])]
    assert plan.serving["policy"] == "dynamic" and plan.serving["max_batch"] == 4
    assert plan.completed[0] == "no config.pbtxt" and plan.not_honoured == []
    # what Triton's core fills into every configuration (model_config_utils.cc): the file, an instance group
    assert c["default_model_filename"] == "model.onnx"
    assert c["instance_group"] == [{"name": "embed", "kind": "KIND_CPU", "count": 2, "gpus": [],
                                    "secondary_devices": [], "profile": [], "passive": False, "host_policy": ""}]
    assert "device" not in plan.serving        # (filled in, not asked for: the model may still run on a GPU)
    cnn = plan_model(repo / "cnn", model_io).config   # a group given without a name gets model_<i>
    assert [(g["name"], g["kind"], g["count"]) for g in cnn["instance_group"]] == [("cnn_0", "KIND_CPU", 2)]
    # a model whose first dim is fixed cannot batch: whole shapes, max_batch_size 0, serial
    save(fixed_batch_model(), tmp_path / "models" / "fixed" / "1" / "model.onnx")
    fixed = plan_model(tmp_path / "models" / "fixed", model_io)
    assert fixed.config["max_batch_size"] == 0 and fixed.config["input"][0]["dims"] == [1, 4]
    assert fixed.serving == {"policy": "serial", "max_batch": 0}


@pytest.mark.parametrize("config, words", [
    ('max_batch_size: 8\ninput [{ name: "input" data_type: TYPE_FP32 dims: [3, 64, 64] }]\n'
     'output [{ name: "logits" data_type: TYPE_FP32 dims: [10] }]',
     ["config.pbtxt input 'input' is TYPE_FP32 [-1, 3, 64, 64]", "m/1/model.onnx has float32 [-1, 3, 32, 32]",
      "dims differ"]),
    ('max_batch_size: 8\ninput [{ name: "input" data_type: TYPE_FP16 dims: [3, 32, 32] }]',
     ["TYPE_FP16", "float32", "types differ"]),
    ('max_batch_size: 8\ninput [{ name: "image" data_type: TYPE_FP32 dims: [3, 32, 32] }]',
     ["inputs ['image']", "['input']", "no input 'image' in the model"]),
    ('output [{ name: "probs" data_type: TYPE_FP32 dims: [-1, 10] }]', ["output 'probs'", "its outputs: ['logits']"]),
    ('name: "other"', ["names the model 'other'", "directory is 'm'"]),
    ('max_batch_size: 2\ndynamic_batching { preferred_batch_size: [4] }', ["preferred_batch_size 4"]),
    ('platform: "onnxruntime_onnx"\nbackend: "pytorch"', ["disagree"]),
    ('version_policy: { specific: { versions: [5] } }', ["version 5"]),
    ('max_batch_size: 8\ninput [ { name: "input" ', ["m/config.pbtxt:3:17: Expected \"}\"."]),
])
def test_a_config_the_model_contradicts_is_refused_naming_both(tmp_path, config, words):
    save("tiny-cnn", tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "config.pbtxt").write_text(f'backend: "onnxruntime"\n{config}'
                                                 if "backend" not in config and "platform" not in config else config)
    with pytest.raises(InputError) as e:
        plan_model(tmp_path / "m", model_io)
    text = str(e.value)
    assert text.startswith("m: ") and "\n" not in text
    for w in words:
        assert w in text, text


def test_a_fixed_first_dim_cannot_take_a_max_batch_size(tmp_path):
    save(fixed_batch_model(), tmp_path / "m" / "1" / "model.onnx")
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 4\n'
                                                 'input [{ name: "x" data_type: TYPE_FP32 dims: [4] }]')
    with pytest.raises(InputError, match="first dimension is fixed, so it cannot batch; set max_batch_size: 0"):
        plan_model(tmp_path / "m", model_io)


def test_version_policies(tmp_path):
    for v in (1, 2, 3):
        save("tiny-cnn", tmp_path / "m" / str(v) / "model.onnx")
    config = tmp_path / "m" / "config.pbtxt"
    for policy, versions in (("", [3]), ("version_policy: { latest: { num_versions: 2 } }", [2, 3]),
                             ("version_policy: { all: {} }", [1, 2, 3]),
                             ("version_policy: { specific: { versions: [1, 3] } }", [1, 3])):
        config.write_text(f'platform: "onnxruntime_onnx"\n{policy}')
        assert [v for v, _ in plan_model(tmp_path / "m", model_io).versions] == versions, policy


def test_other_backends_are_skipped_with_one_line(tmp_path):
    repo = write_repository(tmp_path / "models")
    with pytest.raises(NotOnnx) as e:
        plan_model(repo / "trt", model_io)
    assert str(e.value) == "trt: skipped: a TensorRT plan (platform tensorrt_plan); modelcache serves ONNX models only"
    for file, words in (("model.pt", "a TorchScript model (model.pt"), ("model.py", "a Python backend model")):
        (tmp_path / file / "1").mkdir(parents=True)
        (tmp_path / file / "1" / file).write_bytes(b"x")
        with pytest.raises(NotOnnx, match=words.replace("(", r"\(")):
            plan_model(tmp_path / file, model_io)
    (tmp_path / "py").mkdir()
    (tmp_path / "py" / "config.pbtxt").write_text('backend: "python"')
    with pytest.raises(NotOnnx, match=r"a Python backend model \(backend python\)"):
        plan_model(tmp_path / "py", model_io)


def test_json_keeps_int64s_as_numbers(tmp_path):
    (tmp_path / "config.pbtxt").write_text(CNN_CONFIG)
    d = config_to_json(read_config(tmp_path))
    assert d["input"][0]["dims"] == [3, 32, 32] and d["dynamic_batching"]["max_queue_delay_microseconds"] == 200000
    assert (d["instance_group"][0]["count"], d["instance_group"][0]["kind"]) == (2, "KIND_CPU")


def test_the_dynamic_batcher_takes_a_preferred_size_at_once():
    """Triton's preferred_batch_size: a queue that fills a preferred size runs now, not after the delay."""
    b = Dynamic(max_batch=8, max_queue_delay_s=0.2, preferred=(4, 8))
    queue = [Pending(k, 1, arrival=0.0) for k in range(3)]
    assert b.decide(0.01, queue).take == [] and b.decide(0.01, queue).wait_until == pytest.approx(0.2)
    queue.append(Pending(3, 1, arrival=0.01))
    assert b.decide(0.01, queue).take == [0, 1, 2, 3]
    two = [Pending(0, 2, 0.0), Pending(1, 3, 0.0)]   # 5 rows: no preferred size fits exactly; wait
    assert b.decide(0.05, two).take == []
    assert b.decide(0.2, two).take == [0, 1]          # the delay is up: what there is
    with pytest.raises(ValueError, match="policy"):
        check_serving({"policy": "layer"})
    with pytest.raises(ValueError, match="unknown field"):
        check_serving({"max_batch": 8, "priority": 2})


# -- a daemon that imports a repository at start and serves it over both protocols ---------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


IMPORT_DONE = "models skipped (not ONNX), "   # the import's last line: "<repo>: N versions imported, ... N refused"


def put_model(repo: Path, name: str, model: onnx.ModelProto | None, config: str) -> None:
    """`repo/name/config.pbtxt`, and `repo/name/1/model.onnx` (an empty version directory for None: an ensemble)."""
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    if model is not None:
        onnx.save(model, str(repo / name / "1" / "model.onnx"))
    (repo / name / "config.pbtxt").write_text(config)


def start_importing(root: Path, repo: Path, extra_env: dict | None = None) -> tuple[DaemonProcess, str, str]:
    """(daemon, gRPC host:port, HTTP host:port): a daemon with both fronts that imported the Triton repository
    `repo` at start, once the import's last line is in its log. The caller stops it (stop_cleanly)."""
    ports = {"grpc": free_port(), "http": free_port()}
    d = DaemonProcess(root, extra_env={"MODELCACHE_TRITON_REPOSITORY": str(repo),
                                       "MODELCACHE_GRPC_PORT": str(ports["grpc"]),
                                       "MODELCACHE_HTTP_PORT": str(ports["http"]), **(extra_env or {})}).start()
    try:
        wait_until(lambda: IMPORT_DONE in d.log_path.read_text(), 180, "the import at start")
    except BaseException:
        stop_cleanly(d)
        raise
    return d, f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['http']}"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(daemon, triton repository, gRPC host:port, HTTP host:port): the daemon imported the repository at start."""
    root = tmp_path_factory.mktemp("triton")
    repo = write_repository(root / "models")
    d, grpc_at, http_at = start_importing(root, repo)
    try:
        yield d, repo, grpc_at, http_at
    finally:
        stop_cleanly(d)


def test_the_import_at_start_says_what_it_did(imported):
    d, repo, _, _ = imported
    log = d.log_path.read_text()
    assert "cnn: imported versions 2, 3 (dynamic batching up to 8, 200000 us delay, preferred 4, 8, CPU only)" in log
    assert "warning: cnn: config.pbtxt fields modelcache does not honour (served as if absent): " \
           "instance_group.count, optimization.execution_accelerators" in log
    assert "embed: imported version 1 (dynamic batching up to 4, 0 us delay; auto-completed: no config.pbtxt" in log
    assert "trt: skipped: a TensorRT plan (platform tensorrt_plan); modelcache serves ONNX models only" in log
    assert "broken: version 1: " in log and "is not a valid ONNX model" in log
    half = next(line for line in log.splitlines() if line.startswith("half"))
    assert half.startswith("half@2: ONNX Runtime cannot load") and half.endswith(
        "not imported (version 1, added before it, removed)"), half
    assert f"{repo}: 4 versions imported, 0 unchanged, 1 models skipped (not ONNX), 2 refused" in log
    with d.client() as c:
        have = sorted((m["name"], m["version"]) for m in c.listing().models)
    assert have == [("cnn", 2), ("cnn", 3), ("embed", 1), ("warm", 1)]   # no half of `half`, nothing of broken or trt


def test_a_model_with_warmup_is_warmed_as_it_is_added_and_its_warmup_is_not_counted(imported):
    """Triton's model_warmup: run once the model is added, before any request (three runs: the zeros twice, the
    file's row once); the model is in memory then, and its statistics count no request."""
    import tritonclient.grpc as grpcclient
    d, repo, grpc_at, _ = imported
    wait_until(lambda: "warm@1: warmed up: 3 runs" in d.log_path.read_text(), 60, "the warm-up")
    log = d.log_path.read_text()
    assert "warm: imported version 1 (dynamic batching up to 4, 0 us delay, 2 warm-up samples" in log, log
    assert "warning: warm:" not in log   # (model_warmup is carried out, not listed)
    with d.client() as c:
        [warm] = [m for m in c.listing().models if m["name"] == "warm"]
        assert warm["tier"] != "disk", warm   # promoted by its warm-up
        assert warm["opt_level"] == "basic"   # its optimization { graph { level: -1 } }, as Triton's ORT backend reads it
        assert {m["opt_level"] for m in c.listing().models if m["name"] == "cnn"} == {"all"}   # the setting's
    client = grpcclient.InferenceServerClient(grpc_at)
    try:
        [before] = client.get_inference_statistics("warm").model_stats
        assert (before.inference_count, before.execution_count, len(before.batch_stats)) == (0, 0, 0)
        x = np.random.default_rng(3).standard_normal((1, 3, 32, 32)).astype(np.float32)
        i = grpcclient.InferInput("input", [1, 3, 32, 32], "FP32")
        i.set_data_from_numpy(x)
        want = ort.InferenceSession(str(repo / "warm" / "1" / "model.onnx")).run(None, {"input": x})[0]
        np.testing.assert_allclose(client.infer("warm", [i]).as_numpy("logits"), want, rtol=1e-4, atol=1e-5)
        [after] = client.get_inference_statistics("warm").model_stats
        assert (after.inference_count, after.execution_count) == (1, 1)
        client.unload_model("warm")   # the repository API's load warms it again, as Triton's does
        client.load_model("warm")
        wait_until(lambda: d.log_path.read_text().count("warm@1: warmed up: 3 runs") == 2, 60, "the warm-up at load")
    finally:
        client.close()


def test_both_protocols_answer_model_config_with_what_was_imported(imported):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    _, repo, grpc_at, http_at = imported
    hc, gc = httpclient.InferenceServerClient(http_at), grpcclient.InferenceServerClient(grpc_at)
    try:
        from modelcache.triton_repo.config import plan_model as plan
        want = plan(repo / "cnn", model_io).config
        assert hc.get_model_config("cnn") == want
        got = gc.get_model_config("cnn").config
        assert got.max_batch_size == 8 and list(got.dynamic_batching.preferred_batch_size) == [4, 8]
        assert got.dynamic_batching.max_queue_delay_microseconds == 200000 and list(got.input[0].dims) == [3, 32, 32]
        assert got.instance_group[0].kind == got.instance_group[0].KIND_CPU
        assert hc.get_model_config("embed")["max_batch_size"] == 4
        assert gc.get_model_metadata("cnn").versions == ["2", "3"]
    finally:
        hc.close()
        gc.close()


def test_served_with_the_configs_batching(imported):
    """Eight concurrent gRPC requests within the config's 200 ms delay run as preferred batches of 4 or 8;
    a request over max_batch_size is refused as Triton refuses it; the outputs are ORT's."""
    import asyncio

    import tritonclient.grpc as grpcclient
    import tritonclient.grpc.aio as grpcaio
    _, repo, grpc_at, http_at = imported
    xs = [np.random.default_rng(k).standard_normal((1, 3, 32, 32)).astype(np.float32) for k in range(8)]

    def inp(x):
        i = grpcclient.InferInput("input", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        return i

    async def concurrently():
        async with grpcaio.InferenceServerClient(grpc_at) as c:
            before = (await c.get_inference_statistics("cnn", "3")).model_stats[0]
            results = await asyncio.gather(*(c.infer("cnn", [inp(x)]) for x in xs))
            after = (await c.get_inference_statistics("cnn", "3")).model_stats[0]
            return [r.as_numpy("logits") for r in results], before, after
    outs, before, after = asyncio.run(concurrently())
    want = ort.InferenceSession(str(repo / "cnn" / "3" / "model.onnx")).run(None, {"input": np.concatenate(xs)})[0]
    np.testing.assert_allclose(np.concatenate(outs), want, rtol=1e-4, atol=1e-5)
    assert after.inference_count - before.inference_count == 8
    assert after.execution_count - before.execution_count <= 2, after
    c = grpcclient.InferenceServerClient(grpc_at)
    try:
        from tritonclient.utils import InferenceServerException
        with pytest.raises(InferenceServerException) as e:
            c.infer("cnn", [inp(np.zeros((9, 3, 32, 32), np.float32))])
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "max_batch_size is 8" in e.value.message()
        for absent in ("trt", "broken", "half"):
            assert not c.is_model_ready(absent)
    finally:
        c.close()


def test_the_command_again_imports_nothing_unchanged(imported):
    """`modelcache import-triton` against the running daemon: every version there already, the same: left
    alone; the refusals again (exit status 1: something could not be imported)."""
    d, repo, _, _ = imported
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "import-triton", str(repo)], env=d.env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.splitlines()
    assert "cnn@2: unchanged, not imported again" in lines and "embed@1: unchanged, not imported again" in lines
    assert lines[-1] == f"{repo}: 0 versions imported, 4 unchanged, 1 models skipped (not ONNX), 2 refused"
    assert any(line.startswith("half@2: ") and line.endswith("removed)") for line in lines)
    # a changed configuration is refused rather than replacing what clients may be using
    changed = repo.parent / "changed"
    (changed / "embed" / "1").mkdir(parents=True)
    (changed / "embed" / "1" / "model.onnx").write_bytes((repo / "embed" / "1" / "model.onnx").read_bytes())
    (changed / "embed" / "config.pbtxt").write_text('backend: "onnxruntime"\nmax_batch_size: 2\n')
    r = subprocess.run([sys.executable, "-m", "modelcache.cli", "import-triton", str(changed)], env=d.env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "embed@1 is already in modelcache from another file or configuration; import " \
        "with --replace" in r.stdout, r.stdout


def test_a_restarted_daemon_adds_nothing_again(imported, tmp_path):
    """The import at start is idempotent: the daemon started again on the same repositories says unchanged.
    (Last in this module: it stops the module's daemon.)"""
    d, repo, _, _ = imported
    assert d.stop() == 0
    d2 = DaemonProcess(tmp_path, extra_env={"MODELCACHE_REPOSITORY": str(d.repository),
                                            "MODELCACHE_TRITON_REPOSITORY": str(repo)})
    d2.start()
    try:
        wait_until(lambda: IMPORT_DONE in d2.log_path.read_text(), 180, "the import at start")
        assert f"{repo}: 0 versions imported, 4 unchanged" in d2.log_path.read_text()
        # warmed again at the start, as Triton warms a model each time it loads it
        wait_until(lambda: "warm@1: warmed up: 3 runs" in d2.log_path.read_text(), 60, "the warm-up at start")
    finally:
        stop_cleanly(d2)


# As Triton's quickstart writes densenet_onnx: no batching, clients send [3, H, W], the model takes [1, 3, H, W].
RESHAPE_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 0
input [ { name: "input" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 32, 32 ]
          reshape { shape: [ 1, 3, 32, 32 ] } } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] reshape { shape: [ 1, 10 ] } } ]
"""
# With batching: each row a flat vector of 3072, the model's rows [3, 32, 32]; its classes named in labels.txt.
FLAT_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 4
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3072 ] reshape { shape: [ 3, 32, 32 ] } } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "labels.txt" } ]
"""
LABELS = [f"class {i}" for i in range(10)]


def test_reshape_is_served_as_triton_serves_it(tmp_path):
    """Both fronts: metadata says the configured dims, a request shaped so runs on the model's shape, the outputs
    come back in the configured dims, equal to plain ORT's; a request in the model's own shape is refused."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    repo = tmp_path / "models"
    for name, config in (("quick", RESHAPE_CONFIG), ("flat", FLAT_CONFIG)):
        src = save("tiny-cnn", repo / name / "1" / "model.onnx")
        (repo / name / "config.pbtxt").write_text(config)
    (repo / "flat" / "labels.txt").write_text("\n".join(LABELS) + "\n")
    assert plan_model(repo / "quick", model_io).not_honoured == []
    assert plan_model(repo / "flat", model_io).declared["labels"] == {"logits": LABELS}
    bad = repo / "bad"
    save("tiny-cnn", bad / "1" / "model.onnx")
    (bad / "config.pbtxt").write_text(RESHAPE_CONFIG.replace("dims: [ 10 ]", "dims: [ 11 ]"))
    with pytest.raises(InputError, match=r"dims \[11\] hold 11 elements, its reshape \[1, 10\] 10"):
        plan_model(bad, model_io)
    import shutil
    shutil.rmtree(bad)
    ports = {"grpc": free_port(), "http": free_port()}
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_TRITON_REPOSITORY": str(repo),
                                           "MODELCACHE_GRPC_PORT": str(ports["grpc"]),
                                           "MODELCACHE_HTTP_PORT": str(ports["http"])}).start()
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    want = ort.InferenceSession(src).run(None, {"input": x})[0]
    try:
        wait_until(lambda: IMPORT_DONE in d.log_path.read_text(), 120, "the import at start")
        for proto, client_mod in (("http", httpclient), ("grpc", grpcclient)):
            c = client_mod.InferenceServerClient(f"127.0.0.1:{ports[proto]}")
            try:
                meta = c.get_model_metadata("quick")
                shapes = [list(t["shape"]) if proto == "http" else list(t.shape)
                          for t in (meta["inputs"] + meta["outputs"] if proto == "http" else
                                    list(meta.inputs) + list(meta.outputs))]
                assert shapes == [[3, 32, 32], [10]], (proto, shapes)
                for name, feed, expect in (("quick", x[0], want[0]), ("flat", x.reshape(2, 3072), want)):
                    i = client_mod.InferInput("input", list(feed.shape), "FP32")
                    i.set_data_from_numpy(np.ascontiguousarray(feed))
                    got = c.infer(name, [i]).as_numpy("logits")
                    assert got.shape == expect.shape, (proto, name, got.shape)
                    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5)
                i = client_mod.InferInput("input", [1, 3, 32, 32], "FP32")   # the model's shape, not the config's
                i.set_data_from_numpy(x[:1])
                with pytest.raises(InferenceServerException, match=r"configuration's dims are \[3, 32, 32\]"):
                    c.infer("quick", [i])
                # Classification, as Triton's image_client -c 3 asks: the top 3, "value:index[:label]" per row.
                for name, feed, labels in (("quick", x[0], None), ("flat", x.reshape(2, 3072), LABELS)):
                    i = client_mod.InferInput("input", list(feed.shape), "FP32")
                    i.set_data_from_numpy(np.ascontiguousarray(feed))
                    top = client_mod.InferRequestedOutput("logits", class_count=3)
                    got = c.infer(name, [i], outputs=[top]).as_numpy("logits")
                    rows = want[:1] if name == "quick" else want
                    expect = [[f"{r[k]:f}:{k}" + (f":{labels[k]}" if labels else "") for k in np.argsort(-r)[:3]]
                              for r in rows]
                    got_rows = [got.tolist()] if name == "quick" else got.tolist()
                    assert [[s.decode() for s in row] for row in got_rows] == expect, (proto, name, got)
            finally:
                c.close()
    finally:
        stop_cleanly(d)


def test_classification_strings_are_tritons():
    from modelcache.oip.classification import classify
    scores = np.array([[0.5, 2.25, -1.0], [3.0, 3.0, 1.0]], np.float32)
    assert classify(scores, 2, ["a", "b", "c"], True, "y").tolist() == [[b"2.250000:1:b", b"0.500000:0:a"],
                                                                      [b"3.000000:0:a", b"3.000000:1:b"]]
    # Not batching: one classification of the whole tensor; more classes asked than there are: all of them.
    assert classify(np.array([1, 7, 3], np.int64), 5, None, False, "y").tolist() == [b"7:1", b"3:2", b"1:0"]
    # Labels shorter than the classes: the index alone where none is given.
    assert classify(np.array([0.0, 1.0], np.float32), 1, ["zero"], False, "y").tolist() == [b"1.000000:1"]
    with pytest.raises(InputError, match="only numbers can be classified"):
        classify(np.array([b"x"], dtype=object), 1, None, False, "y")


def initializer_input_model() -> onnx.ModelProto:
    """y = x @ W + b, where W and b are initializers that are also graph inputs (IR 8): ORT lets a run feed
    them in place of the stored values; Triton's ORT backend serves them as (optional) inputs."""
    rng = np.random.default_rng(7)
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32).tolist())
    b = helper.make_tensor("b", TensorProto.FLOAT, [3], [0.5, -1.0, 2.0])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["y"])], "overridable",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("W", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], initializer=[w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


OPTIONAL_CONFIG = """
max_batch_size: 0
input [ { name: "x" data_type: TYPE_FP32 dims: [ 2, 4 ] },
        { name: "b" data_type: TYPE_FP32 dims: [ 3 ] optional: true },
        { name: "W" data_type: TYPE_FP32 dims: [ 4, 3 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 2, 3 ] } ]
"""


def test_initializers_that_are_inputs_are_served_as_tritons_optional_inputs(tmp_path):
    """An initializer listed as a graph input imports as an input Triton's way: `optional: true` may be left
    out (the stored value is used), a listed one without it is required in Triton's words; fed, it overrides the
    stored value. Outputs equal plain ORT's, over both fronts; and an optional input on a batching model is
    refused as Triton refuses it."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    repo = tmp_path / "models"
    src = save(initializer_input_model(), repo / "affine" / "1" / "model.onnx")
    (repo / "affine" / "config.pbtxt").write_text(OPTIONAL_CONFIG)
    save(initializer_input_model(), repo / "needs_x" / "1" / "model.onnx")   # x said optional: the model needs it
    (repo / "needs_x" / "config.pbtxt").write_text(OPTIONAL_CONFIG.replace('dims: [ 2, 4 ] }', 'dims: [ 2, 4 ] optional: true }'))
    batching = repo / "batching"
    save(initializer_input_model(), batching / "1" / "model.onnx")
    (batching / "config.pbtxt").write_text(OPTIONAL_CONFIG.replace("max_batch_size: 0", "max_batch_size: 2"))
    with pytest.raises(InputError, match="optional input 'b' is not supported for models that support batching"):
        plan_model(batching, model_io)
    import shutil
    shutil.rmtree(batching)
    ports = {"grpc": free_port(), "http": free_port()}
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_TRITON_REPOSITORY": str(repo),
                                           "MODELCACHE_GRPC_PORT": str(ports["grpc"]),
                                           "MODELCACHE_HTTP_PORT": str(ports["http"])}).start()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    w2 = rng.standard_normal((4, 3)).astype(np.float32)
    b2 = np.array([10.0, 20.0, 30.0], np.float32)
    plain = ort.InferenceSession(src)
    assert sorted(i.name for i in plain.get_overridable_initializers()) == ["W", "b"]
    try:
        wait_until(lambda: IMPORT_DONE in d.log_path.read_text(), 120, "the import at start")
        for proto, client_mod in (("http", httpclient), ("grpc", grpcclient)):
            c = client_mod.InferenceServerClient(f"127.0.0.1:{ports[proto]}")
            try:
                meta = c.get_model_metadata("affine")
                names = [t["name"] for t in meta["inputs"]] if proto == "http" else [t.name for t in meta.inputs]
                assert sorted(names) == ["W", "b", "x"], (proto, names)

                def infer(**feeds):
                    inputs = []
                    for k, v in feeds.items():
                        i = client_mod.InferInput(k, list(v.shape), "FP32")
                        i.set_data_from_numpy(v)
                        inputs.append(i)
                    return c.infer("affine", inputs).as_numpy("y")
                for feeds in ({"x": x, "W": w2}, {"x": x, "W": w2, "b": b2}):
                    np.testing.assert_allclose(infer(**feeds), plain.run(None, feeds)[0], rtol=1e-5, atol=1e-6)
                with pytest.raises(InferenceServerException,
                                   match=r"expected number of inputs between 2 and 3 but got 2 inputs for model "
                                         r"'affine'. Got input\(s\) \['x','b'\], but missing required input\(s\) "
                                         r"\['W'\]"):
                    infer(x=x, b=b2)
                i = client_mod.InferInput("W", [4, 3], "FP32")
                i.set_data_from_numpy(w2)
                with pytest.raises(InferenceServerException, match="needs_x: missing input 'x'"):
                    c.infer("needs_x", [i])
            finally:
                c.close()
        with d.client() as mc:   # the daemon's own serve mode takes the override too
            from modelcache.client.serve import ServeSession
            s = ServeSession("affine", client=mc)
            np.testing.assert_allclose(s.run(None, {"x": x, "b": b2})[0], plain.run(None, {"x": x, "b": b2})[0],
                                       rtol=1e-5, atol=1e-6)
    finally:
        stop_cleanly(d)


def slow_model(trips: int) -> onnx.ModelProto:
    """y = x + trips, one Loop iteration a unit (~2 us each here): a model whose run takes as long as asked."""
    body = helper.make_graph(
        [helper.make_node("Add", ["v_in", "one"], ["v_out"]), helper.make_node("Identity", ["c_in"], ["c_out"])],
        "body", [helper.make_tensor_value_info("i", TensorProto.INT64, []),
                 helper.make_tensor_value_info("c_in", TensorProto.BOOL, []),
                 helper.make_tensor_value_info("v_in", TensorProto.FLOAT, None)],
        [helper.make_tensor_value_info("c_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    g = helper.make_graph([helper.make_node("Loop", ["trips", "cond", "x"], ["y"], body=body)], "slow",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])],
                          [onnx.numpy_helper.from_array(np.array(trips, np.int64), "trips"),
                           onnx.numpy_helper.from_array(np.array(True), "cond")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_models_queue_policy_answers_both_protocols_in_tritons_words(tmp_path):
    """max_queue_size 1 on a model whose run takes ~0.2 s: of requests sent together, one runs, one waits, the
    rest are refused at once (HTTP 503, gRPC UNAVAILABLE, 'Exceeds maximum queue size'), and the front serves on.
    A queue timeout (default_timeout_microseconds) refuses those still waiting after it, in Triton's words too."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    repo = tmp_path / "models"
    put_model(repo, "slow", slow_model(100_000),
              "max_batch_size: 1\ndynamic_batching { default_queue_policy { max_queue_size: 1 } }")
    put_model(repo, "timed", slow_model(100_000),
              "max_batch_size: 1\ndynamic_batching { default_queue_policy { default_timeout_microseconds: 20000 } }")
    put_model(repo, "prio", slow_model(200_000),
              "max_batch_size: 1\ndynamic_batching { priority_levels: 2 default_priority_level: 2 "
              "priority_queue_policy { key: 2 value { max_queue_size: 2 } } }")
    d, grpc_at, http_at = start_importing(tmp_path, repo)
    try:
        x = np.zeros((1, 1), np.float32)
        for module, at, code in ((httpclient, http_at, "503"), (grpcclient, grpc_at, "StatusCode.UNAVAILABLE")):
            client = module.InferenceServerClient(at, **({"concurrency": 6} if module is httpclient else {}))
            i = module.InferInput("x", [1, 1], "FP32")
            i.set_data_from_numpy(x)
            client.infer("slow", [i])                               # resident, and its run measured
            results = []
            if module is httpclient:
                pending = [client.async_infer("slow", [i]) for _ in range(6)]
                for p in pending:
                    try:
                        results.append(p.get_result().as_numpy("y"))
                    except InferenceServerException as e:
                        results.append(e)
            else:
                done = []
                for _ in range(6):
                    client.async_infer("slow", [i], lambda result, error: done.append(error or result))
                wait_until(lambda: len(done) == 6, 30, "six answers")
                results = [r if isinstance(r, InferenceServerException) else r.as_numpy("y") for r in done]
            refused = [r for r in results if isinstance(r, InferenceServerException)]
            served = [r for r in results if not isinstance(r, InferenceServerException)]
            assert 1 <= len(served) <= 5 and refused, results
            assert all(str(e.status()) == code and "Exceeds maximum queue size (1)" in e.message()
                       for e in refused), [(e.status(), e.message()) for e in refused]
            assert all(float(y[0, 0]) == 100_000.0 for y in served)
            assert float(client.infer("slow", [i]).as_numpy("y")[0, 0]) == 100_000.0   # and serves on
            client.close()
        # a queue timeout of 20 ms: of three sent together, the first runs and the two behind it are refused
        client = httpclient.InferenceServerClient(http_at, concurrency=3)
        i = httpclient.InferInput("x", [1, 1], "FP32")
        i.set_data_from_numpy(x)
        client.infer("timed", [i])
        outcomes = []
        for p in [client.async_infer("timed", [i]) for _ in range(3)]:
            try:
                outcomes.append(float(p.get_result().as_numpy("y")[0, 0]))
            except InferenceServerException as e:
                outcomes.append((str(e.status()), e.message()))
        timed_out = [o for o in outcomes if isinstance(o, tuple)]
        assert 100_000.0 in outcomes and timed_out, outcomes
        assert all(code == "503" and "Request timeout expired" in text for code, text in timed_out), timed_out
        client.close()
        with d.client() as c:
            refused = c.stats().executor["refused"]
            assert refused["queue_full"] >= 2 and refused["queue_timeout"] == len(timed_out)
        check_priority_levels(grpc_at, http_at)
        with d.client() as mc:   # a serve-mode session names its requests' level too
            from modelcache.client.serve import ServeSession
            y = ServeSession("prio", client=mc, priority=1).run(None, {"x": np.full((1, 1), 7, np.float32)})[0]
            assert float(y[0, 0]) == 200_007.0
    finally:
        stop_cleanly(d)


def check_priority_levels(grpc_at: str, http_at: str) -> None:
    """`prio` (~0.4 s a run) has two priority levels, 2 the default, at most 2 queued at level 2. Behind a running
    request: two of level 2 queue, a third is refused (that level is full), and one of level 1 runs before them.
    Each answer says which request it was (y = x + 200000)."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException
    client = grpcclient.InferenceServerClient(grpc_at)
    assert client.get_model_config("prio").config.dynamic_batching.priority_levels == 2   # ModelConfig says it

    def request(tag):
        i = grpcclient.InferInput("x", [1, 1], "FP32")
        i.set_data_from_numpy(np.full((1, 1), tag, np.float32))
        return [i]
    client.infer("prio", request(0))               # resident, and its run measured
    done = []
    for tag, priority in ((1, 0), (2, 0), (3, 2), (4, 0), (5, 1)):   # 0: no priority given (tritonclient's default)
        client.async_infer("prio", request(tag), lambda result, error: done.append(error or result),
                           priority=priority)
        time.sleep(0.03)                           # (each reaches the daemon before the next, all while 1 runs)
    wait_until(lambda: len(done) == 5, 60, "five answers")
    refused = [r for r in done if isinstance(r, InferenceServerException)]
    assert len(refused) == 1 and "Exceeds maximum queue size (2) of priority level 2" in refused[0].message()
    assert str(refused[0].status()) == "StatusCode.UNAVAILABLE"
    order = [round(float(r.as_numpy("y")[0, 0])) - 200_000 for r in done if r not in refused]
    assert order == [1, 5, 2, 3], order            # level 1's request overtook the two of level 2
    client.close()
    # a priority Triton would not take is refused with the parameter named
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [0.0]}],
                       "parameters": {"priority": -1}}).encode()
    with pytest.raises(urllib.error.HTTPError) as refused_http:
        urllib.request.urlopen(urllib.request.Request(f"http://{http_at}/v2/models/prio/infer", body), timeout=30)
    assert refused_http.value.code == 400 and "parameter priority -1" in refused_http.value.read().decode()
