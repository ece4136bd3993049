"""What ONNX Runtime builds and runs, modelcache adds and runs, with the same outputs and metadata.

Each case is a small model written the way some exporter writes it, built here (no hub is
reachable); each runs through plain ORT, then through the drop-in session in attach and serve
mode against one daemon, and must agree on outputs and on get_inputs() / get_outputs().
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import modelcache
from conftest import daemon_with_models

RNG = np.random.default_rng(0)


def _weights(name: str, shape, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(RNG.standard_normal(shape).astype(dtype), name)


def matmul_reshape(ir_version: int, opset: int, initializers_as_inputs: bool, x_dims, out_shape) -> onnx.ModelProto:
    """x @ W, reshaped by an int64 shape initializer: the shape of a model-zoo classifier's head."""
    W, shape = _weights("W", (64, 64)), numpy_helper.from_array(np.array([1, -1], np.int64), "shape")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)]
    if initializers_as_inputs:
        inputs += [helper.make_tensor_value_info("W", TensorProto.FLOAT, [64, 64]),
                   helper.make_tensor_value_info("shape", TensorProto.INT64, [2])]
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"]),
                           helper.make_node("Reshape", ["h", "shape"], ["y"])], "g", inputs,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)], [W, shape])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = ir_version
    return m


def unary(op: str, elem_type: int, dims, opset: int = 13) -> onnx.ModelProto:
    """One node, no weights at all: what remains to get right is the tensors' trip."""
    g = helper.make_graph([helper.make_node(op, ["a", "a"] if op == "Add" else ["a"], ["b"])], "g",
                          [helper.make_tensor_value_info("a", elem_type, dims)],
                          [helper.make_tensor_value_info("b", elem_type, dims)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


CASES = {
    # IR 3 (the old model zoo): every initializer is also a graph input; the output has no shape,
    # which the ONNX checker refuses and ORT accepts.
    "ir3-initializers-as-inputs": (matmul_reshape(3, 8, True, ["N", 64], None), {"x": (2, 64)}),
    # IR 3 whose initializers are NOT inputs: the checker refuses it, ORT runs it.
    "ir3-initializers-not-inputs": (matmul_reshape(3, 8, False, ["N", 64], [1, 128]), {"x": (2, 64)}),
    # dim_value -1: older exporters' "dynamic"; ORT reports None and takes any size.
    "dim-minus-one": (matmul_reshape(8, 13, False, [-1, 64], None), {"x": (3, 64)}),
    # no dim_value nor dim_param: unknown dims.
    "dims-empty": (matmul_reshape(8, 13, False, [None, 64], None), {"x": (5, 64)}),
    # IR >= 4 initializers listed as inputs are overridable: not fed, the stored weight is used...
    "overridable-not-fed": (matmul_reshape(7, 13, True, ["N", 64], None), {"x": (2, 64)}),
    # 0-d tensors in and out (np.ascontiguousarray made them shape [1] on the wire).
    "scalar": (unary("Add", TensorProto.FLOAT, []), {"a": np.array(1.5, np.float32)}),
    # strings travel as lists of str; ORT takes str arrays as well as object arrays.
    "strings": (unary("Identity", TensorProto.STRING, ["n"]), {"a": np.array(["x", "", "yz é"], dtype=object)}),
    "strings-from-str-array": (unary("Identity", TensorProto.STRING, ["n"]), {"a": np.array(["x", "yz"])}),
    "strings-2d": (unary("Identity", TensorProto.STRING, [2, None]), {"a": np.array([["a", "b"], ["c", "d"]], object)}),
    # zero-size tensors
    "zero-size": (unary("Add", TensorProto.FLOAT, ["n", 3]), {"a": np.zeros((0, 3), np.float32)}),
}
OVERRIDES = {  # ...fed, the caller's value (attach mode; serve mode runs the stored weights only)
    "weight": {"x": (2, 64), "W": (64, 64)},
    "shape": {"x": (2, 64), "shape": np.array([2, -1], np.int64)},
}


def _feeds(spec: dict) -> dict:
    return {k: v if isinstance(v, np.ndarray) else RNG.standard_normal(v).astype(np.float32) for k, v in spec.items()}


@pytest.fixture(scope="module")
def daemon_with_cases(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    paths = {}
    for name, (model, _) in CASES.items():
        paths[name] = str(root / f"{name}.onnx")
        onnx.save(model, paths[name])
    with daemon_with_models(root, paths) as (_, c):
        yield c, paths


def _metadata(session) -> tuple:
    return ([(i.name, i.type, i.shape) for i in session.get_inputs()],
            [(o.name, o.type, o.shape) for o in session.get_outputs()])


@pytest.mark.parametrize("mode", ["attach", "serve"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_runs_like_plain_ort(daemon_with_cases, case, mode):
    client, paths = daemon_with_cases
    plain = ort.InferenceSession(paths[case], providers=["CPUExecutionProvider"])
    feeds = _feeds(CASES[case][1])
    session = modelcache.InferenceSession(case, client=client, mode=mode)
    if mode == "attach":  # (serve mode reports only what it can know without ORT: names, dtypes, shapes)
        assert _metadata(session) == _metadata(plain)
    else:
        assert [(i.name, i.shape) for i in session.get_inputs()] == [(i.name, i.shape) for i in plain.get_inputs()]
    expected = plain.run(None, feeds)
    got = session.run(None, feeds)
    assert [g.shape for g in got] == [e.shape for e in expected]
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype
        if e.dtype == object:
            assert g.tolist() == e.tolist()
        else:
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("override", sorted(OVERRIDES))
def test_an_overridable_initializer_can_be_fed_in_attach_and_serve_mode(daemon_with_cases, override):
    client, paths = daemon_with_cases
    plain = ort.InferenceSession(paths["overridable-not-fed"], providers=["CPUExecutionProvider"])
    session = modelcache.InferenceSession("overridable-not-fed", client=client)
    assert [i.name for i in session.get_overridable_initializers()] == ["W", "shape"]
    feeds = _feeds(OVERRIDES[override])
    np.testing.assert_allclose(session.run(None, feeds)[0], plain.run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(modelcache.errors.InputError, match="must be float32"):
        session.run(None, {**feeds, "W": np.zeros((64, 64), np.float64)})
    serve = modelcache.InferenceSession("overridable-not-fed", client=client, mode="serve")   # the daemon takes it too
    assert [i.name for i in serve.get_overridable_initializers()] == ["W", "shape"]
    np.testing.assert_allclose(serve.run(None, feeds)[0], plain.run(None, feeds)[0], rtol=1e-5, atol=1e-5)
