"""Triton's own Python example clients, run as they are against a daemon that imported a repository of the
models they ask for (issue 44, part 7): `simple` (INT32 add and subtract), `simple_string` (the same on numbers
written as strings) and `simple_identity` (strings back as sent), built here as ONNX models. The scripts are
copied unchanged from triton-inference-server/client (tests/triton_examples/README.md: the revision, the licence);
CI runs without GitHub, so they live here. Each exits non-zero, or prints an error, when an answer is not
Triton's.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from conftest import DaemonProcess, stop_cleanly, wait_until
from test_triton_repo import IMPORT_DONE, free_port

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
    for name, model, config in (("simple", simple(False), SIMPLE_CONFIG.format(t="TYPE_INT32")),
                                ("simple_string", simple(True), SIMPLE_CONFIG.format(t="TYPE_STRING")),
                                ("simple_identity", identity(), IDENTITY_CONFIG)):
        (repo / name / "1").mkdir(parents=True)
        onnx.save(model, str(repo / name / "1" / "model.onnx"))
        (repo / name / "config.pbtxt").write_text(config)
    ports = {"grpc": free_port(), "http": free_port()}
    d = DaemonProcess(root, extra_env={"MODELCACHE_TRITON_REPOSITORY": str(repo),
                                       "MODELCACHE_GRPC_PORT": str(ports["grpc"]),
                                       "MODELCACHE_HTTP_PORT": str(ports["http"])}).start()
    try:
        wait_until(lambda: IMPORT_DONE in d.log_path.read_text(), 120, "the import at start")
        assert "3 versions imported" in d.log_path.read_text()
        yield d, f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['http']}"
    finally:
        stop_cleanly(d)


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_tritons_example_client_runs_unchanged(serving, script):
    _, grpc_at, http_at = serving
    url = http_at if "_http_" in script else grpc_at
    r = subprocess.run([sys.executable, str(EXAMPLES / script), "-u", url], capture_output=True, text=True,
                       timeout=120)
    said = r.stdout + r.stderr
    assert r.returncode == 0 and not re.search(r"^(error|FAILED)", said, re.MULTILINE | re.IGNORECASE), said[-3000:]
