"""Triton's own Python example clients, run as they are against a daemon that imported a repository of the
models they ask for (issue 44, part 7): `simple` (INT32 add and subtract), `simple_string` (the same on numbers
written as strings), `simple_identity` (strings back as sent), and the sequence clients' `simple_sequence`,
`simple_dyna_sequence` and `simple_string_dyna_sequence` (Triton's QA custom backends; here ONNX models over
the control inputs and the implicit state the server fills), built here as ONNX models. The scripts are
copied unchanged from triton-inference-server/client (tests/triton_examples/README.md: the revision, the licence);
CI runs without GitHub, so they live here. Each exits non-zero, or prints an error, when an answer is not
Triton's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import stop_cleanly
from test_triton_repo import put_model, start_importing

EXAMPLES = Path(__file__).with_name("triton_examples")
SIMPLE_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: {t} dims: [ 16 ] }}, {{ name: "INPUT1" data_type: {t} dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: {t} dims: [ 16 ] }}, {{ name: "OUTPUT1" data_type: {t} dims: [ 16 ] }} ]
"""
IDENTITY_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""


def simple(strings: bool) -> onnx.ModelProto:
    """Triton's QA `simple` (or `simple_string`: numbers as strings in and out): OUTPUT0 = INPUT0 + INPUT1,
    OUTPUT1 = INPUT0 - INPUT1, [batch, 16] each."""
    t = TensorProto.STRING if strings else TensorProto.INT32
    nodes, a, b = [], "INPUT0", "INPUT1"
    if strings:
        nodes += [helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
                  helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32)]
        a, b = "a", "b"
    sums, diffs = ("s", "d") if strings else ("OUTPUT0", "OUTPUT1")
    nodes += [helper.make_node("Add", [a, b], [sums]), helper.make_node("Sub", [a, b], [diffs])]
    if strings:
        nodes += [helper.make_node("Cast", ["s"], ["OUTPUT0"], to=TensorProto.STRING),
                  helper.make_node("Cast", ["d"], ["OUTPUT1"], to=TensorProto.STRING)]
    io = lambda n: helper.make_tensor_value_info(n, t, ["batch", 16])   # noqa: E731
    g = helper.make_graph(nodes, "simple", [io("INPUT0"), io("INPUT1")], [io("OUTPUT0"), io("OUTPUT1")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


SEQUENCE_CONFIG = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  max_sequence_idle_microseconds: 5000000
  {strategy}
  control_input [
{controls}
  ]
  {state}
}}
"""
CONTROL = """    {{ name: "{name}" control [ {{ kind: {kind} {values} }} ] }}"""


def sequence_model(name: str) -> tuple[onnx.ModelProto, str]:
    """The model and config.pbtxt of one of Triton's QA sequence models, as ONNX, as its example clients expect:
    `simple_sequence`: OUTPUT = INPUT + START; `simple_dyna_sequence`: the same, + CORRID on the END request;
    `simple_string_dyna_sequence`: the running sum of INPUT (an implicit state), + its string CORRID as a number
    on the END request."""
    i32 = lambda n: helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", 1])   # noqa: E731
    flag = lambda n, k: CONTROL.format(name=n, kind=k, values="int32_false_true: [ 0, 1 ]")   # noqa: E731
    inputs, nodes, controls, state = [i32("INPUT"), i32("START"), i32("READY")], [], \
        [flag("START", "CONTROL_SEQUENCE_START"), flag("READY", "CONTROL_SEQUENCE_READY")], ""
    if name == "simple_sequence":
        nodes.append(helper.make_node("Add", ["INPUT", "START"], ["OUTPUT"]))
        outputs = [i32("OUTPUT")]
    else:
        string = name == "simple_string_dyna_sequence"
        corrid = TensorProto.STRING if string else TensorProto.UINT64
        inputs += [i32("END"), helper.make_tensor_value_info("CORRID", corrid, ["batch", 1])]
        controls += [flag("END", "CONTROL_SEQUENCE_END"),
                     CONTROL.format(name="CORRID", kind="CONTROL_SEQUENCE_CORRID",
                                    values=f"data_type: {'TYPE_STRING' if string else 'TYPE_UINT64'}")]
        nodes += [helper.make_node("Cast", ["CORRID"], ["id"], to=TensorProto.INT32),
                  helper.make_node("Mul", ["END", "id"], ["at_end"])]
        if string:   # a running sum kept by the server between requests
            inputs.append(i32("STATE_IN"))
            nodes += [helper.make_node("Add", ["STATE_IN", "INPUT"], ["sum"]),
                      helper.make_node("Add", ["sum", "at_end"], ["OUTPUT"]),
                      helper.make_node("Identity", ["OUTPUT"], ["STATE_OUT"])]
            outputs = [i32("OUTPUT"), i32("STATE_OUT")]
            state = ('state [ { input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_INT32 dims: [ 1 ] '
                     '} ]')
        else:
            nodes += [helper.make_node("Add", ["INPUT", "START"], ["first"]),
                      helper.make_node("Add", ["first", "at_end"], ["OUTPUT"])]
            outputs = [i32("OUTPUT")]
    g = helper.make_graph(nodes, name, inputs, outputs)
    config = SEQUENCE_CONFIG.format(strategy="oldest { max_candidate_sequences: 4 }" if name == "simple_sequence"
                                    else "direct { }", controls=",\n".join(controls), state=state)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), config


DENSENET_CONFIG = """
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 0
input [ { name: "data_0" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 224, 224 ]
          reshape { shape: [ 1, 3, 224, 224 ] } } ]
