"""The GPU variant that packing writes: model.gpu.onnx, its stubs, its tensors in weights.bin.

No GPU is needed: the GPU skeleton is built here on the CPU build of ORT exactly as a GPU client
builds it (optimizers off, each stub overridden by add_initializer through `bind_weights`), only
with OrtValues over the host mapping of weights.bin instead of device memory.
"""

import hashlib
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from modelcache import zoo
from modelcache.errors import PackError
from modelcache.session_options import attach_session_options, bind_weights
from modelcache.store.format import (ALIGN, GPU_SKELETON_FILE, GPU_STUB_FILE, MANIFEST_FILE, WEIGHTS_FILE, Manifest,
                                     iter_graphs, load_manifest)
from modelcache.store.packing import INLINE_MAX_BYTES, OPT_LEVELS, check_gpu_skeleton, is_gpu_shared_weight, pack
from conftest import TINY


def run_gpu_skeleton(model_dir, manifest, feeds):
    """Outputs of the GPU skeleton with its weights bound the way clients bind them."""
    so = attach_session_options()
    tensors = [[t.name, t.dtype, t.shape, 0, t.offset, t.nbytes] for t in manifest.gpu_tensors]
    maps, values = bind_weights(so, [str(model_dir / WEIGHTS_FILE)], tensors)  # noqa: F841 (must outlive the run)
    sess = ort.InferenceSession(str(model_dir / GPU_SKELETON_FILE), so, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def plain_outputs(src, feeds, opt_level=None):
    """Plain ORT over the source file: at its default level, or at `opt_level` with prepacking off."""
    so = ort.SessionOptions()
    if opt_level is not None:
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, OPT_LEVELS[opt_level])
        so.add_session_config_entry("session.disable_prepacking", "1")
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def initializers(path):
    return [t for g in iter_graphs(onnx.load(str(path), load_external_data=False).graph) for t in g.initializer]


