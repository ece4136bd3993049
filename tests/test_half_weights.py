"""fp16 weights keep their dtype from add to the host tier (issue #16, item 2).

ORT's CPU EP lacks fp16 kernels for most ops, so its InsertCastTransformer wraps them in Casts, and at
ORT_ENABLE_ALL its FuseFp16InitializerToFp32NodeTransformer folds each weight's Cast into an fp32 copy.
Packing leaves that one transformer off for models with half-precision weights (packing.py,
`_half_weight_exclusions`): the host tier holds each weight once, in fp16, shared by the CPU and GPU
skeletons, and attach-mode clients run the Casts. Real daemon, real ORT.
"""

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import modelcache
from modelcache import zoo
from modelcache.store.format import ALIGN, SKELETON_FILE, WEIGHTS_FILE, iter_graphs, tensor_nbytes
from modelcache.store.packing import (HALF_TO_FLOAT_FUSION, INLINE_MAX_BYTES, _half_weight_exclusions,
                                      is_gpu_shared_weight, pack)
from modelcache.tiers.host import HostTier
from conftest import daemon_with_models

FP16_MODELS = ["tiny-fp16", "tiny-vit-fp16"]


@pytest.fixture(scope="module")
def fp16_files(tmp_path_factory):
    """tiny-fp16, and tiny-vit converted to fp16 (LayerNorm, Softmax, Erf, Gemm-like MatMul+Add in fp16)."""
    root = tmp_path_factory.mktemp("fp16")
    paths = {"tiny-fp16": str(root / "tiny-fp16.onnx"), "tiny-vit-fp16": str(root / "tiny-vit-fp16.onnx")}
    zoo.save(zoo.build("tiny-fp16"), paths["tiny-fp16"])
    zoo.save(zoo.to_fp16(zoo.build("tiny-vit")), paths["tiny-vit-fp16"])
    return paths


def fp16_initializers(src: str) -> list:
    return [t for g in iter_graphs(onnx.load(src).graph) for t in g.initializer
            if t.data_type == onnx.TensorProto.FLOAT16]


def fp16_bytes_in_blob(src: str) -> tuple[int, int]:
    """(bytes, count) of the source's fp16 initializers large enough for the CPU skeleton to keep them
    in the weights blob (smaller ones stay inline)."""
    big = [tensor_nbytes(t) for t in fp16_initializers(src) if tensor_nbytes(t) >= INLINE_MAX_BYTES]
    return sum(big), len(big)


def fp16_bytes_lent(src: str) -> tuple[int, int]:
    """(bytes, count) of the distinct fp16 weights either skeleton takes from the blob: the CPU one's,
    and the GPU one's stubs (which include smaller weights: packing.is_gpu_shared_weight)."""
    lent = {t.raw_data: tensor_nbytes(t) for t in fp16_initializers(src)
            if tensor_nbytes(t) >= INLINE_MAX_BYTES or is_gpu_shared_weight(t)}
    return sum(lent.values()), len(lent)


def half_close(got, want):
    """fp16 outputs: the same fp32 arithmetic on the same (exactly widened) weights, rounded to fp16
    once; ORT may order sums differently after its own fusion, so allow a few fp16 ulps."""
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("name", FP16_MODELS)
def test_the_blob_holds_the_fp16_weights_once(name, fp16_files, tmp_path):
    src = fp16_files[name]
    m = pack(src, tmp_path, name, 1)
    fp16_bytes, count = fp16_bytes_in_blob(src)
    assert {t.dtype for t in m.tensors} == {"float16"}
    assert sum(t.nbytes for t in m.tensors) == fp16_bytes
    # The GPU skeleton's stubs reuse the CPU tensors' bytes: the blob holds each distinct fp16 weight once,
    # and so does a host tier that holds both variants.
    lent_bytes, lent_count = fp16_bytes_lent(src)
    assert lent_bytes <= m.weights_bytes < lent_bytes + lent_count * ALIGN   # only alignment padding on top
    plan = HostTier(tmp_path / "shm", 1 << 40).plan_from(name, tmp_path / name / "1", m, ("cpu", "gpu"))
    assert sum(n for _, _, n, _ in plan.copies) == lent_bytes
    assert fp16_bytes <= plan.segment_bytes < lent_bytes + lent_count * ALIGN
    # The client runs the CPU EP's Casts itself: they are in the skeleton, with fp16 weights as their inputs.
    skeleton = onnx.load(str(tmp_path / name / "1" / SKELETON_FILE), load_external_data=False)
    casts = [n for g in iter_graphs(skeleton.graph) for n in g.node if n.op_type == "Cast"]
    assert {t.name for t in m.tensors} <= {n.input[0] for n in casts}
    assert not any(t.name.startswith("FusedBack_") for g in iter_graphs(skeleton.graph) for t in g.initializer)