output [ { name: "fc6_1" data_type: TYPE_FP32 dims: [ 1000 ] reshape { shape: [ 1, 1000, 1, 1 ] }
           label_filename: "densenet_labels.txt" } ]
"""


def densenet_stand_in() -> onnx.ModelProto:
    """The quickstart's densenet_onnx as image_client.py sees it (data_0 [1, 3, 224, 224] -> fc6_1
    [1, 1000, 1, 1], the configuration Triton's docs give it), small: a 4x4 average pool, a 3x3 conv to 8
    channels, global pooling and a 1x1 conv to 1,000 classes."""
    rng = np.random.default_rng(7)
    w1 = numpy_helper.from_array(rng.normal(size=(8, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(size=(1000, 8, 1, 1)).astype(np.float32), "w2")
    nodes = [helper.make_node("AveragePool", ["data_0"], ["p"], kernel_shape=[4, 4], strides=[4, 4]),
             helper.make_node("Conv", ["p", "w1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["g"]),
             helper.make_node("Conv", ["g", "w2"], ["fc6_1"])]
    g = helper.make_graph(nodes, "densenet_stand_in",
                          [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 224, 224])],
                          [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, 1000, 1, 1])],
                          initializer=[w1, w2])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def identity() -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "simple_identity",
                          [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, ["batch", "n"])],
                          [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, ["batch", "n"])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    """(daemon, gRPC host:port, HTTP host:port): a daemon that imported simple, simple_string, simple_identity."""
    root = tmp_path_factory.mktemp("examples")
    repo = root / "models"
    models = [("simple", simple(False), SIMPLE_CONFIG.format(t="TYPE_INT32")),
              ("simple_string", simple(True), SIMPLE_CONFIG.format(t="TYPE_STRING")),
              ("simple_identity", identity(), IDENTITY_CONFIG)]
    models += [(name, *sequence_model(name))
               for name in ("simple_sequence", "simple_dyna_sequence", "simple_string_dyna_sequence")]
    models.append(("densenet_onnx", densenet_stand_in(), DENSENET_CONFIG))
    (repo / "densenet_onnx").mkdir(parents=True)
    (repo / "densenet_onnx" / "densenet_labels.txt").write_text("".join(f"CLASS_{k}\n" for k in range(1000)))
    for name, model, config in models:
        put_model(repo, name, model, config)
    d, grpc_at, http_at = start_importing(root, repo)
    try:
        assert "7 versions imported" in d.log_path.read_text()
        yield d, grpc_at, http_at
    finally:
        stop_cleanly(d)


RUNS = [(p.name, []) for p in sorted(EXAMPLES.glob("*.py")) if "image" not in p.name and "model_control" not in p.name] + \
    [(p.name, ["-d"]) for p in sorted(EXAMPLES.glob("*sequence*.py"))]   # -d: the CORRID ("dyna") models


@pytest.mark.parametrize("script, args", RUNS, ids=[" ".join([s, *a]) for s, a in RUNS])
def test_tritons_example_client_runs_unchanged(serving, script, args):
    _, grpc_at, http_at = serving
    url = http_at if "_http_" in script else grpc_at
    r = subprocess.run([sys.executable, str(EXAMPLES / script), "-u", url, *args], capture_output=True, text=True,
                       timeout=120)
    said = r.stdout + r.stderr
    assert r.returncode == 0 and not re.search(r"^(error|FAILED)", said, re.MULTILINE | re.IGNORECASE), said[-3000:]


# (image_client.py's HTTP path imports `attrdict`, which no longer imports on Python >= 3.10: gRPC only)
@pytest.mark.parametrize("script, protocol", [("image_client.py", "grpc"), ("grpc_image_client.py", "grpc")])
def test_image_client_classifies_as_plain_ort_does(serving, tmp_path, script, protocol):
    """The quickstart's `image_client.py -m densenet_onnx -c 3 -s INCEPTION IMAGE` (reshape and the
    classification extension), unchanged: its three classes are plain ORT's top three, in order."""
    from PIL import Image
    sys.path.insert(0, str(EXAMPLES))
    try:
        import image_client   # (its preprocessing, to run the same tensor through plain ORT)
    finally:
        sys.path.remove(str(EXAMPLES))
    image = tmp_path / "mug.jpg"
    rng = np.random.default_rng(11)
    Image.fromarray(rng.integers(0, 255, size=(96, 128, 3), dtype=np.uint8)).save(image)
    _, grpc_at, http_at = serving
    url = http_at if protocol == "http" else grpc_at
    extra = ["-i", protocol] if script == "image_client.py" else []
    r = subprocess.run([sys.executable, str(EXAMPLES / script), "-m", "densenet_onnx", "-c", "3", "-s", "INCEPTION",
                        "-u", url, *extra, str(image)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "PASS" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    shown = [int(m) for m in re.findall(r"^\s+[-\d.e+]+ \((\d+)\) = CLASS_(?:\d+)$", r.stdout, re.MULTILINE)]
    data = image_client.preprocess(Image.open(image), image_client.mc.ModelInput.FORMAT_NCHW, "FP32", 3, 224,
                                   224, "INCEPTION", protocol)
    model = serving[0].root / "models" / "densenet_onnx" / "1" / "model.onnx"
    scores = ort.InferenceSession(str(model)).run(None, {"data_0": data[None]})[0].reshape(-1)
    assert shown == list(np.argsort(-scores)[:3]), r.stdout


def test_the_model_control_examples_run_unchanged(tmp_path):
    """`simple_grpc_model_control.py` and `simple_http_model_control.py` (Triton's repository load and unload): they
    count Triton's QA repository (8 models for the gRPC one, 7 for the HTTP one), load `simple`, send a config
    override that is not JSON (an error saying 'failed to load'), then `{"max_batch_size":"16"}` and read it back,
    unload it, send a 256-character file name (INTERNAL, 'failed to poll from model repository', the server still
    live) and a model that is nowhere ('failed to load'). A repository of `simple` and seven others, one removed
    between the two."""
    repo = tmp_path / "models"
    for name in ["simple"] + [f"other{k}" for k in range(7)]:
        put_model(repo, name, simple(False), SIMPLE_CONFIG.format(t="TYPE_INT32"))
    d, grpc_at, http_at = start_importing(tmp_path, repo)
    try:
        for script, url in (("simple_grpc_model_control.py", grpc_at), ("simple_http_model_control.py", http_at)):
            r = subprocess.run([sys.executable, str(EXAMPLES / script), "-u", url], capture_output=True, text=True,
                               timeout=120)
            assert r.returncode == 0 and "PASS: model control" in r.stdout, script + r.stdout[-3000:] + r.stderr[-3000:]
            if script.startswith("simple_grpc"):   # (the HTTP one counts 7)
                with d.client() as c:
                    c.remove("other6", 1)
                shutil.rmtree(repo / "other6")
    finally:
        stop_cleanly(d)
