"""The drop-in promise: code written for onnxruntime.InferenceSession runs on modelcache.InferenceSession.

Each statement of docs/sessions.md's "Differences from onnxruntime.InferenceSession" is checked here, against a
real daemon and plain ONNX Runtime side by side.
"""

from __future__ import annotations

import inspect
import threading

import numpy as np
import onnxruntime as ort
import pytest

import modelcache
from modelcache import zoo
from modelcache.errors import InputError, ModelNotFound
from conftest import daemon_with_models

MODES = ["attach", "serve"]
X = np.random.default_rng(0).standard_normal((1, 3, 32, 32)).astype(np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(client, {name: source path}) with tiny-cnn as "cnn", tiny-embed as "embed", tiny-if as "if"..."""
    root = tmp_path_factory.mktemp("dropin")
    paths = {}
    for name, zoo_name in (("cnn", "tiny-cnn"), ("embed", "tiny-embed"), ("if", "tiny-if"), ("ir3", "tiny-ir3")):
        paths[name] = str(root / f"{zoo_name}.onnx")
        zoo.save(zoo.build(zoo_name), paths[name])
    with daemon_with_models(root, paths) as (_, c):
        yield c, paths


def plain(path: str, so=None):
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def test_the_positional_arguments_are_onnxruntimes():
    ours = list(inspect.signature(modelcache.InferenceSession.__init__).parameters)[1:5]
    theirs = list(inspect.signature(ort.InferenceSession.__init__).parameters)[1:5]
    assert ours[1:] == theirs[1:] == ["sess_options", "providers", "provider_options"]
    assert inspect.signature(modelcache.InferenceSession.__init__).parameters["version"].kind is \
        inspect.Parameter.KEYWORD_ONLY


def test_sess_options_positional_copied_and_left_untouched(models):
    """ORT's call, sess_options second: its settings apply; the caller's object is not changed, so it
    serves another modelcache session and a plain one (it used to fail: 'already been added')."""
    c, paths = models
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    with modelcache.InferenceSession("cnn", so, ["CPUExecutionProvider"], client=c) as a, \
            modelcache.InferenceSession("cnn", so, client=c) as b:
        got = a.get_session_options()
        assert got.intra_op_num_threads == 1 and got.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert got.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL   # optimized at add time
        np.testing.assert_array_equal(a.run(None, {"input": X})[0], b.run(None, {"input": X})[0])
    assert so.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    np.testing.assert_allclose(plain(paths["cnn"], so).run(None, {"input": X})[0],
                               modelcache.InferenceSession("cnn", so, client=c).run(None, {"input": X})[0],
                               rtol=1e-5, atol=1e-5)


def test_profiling_as_in_onnxruntime(models, tmp_path):
    c, _ = models
    so = ort.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "profile")
    s = modelcache.InferenceSession("cnn", so, client=c)
    s.run(None, {"input": X})
    assert s.get_profiling_start_time_ns() > 0
    written = s.end_profiling()
    s.close()
    assert written.startswith(str(tmp_path / "profile")) and '"name"' in open(written).read()


def test_provider_options_as_onnxruntime_takes_them(models):
    c, paths = models
    with modelcache.InferenceSession("cnn", None, ["CPUExecutionProvider"], [{}], client=c) as s:
        assert s.get_providers() == plain(paths["cnn"]).get_providers()
        assert s.get_provider_options() == plain(paths["cnn"]).get_provider_options()
    with pytest.raises(ValueError, match="same length"):
        modelcache.InferenceSession("cnn", None, ["CPUExecutionProvider"], [{}, {}], client=c)


@pytest.mark.parametrize("mode", MODES)
def test_lists_are_converted_to_the_declared_dtype_as_onnxruntime_does(models, mode):
    c, paths = models
    feeds = {"ids": [[1, 2, 3], [4, 5, 6]], "mask": [[True, True, False], [True, False, False]]}   # int64, bool
    want = plain(paths["embed"]).run(None, feeds)[0]
    with modelcache.InferenceSession("embed", client=c, mode=mode) as s:
        np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-5, atol=1e-5)
    with modelcache.InferenceSession("cnn", client=c, mode=mode) as s:
        np.testing.assert_allclose(s.run(None, {"input": X.tolist()})[0], plain(paths["cnn"]).run(None, {"input": X})[0],
                                   rtol=1e-5, atol=1e-5)
        # What ORT refuses, refused too: a numpy array of another dtype, a list that is not numbers.
        with pytest.raises(InputError, match="must be float32, got float64"):
            s.run(None, {"input": X.astype(np.float64)})
        with pytest.raises(InputError, match="cannot make a float32 tensor of that list"):
            s.run(None, {"input": [["a"]]})
    x = np.ones((2, 64), np.float32)
    with modelcache.InferenceSession("if", client=c, mode=mode) as s:   # a Python scalar for a 0-d bool input
        with pytest.raises(RuntimeError, match="Unable to handle object of type <class 'bool'>"):
            plain(paths["if"]).run(None, {"x": x, "flag": True})
        np.testing.assert_allclose(s.run(None, {"x": x, "flag": True})[0],
                                   plain(paths["if"]).run(None, {"x": x, "flag": np.array(True)})[0], rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_a_path_or_bytes_say_how_to_add_the_model(models, mode):
    c, paths = models
    with pytest.raises(ModelNotFound, match=r"opens models by name: add it first with `modelcache add .*tiny-cnn.onnx "
                                            r"--name NAME`"):
        modelcache.InferenceSession(paths["cnn"], client=c, mode=mode)
    with pytest.raises(ModelNotFound, match=r"^no model named 'ghost'; known models: cnn, embed, if, ir3$"):
        modelcache.InferenceSession("ghost", client=c, mode=mode)   # a plain name: no hint
    with pytest.raises(TypeError, match="not from serialized bytes"):
        modelcache.InferenceSession(b"\x08\x03", client=c, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_version_is_keyword_int_or_int_string(models, mode):
    c, _ = models
    with modelcache.InferenceSession("cnn", version="1", client=c, mode=mode) as s:
        assert s.model_version == 1
    for bad in ("one", 0, True, 1.0):
        with pytest.raises(TypeError, match="version must be an int >= 1"):
            modelcache.InferenceSession("cnn", version=bad, client=c, mode=mode)
    with pytest.raises(TypeError, match="unexpected keyword argument 'prepackd'"):
        modelcache.InferenceSession("cnn", prepackd=False, client=c, mode=mode)
    with modelcache.InferenceSession("cnn", disabled_optimizers=["ConstantSharing"], enable_fallback=0,
                                     client=c, mode=mode):
        pass   # ORT's own keyword arguments: accepted


def test_attach_sessions_are_onnxruntime_sessions_underneath(models):
    c, paths = models
    ref = plain(paths["cnn"])
    want = ref.run(None, {"input": X})[0]
    with modelcache.InferenceSession("cnn", client=c) as s:
        binding = s.io_binding()
        binding.bind_cpu_input("input", X)
        binding.bind_output("logits")
        s.run_with_iobinding(binding)
        np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], want, rtol=1e-5, atol=1e-5)
        got = s.run_with_ort_values(None, {"input": ort.OrtValue.ortvalue_from_numpy(X)})[0].numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        assert (s.get_modelmeta().producer_name, s.get_modelmeta().graph_name) == \
            (ref.get_modelmeta().producer_name, ref.get_modelmeta().graph_name)
        done = threading.Event()
        results = []
        s.run_async(None, {"input": X}, lambda out, data, err: (results.append((out, err)), done.set()), None)
        assert done.wait(30) and results[0][1] == ""
        np.testing.assert_allclose(results[0][0][0], want, rtol=1e-5, atol=1e-5)
        with pytest.raises(NotImplementedError, match=r"set_providers\(\) is not supported: .*open a new"):
            s.set_providers(["CPUExecutionProvider"])
        assert not hasattr(s, "no_such_method")
    with pytest.raises(InputError, match="closed"):
        s.io_binding()


def test_serve_sessions_refuse_what_needs_an_ort_session_here(models):
    c, _ = models
    with modelcache.InferenceSession("cnn", client=c, mode="serve") as s:
        assert s.get_overridable_initializers() == []
        for method, why in (("get_providers", "chooses a worker"), ("get_modelmeta", "not its metadata"),
                            ("io_binding", "no ORT session"), ("get_session_options", "no ORT session")):
            with pytest.raises(NotImplementedError, match=f"{method}.*{why}.*mode='attach'"):
                getattr(s, method)()
    with pytest.raises(ValueError, match="mode='serve' takes no sess_options"):
        modelcache.InferenceSession("cnn", ort.SessionOptions(), client=c, mode="serve")
    with pytest.raises(ValueError, match="mode='serve' takes no providers"):
        modelcache.InferenceSession("cnn", providers=["CPUExecutionProvider"], client=c, mode="serve")


@pytest.mark.parametrize("mode", MODES)
def test_an_ir3_model_zoo_file_runs_with_only_its_real_input_fed(models, mode):
    """ShuffleNet's shape (zoo.tiny_ir3): its initializers are graph inputs; ORT's optimizer drops the
    repeated int64 shapes' initializers, and the packed graph used to ask for them (OC2_DUMMY_*)."""
    c, paths = models
    ref = plain(paths["ir3"])
    feeds = zoo.sample_inputs(paths["ir3"])
    assert list(feeds) == ["gpu_0/data_0"] == [i.name for i in ref.get_inputs()]
    with modelcache.InferenceSession("ir3", client=c, mode=mode) as s:
        assert [(i.name, i.shape) for i in s.get_inputs()] == [(i.name, i.shape) for i in ref.get_inputs()]
        np.testing.assert_allclose(s.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-5, atol=1e-6)


def test_an_ir3_model_packed_before_the_fix_says_to_add_it_again(tmp_path, monkeypatch):
    """What an older modelcache packed (the optimizer's value-less inputs kept) is found at open."""
    from conftest import DaemonProcess, stop_cleanly
    from modelcache.store import packing

    src = str(tmp_path / "ir3.onnx")
    zoo.save(zoo.build("tiny-ir3"), src)
    with monkeypatch.context() as m:   # the packing of before: no input dropped, none checked
        m.setattr(packing, "drop_inputs_without_values", lambda model, fed: model)
        m.setattr(packing, "_check_asks_for", lambda sess, fed, what: None)
        packing.pack(src, tmp_path / "repo", "ir3", 1)
    d = DaemonProcess(tmp_path).start()
    try:
        with d.client() as c, pytest.raises(modelcache.errors.ModelCacheError,
                                            match=r"ir3@1 was packed by an older modelcache.*OC2_DUMMY.*add the model "
                                                  r"again \(`modelcache add FILE --name ir3`\)"):
            modelcache.InferenceSession("ir3", client=c)
        stop_cleanly(d)
    finally:
        d.kill()


def test_a_version_given_in_sess_options_place_says_so(models):
    c, _ = models
    with pytest.raises(TypeError, match=r"sess_options must be an onnxruntime.SessionOptions, not int "
                                        r"\(a model version goes by keyword: version=1\)"):
        modelcache.InferenceSession("cnn", 1, client=c)
