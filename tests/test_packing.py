import hashlib
import os
import signal
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from modelcache import zoo
from modelcache.errors import PackError
from modelcache.session_options import attach_session_options
from modelcache.store.format import ALIGN, SKELETON_FILE, WEIGHTS_FILE, iter_graphs, load_manifest
from modelcache.store.packing import pack
from modelcache.tiers.disk import Repository
from conftest import TINY


def run_packed(model_dir, feeds):
    sess = ort.InferenceSession(str(model_dir / SKELETON_FILE), attach_session_options(),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("name", TINY)
def test_packed_model_gives_the_same_outputs(name, zoo_file, tmp_path):
    src = zoo_file(name)
    m = pack(src, tmp_path, name, 1)
    feeds = zoo.sample_inputs(src)
    ref = ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)
    for got, want in zip(run_packed(tmp_path / name / "1", feeds), ref):
        assert got.dtype == want.dtype
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=1e-4, atol=1e-5)
    assert m.inputs and m.outputs


def test_blob_layout_aligned_hashed_and_skeleton_weightless(zoo_file, tmp_path):
    src = zoo_file("tiny-vit")
    m = pack(src, tmp_path, "v", 1)
    d = tmp_path / "v" / "1"
    blob = (d / WEIGHTS_FILE).read_bytes()
    assert len(blob) == m.weights_bytes and m.tensors
    for t in m.tensors:
        assert t.offset % ALIGN == 0
        assert hashlib.sha256(blob[t.offset:t.offset + t.nbytes]).hexdigest() == t.sha256
    # The skeleton holds only small tensors inline; everything big points at the blob.
    skeleton = onnx.load(str(d / SKELETON_FILE), load_external_data=False)
    for g in iter_graphs(skeleton.graph):
        for t in g.initializer:
            assert t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) < 1024
    assert (d / SKELETON_FILE).stat().st_size < 0.1 * m.weights_bytes
    assert load_manifest(d) == m


def test_subgraph_initializers_move_to_the_blob(zoo_file, tmp_path):
    m = pack(zoo_file("tiny-if"), tmp_path, "if", 1)
    assert len(m.tensors) == 2  # one weight per branch, both inside the If's subgraphs


def test_non_float_types_survive(zoo_file, tmp_path):
    m = pack(zoo_file("tiny-embed"), tmp_path, "e", 1)
    assert {i.dtype for i in m.inputs} == {"int64", "bool"}
    m16 = pack(zoo_file("tiny-fp16"), tmp_path, "h", 1)
    assert {i.dtype for i in m16.inputs + m16.outputs} == {"float16"}
    # fp16 weights stay fp16 in the blob at every level (test_half_weights.py has the why and the rest).
    assert {t.dtype for t in m16.tensors} == {"float16"}
    raw = pack(zoo_file("tiny-fp16"), tmp_path, "h", 2, opt_level="disable")
    assert {t.dtype for t in raw.tensors} == {"float16"}
    int8 = pack(zoo_file("tiny-embed"), tmp_path, "e", 2, opt_level="disable")
    assert "int8" in {t.dtype for t in int8.tensors}


def test_model_with_external_data(tmp_path):
    src = tmp_path / "ext" / "model.onnx"
    src.parent.mkdir()
    zoo.save(zoo.build("tiny-vit"), str(src), external_data=True)
    assert (tmp_path / "ext" / "model.onnx.data").exists()
    pack(str(src), tmp_path / "repo", "ext", 1)
    feeds = zoo.sample_inputs(str(src))
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_allclose(run_packed(tmp_path / "repo" / "ext" / "1", feeds)[0], ref[0], rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not os.environ.get("MODELCACHE_TEST_HUGE"), reason="writes > 4 GB; set MODELCACHE_TEST_HUGE=1")
def test_model_over_2gb(tmp_path):
    g = zoo.GraphBuilder("huge")
    x = "x"
    for _ in range(3):  # 3 x 750 MB
        x = g.node("MatMul", [x, g.const("w", np.ones((14000, 14000), np.float32) / 14000)])
    g.nodes[-1].output[0] = "y"
    model = g.build([onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 14000])],
                    [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 14000])])
    src = str(tmp_path / "huge.onnx")
    zoo.save(model, src, external_data=True)
    m = pack(src, tmp_path / "repo", "huge", 1)
    assert m.weights_bytes > 2**31
    out = run_packed(tmp_path / "repo" / "huge" / "1", {"x": np.ones((1, 14000), np.float32)})[0]
    np.testing.assert_allclose(out, 1.0, rtol=1e-3)


@pytest.mark.parametrize("content, says", [
    (b"", "not a valid ONNX model"),
    (b"this is not protobuf at all \x00\xff", "not a valid ONNX model"),
])
def test_invalid_files_are_refused(tmp_path, content, says):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(content)
    with pytest.raises(PackError, match=says):
        pack(str(bad), tmp_path / "repo", "bad", 1)
    assert Repository(tmp_path / "repo").scan() == []


def test_truncated_file_is_refused(zoo_file, tmp_path):
    data = open(zoo_file("tiny-cnn"), "rb").read()
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(PackError):
        pack(str(bad), tmp_path / "repo", "t", 1)