def test_ort_still_widens_them_when_allowed(fp16_files, tmp_path):
    """The premise, checked on the installed ORT: with HALF_TO_FLOAT_FUSION on, the CPU skeleton holds
    fp32 copies (twice the bytes) and the GPU skeleton's fp16 weights come on top."""
    src = fp16_files["tiny-fp16"]
    m = pack(src, tmp_path, "h", 1, keep_half_weights=False)
    fp16_bytes, _ = fp16_bytes_in_blob(src)
    assert {t.dtype for t in m.tensors} == {"float32"}
    assert all(t.name.startswith("FusedBack_") for t in m.tensors)
    assert sum(t.nbytes for t in m.tensors) + sum(t.nbytes for t in m.gpu_tensors) == 3 * fp16_bytes


@pytest.mark.parametrize("name", ["tiny-cnn", "tiny-vit", "tiny-if", "tiny-embed"])
def test_models_without_half_weights_pack_exactly_as_before(name, zoo_file, tmp_path):
    src = zoo_file(name)
    assert _half_weight_exclusions(onnx.load(src, load_external_data=False)) == ()
    now = pack(src, tmp_path, "now", 1)
    before = pack(src, tmp_path, "before", 1, keep_half_weights=False)
    for f in (SKELETON_FILE, WEIGHTS_FILE):
        assert (tmp_path / "now" / "1" / f).read_bytes() == (tmp_path / "before" / "1" / f).read_bytes()
    assert [(t.name, t.dtype, t.offset, t.sha256) for t in now.tensors] == \
           [(t.name, t.dtype, t.offset, t.sha256) for t in before.tensors]


def test_a_half_weight_constant_node_counts(tmp_path):
    model = zoo.build("tiny-fp16")
    w = model.graph.initializer.pop(0)
    model.graph.node.insert(0, onnx.helper.make_node("Constant", [], [w.name], value=w))
    assert _half_weight_exclusions(model) == (HALF_TO_FLOAT_FUSION,)
    assert _half_weight_exclusions(model, keep_half_weights=False) == ()


@pytest.fixture(scope="module")
def daemon_with_fp16(tmp_path_factory, fp16_files):
    with daemon_with_models(tmp_path_factory.mktemp("fp16d"), fp16_files) as (d, c):
        yield d, c


@pytest.mark.parametrize("name", FP16_MODELS)
def test_the_host_tier_holds_the_fp16_bytes_and_clients_map_them(name, daemon_with_fp16, fp16_files):
    d, client = daemon_with_fp16
    fp16_bytes, count = fp16_bytes_in_blob(fp16_files[name])
    with modelcache.InferenceSession(name, client=client) as s:
        segments = s._lease.segments
        assert {t[1] for t in s._lease.tensors} == {"float16"}
        resident = sum(os.stat(p).st_size for p in segments)
        assert all(os.path.dirname(p) == str(d.shm_dir) for p in segments)
        assert fp16_bytes <= resident < fp16_bytes + count * ALIGN
        s.run(None, zoo.sample_inputs(fp16_files[name]))


@pytest.mark.parametrize("mode", ["attach", "serve"])
@pytest.mark.parametrize("name", FP16_MODELS)
def test_outputs_equal_plain_ort(name, mode, daemon_with_fp16, fp16_files):
    _, client = daemon_with_fp16
    src = fp16_files[name]
    feeds = zoo.sample_inputs(src, batch=3)
    want = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    with modelcache.InferenceSession(name, client=client, mode=mode) as s:
        got = s.run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        half_close(g, w)
