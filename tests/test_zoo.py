import numpy as np
import onnx
import onnxruntime as ort
import pytest

from modelcache import zoo

PUBLISHED = [n for n, e in zoo.ZOO.items() if e.published_params]


@pytest.mark.slow
@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_counts_match_published_within_one_percent(name):
    model = zoo.build(name)
    published = zoo.ZOO[name].published_params
    assert abs(zoo.count_params(model) / published - 1) < 0.01


@pytest.mark.parametrize("name", [n for n in zoo.names() if n.startswith("tiny")])
def test_tiny_models_are_valid_and_run(name, zoo_file):
    path = zoo_file(name)
    onnx.checker.check_model(path)
    out = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, zoo.sample_inputs(path))
    assert all(np.isfinite(o.astype(np.float32)).all() for o in out)


def test_seed_decides_weights():
    a, b, c = zoo.build("tiny-cnn", 1), zoo.build("tiny-cnn", 1), zoo.build("tiny-cnn", 2)
    assert a.graph.initializer[0].raw_data == b.graph.initializer[0].raw_data
    assert a.graph.initializer[0].raw_data != c.graph.initializer[0].raw_data


def test_unknown_name_lists_known():
    with pytest.raises(KeyError, match="resnet50"):
        zoo.build("resnet9000")