def test_model_ort_cannot_build_is_refused(tmp_path):
    # Valid to the checker, but the shapes cannot multiply: ORT refuses it.
    g = zoo.GraphBuilder("broken")
    g.nodes.append(onnx.helper.make_node("MatMul", ["x", g.const("w", np.ones((3, 4), np.float32))], ["y"]))
    model = g.build([onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 5])],
                    [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2, 4])])
    src = str(tmp_path / "broken.onnx")
    onnx.save(model, src)
    with pytest.raises(PackError):
        pack(src, tmp_path / "repo", "broken", 1)


def test_missing_file_and_bad_name(tmp_path, zoo_file):
    with pytest.raises(PackError, match="no such file"):
        pack(str(tmp_path / "nothing.onnx"), tmp_path, "x", 1)
    with pytest.raises(PackError, match="invalid model name"):
        pack(zoo_file("tiny-cnn"), tmp_path, "../escape", 1)


def test_existing_version_is_not_overwritten(zoo_file, tmp_path):
    pack(zoo_file("tiny-cnn"), tmp_path, "m", 1)
    with pytest.raises(PackError, match="already exists"):
        pack(zoo_file("tiny-cnn"), tmp_path, "m", 1)


def test_a_replacement_is_packed_beside_the_version_and_swapped_in_by_two_renames(tmp_path):
    """daemon/swaps.py's store half: the pack publishes beside the version (never listed as one), the swap puts it
    in place; a daemon's start settles what a stop left between the two (Repository._settle_staged)."""
    from modelcache.store.reservations import staged_path
    old_model, new_model = zoo.build("tiny-cnn", seed=1), zoo.build("tiny-cnn", seed=2)
    for i, m in enumerate((old_model, new_model)):
        zoo.save(m, str(tmp_path / f"{i}.onnx"))
    repo = Repository(tmp_path / "repo")
    pack(str(tmp_path / "0.onnx"), repo.root, "m", 1)
    before = load_manifest(repo.model_dir("m", 1)).source_sha256
    pack(str(tmp_path / "1.onnx"), repo.root, "m", 1, replacing=True)
    staged = staged_path(repo.root, "m", 1)
    assert [v for _, v, _ in repo.version_dirs("m")] == [1] and staged.is_dir()
    assert load_manifest(repo.model_dir("m", 1)).source_sha256 == before   # (the old one serves meanwhile)
    repo.replace("m", 1, staged)
    assert load_manifest(repo.model_dir("m", 1)).source_sha256 != before and not staged.exists()
    assert not list(repo.root.glob(".tmp-*"))
    # A stop before the swap: at the next start the version stays as it was, the staged pack goes.
    pack(str(tmp_path / "0.onnx"), repo.root, "m", 1, replacing=True)
    now = load_manifest(repo.model_dir("m", 1)).source_sha256
    assert [m.source_sha256 for _, m in repo.scan()] == [now] and not staged.exists()
    # A stop between the two renames (the old one aside, the new one not yet in): at the start it goes in.
    pack(str(tmp_path / "0.onnx"), repo.root, "m", 1, replacing=True)
    repo.model_dir("m", 1).rename(repo.root / ".tmp-removed-x")
    assert [m.source_sha256 for _, m in repo.scan()] == [before] and not staged.exists()
    with pytest.raises(PackError, match="already exists"):   # (without `replacing`, as ever)
        pack(str(tmp_path / "1.onnx"), repo.root, "m", 1)


def test_kill_during_add_never_leaves_a_half_model(zoo_file, tmp_path):
    src = zoo_file("resnet50")
    repo = tmp_path / "repo"
    code = f"from modelcache.store.packing import pack; pack({src!r}, __import__('pathlib').Path({str(repo)!r}), 'r', 1)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    # Kill it once the temp dir exists, i.e. in the middle of packing.
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(repo.glob(".tmp-*")) and proc.poll() is None:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    found = Repository(repo).scan()  # sweeps .tmp-* left by the kill
    assert found == [] or [m.name for _, m in found] == ["r"]
    assert not list(repo.glob(".tmp-*"))
    if found:
        assert (found[0][0] / WEIGHTS_FILE).stat().st_size == found[0][1].weights_bytes


def test_format_element_types_agree_with_onnx():
    # format.py sizes tensors without onnx: its table must say what onnx's numpy dtypes say.
    from modelcache.store.format import ONNX_ELEMENT_TYPES

    known = {v for _, v in onnx.TensorProto.DataType.items() if v != onnx.TensorProto.UNDEFINED}
    assert set(ONNX_ELEMENT_TYPES) == known
    for elem_type, (name, itemsize) in ONNX_ELEMENT_TYPES.items():
        np_dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        assert (name, itemsize) == (np_dtype.name, np_dtype.itemsize), elem_type


def test_what_only_reads_a_stored_model_imports_neither_onnx_nor_the_packer():
    readers = ["modelcache.store.format", "modelcache.tiers.host", "modelcache.tiers.disk", "modelcache.tiers.remote",
               "modelcache.tiers.adopt", "modelcache.daemon.registry", "modelcache.store.scrub"]
    code = ("import sys\n" + "".join(f"import {m}\n" for m in readers) +
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('onnx', 'onnxruntime')"
            " or m == 'modelcache.store.packing'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