@pytest.mark.parametrize("opt_level", ["all", "basic", "disable"])
@pytest.mark.parametrize("name", TINY)
def test_gpu_skeleton_gives_the_source_models_outputs(name, opt_level, zoo_file, tmp_path):
    """Bit-identical to plain ORT at the GPU skeleton's own level (prepacking off): same graph, same
    kernels, so any byte of a weight bound wrong would show. Against plain ORT at its default level
    (ENABLE_ALL, prepacked weights) float32 sums run in another order: measured up to 6.3e-6
    relative (tiny-if), hence rtol 1e-5 there."""
    src = zoo_file(name)
    m = pack(src, tmp_path, name, 1, opt_level=opt_level)
    feeds = zoo.sample_inputs(src, batch=2)
    got = run_gpu_skeleton(tmp_path / name / "1", m, feeds)
    assert m.gpu_opt_level in ("basic", "disable")
    for g, same_graph, default in zip(got, plain_outputs(src, feeds, m.gpu_opt_level), plain_outputs(src, feeds)):
        assert g.dtype == default.dtype and g.shape == default.shape
        np.testing.assert_array_equal(g, same_graph)
        np.testing.assert_allclose(g.astype(np.float64), default.astype(np.float64), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-cnn", "tiny-vit", "tiny-if", "tiny-embed"])
def test_float32_models_get_the_basic_graph(name, zoo_file, tmp_path):
    assert pack(zoo_file(name), tmp_path, "m", 1).gpu_opt_level == "basic"
    assert pack(zoo_file(name), tmp_path, "m", 2, opt_level="disable").gpu_opt_level == "disable"


def test_fp16_stays_fp16_without_the_cpu_casts(zoo_file, tmp_path):
    src = zoo_file("tiny-fp16")
    m = pack(src, tmp_path, "h", 1)
    # The CPU build inserts Casts around fp16 MatMuls at every level: the GPU graph is the source's.
    assert m.gpu_opt_level == "disable"
    assert {t.dtype for t in m.gpu_tensors} == {"float16"} and len(m.gpu_tensors) == 2
    gpu = onnx.load(str(tmp_path / "h" / "1" / GPU_SKELETON_FILE), load_external_data=False)
    ops = [n.op_type for g in iter_graphs(gpu.graph) for n in g.node]
    assert ops == [n.op_type for n in onnx.load(src).graph.node] == ["MatMul", "Relu", "MatMul"]
    assert {t.data_type for t in initializers(tmp_path / "h" / "1" / GPU_SKELETON_FILE)} == {TensorProto.FLOAT16}
    # The CPU skeleton at "all" keeps the same fp16 weights (its Casts run in the client): each GPU stub
    # reuses a CPU tensor's bytes, so the blob holds every weight once.
    assert {t.dtype for t in m.tensors} == {"float16"}
    cpu_offsets = {t.sha256: t.offset for t in m.tensors}
    assert {t.offset for t in m.gpu_tensors} == {cpu_offsets[t.sha256] for t in m.gpu_tensors}
    assert m.weights_bytes == max(t.offset + t.nbytes for t in m.tensors)


@pytest.mark.parametrize("name", TINY)
def test_stubs_are_external_in_a_sparse_file_and_the_rest_inline(name, zoo_file, tmp_path):
    m = pack(zoo_file(name), tmp_path, name, 1)
    d = tmp_path / name / "1"
    assert m.gpu_skeleton == GPU_SKELETON_FILE and m.gpu_tensors
    entries = {t.name: t for t in m.gpu_tensors}
    stubs, inline_bytes = set(), 0
    for t in initializers(d / GPU_SKELETON_FILE):
        if t.name in entries:
            stubs.add(t.name)
            e = entries[t.name]
            assert t.data_location == TensorProto.EXTERNAL and not t.raw_data
            assert {x.key: x.value for x in t.external_data} == {
                "location": GPU_STUB_FILE, "offset": "0", "length": str(e.nbytes)}
            assert list(t.dims) == e.shape and is_gpu_shared_weight(t)
            assert onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name == e.dtype
        else:  # integer constants, small tensors: inline with their real data
            assert t.data_location != TensorProto.EXTERNAL and not is_gpu_shared_weight(t)
            assert numpy_helper.to_array(t).size == int(np.prod(t.dims))
            inline_bytes += numpy_helper.to_array(t).nbytes
    assert stubs == set(entries)
    stub = os.stat(d / GPU_STUB_FILE)
    assert stub.st_size >= max(t.nbytes for t in m.gpu_tensors)
    assert stub.st_blocks * 512 <= 4096, "the stub file should be sparse"
    # Weightless but for what stays inline (tiny-embed's int8 weight).
    assert (d / GPU_SKELETON_FILE).stat().st_size - inline_bytes < 0.1 * sum(t.nbytes for t in m.gpu_tensors)


def test_integer_weights_stay_inline(zoo_file, tmp_path):
    m = pack(zoo_file("tiny-embed"), tmp_path, "e", 1)
    inline = {t.name: t for t in initializers(tmp_path / "e" / "1" / GPU_SKELETON_FILE)
              if t.data_location != TensorProto.EXTERNAL}
    # The int8 weight (2 KiB, external data in the CPU skeleton) and the int64 axes are inline here.
    assert {TensorProto.INT8, TensorProto.INT64} <= {t.data_type for t in inline.values()}
    assert any(t.data_type == TensorProto.INT8 and len(t.raw_data) >= INLINE_MAX_BYTES for t in inline.values())
    assert [t.dtype for t in m.gpu_tensors] == ["float32"]  # the embedding table


@pytest.mark.parametrize("name", TINY)
def test_gpu_tensors_are_aligned_hashed_and_deduplicated_at_basic(name, zoo_file, tmp_path):
    m = pack(zoo_file(name), tmp_path, name, 1, opt_level="basic")
    blob = (tmp_path / name / "1" / WEIGHTS_FILE).read_bytes()
    assert len(blob) == m.weights_bytes
    cpu_at = {t.sha256: t.offset for t in m.tensors}
    for t in m.gpu_tensors:
        assert t.offset % ALIGN == 0
        assert hashlib.sha256(blob[t.offset:t.offset + t.nbytes]).hexdigest() == t.sha256
        if t.sha256 in cpu_at:
            assert t.offset == cpu_at[t.sha256]
        else:  # only weights the CPU skeleton keeps inline may need bytes of their own
            assert t.nbytes < INLINE_MAX_BYTES
    fresh = {t.sha256 for t in m.gpu_tensors if t.sha256 not in cpu_at}
    cpu_end = max((t.offset + t.nbytes for t in m.tensors), default=0)
    assert m.weights_bytes - cpu_end <= ALIGN * len(fresh)


def test_a_name_held_by_different_tensors_in_sibling_subgraphs_stays_inline(tmp_path):
    # add_initializer overrides a name in every subgraph, so two different "w" cannot both be lent.
    def branch(tag, w):
        return helper.make_graph([helper.make_node("MatMul", ["x", w.name], [f"y_{tag}"])], tag, [],
                                 [helper.make_tensor_value_info(f"y_{tag}", TensorProto.FLOAT, [1, 16])], [w])

    rng = np.random.default_rng(0)
    w_then = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    w_else = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "w")
    same = numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), "v")
    inner = helper.make_node("If", ["flag"], ["y"], then_branch=branch("t", w_then), else_branch=branch("e", w_else))
    twin = helper.make_node("If", ["flag"], ["z"], then_branch=branch("t2", same), else_branch=branch("e2", same))
    graph = helper.make_graph(
        [inner, twin], "dup",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16]),
         helper.make_tensor_value_info("flag", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 16])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    src = str(tmp_path / "dup.onnx")
    onnx.save(model, src)
    m = pack(src, tmp_path / "repo", "dup", 1)
    assert [t.name for t in m.gpu_tensors] == ["v"]  # identical twins are lent once
    for flag in (True, False):
        feeds = {"x": rng.standard_normal((1, 16)).astype(np.float32), "flag": np.array(flag)}
        for got, want in zip(run_gpu_skeleton(tmp_path / "repo" / "dup" / "1", m, feeds), plain_outputs(src, feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("opt_level", ["all", "disable"])
def test_model_with_external_data(opt_level, tmp_path):
    # "disable" reads the source's own external data; "all" the BASIC output's.
    src = tmp_path / "ext" / "model.onnx"
    src.parent.mkdir()
    zoo.save(zoo.build("tiny-vit"), str(src), external_data=True)
    m = pack(str(src), tmp_path / "repo", "ext", 1, opt_level=opt_level)
    feeds = zoo.sample_inputs(str(src))
    got = run_gpu_skeleton(tmp_path / "repo" / "ext" / "1", m, feeds)
    np.testing.assert_array_equal(got[0], plain_outputs(str(src), feeds, m.gpu_opt_level)[0])
    assert all(t.data_location != TensorProto.EXTERNAL or t.name in {e.name for e in m.gpu_tensors}
               for t in initializers(tmp_path / "repo" / "ext" / "1" / GPU_SKELETON_FILE))


def test_progress_covers_both_passes(zoo_file, tmp_path):
    seen = []
    pack(zoo_file("tiny-vit"), tmp_path, "v", 1, progress=lambda done, total: seen.append((done, total)))
    totals = {total for _, total in seen}
    assert len(totals) == 1
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1][0] == seen[-1][1]


def test_check_refuses_a_manifest_that_disagrees_with_the_skeleton(zoo_file, tmp_path):
    # ORT itself builds a session over a wrong-shaped override, or reads the stub's zeros where one is missing.
    pack(zoo_file("tiny-cnn"), tmp_path, "c", 1)
    d = tmp_path / "c" / "1"
    wrong_shape = load_manifest(d)
    t = wrong_shape.gpu_tensors[0]
    t.shape, t.nbytes = [t.shape[0] * 2, *t.shape[1:]], t.nbytes * 2
    with pytest.raises(PackError, match="disagrees with its manifest"):
        check_gpu_skeleton(d, wrong_shape)
    missing = load_manifest(d)
    missing.gpu_tensors.pop()
    with pytest.raises(PackError, match="no GPU tensor for it"):
        check_gpu_skeleton(d, missing)
    check_gpu_skeleton(d, load_manifest(d))


def test_manifest_round_trip_and_old_manifests(zoo_file, tmp_path):
    m = pack(zoo_file("tiny-cnn"), tmp_path, "c", 1)
    assert load_manifest(tmp_path / "c" / "1") == m
    old = json.loads((tmp_path / "c" / "1" / MANIFEST_FILE).read_text())
    for key in ("gpu_skeleton", "gpu_opt_level", "gpu_tensors"):
        del old[key]
    loaded = Manifest.from_dict(old)
    assert (loaded.gpu_skeleton, loaded.gpu_opt_level, loaded.gpu_tensors) == ("", "", [])
    assert loaded.tensors == m.tensors
