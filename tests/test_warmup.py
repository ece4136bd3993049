"""Triton's model_warmup: read at import (triton_repo/warmup.py), and the requests its samples make (daemon/warmup.py).
A daemon warming a model as it is added and at its start: test_triton_repo.py."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from modelcache import zoo
from modelcache.calibration import check_serving
from modelcache.daemon.warmup import sample_requests
from modelcache.errors import InputError
from modelcache.store.packing import model_io
from modelcache.triton_repo.config import plan_model

ROW = 'dims: [ 3, 32, 32 ]'


def cnn_with(tmp_path, warmup: str, batch: int = 4, extra: str = ""):
    model = tmp_path / "cnn"
    (model / "1").mkdir(parents=True, exist_ok=True)
    if not (model / "1" / "model.onnx").exists():
        zoo.save(zoo.build("tiny-cnn"), str(model / "1" / "model.onnx"))
    (model / "config.pbtxt").write_text(f"max_batch_size: {batch}\n{extra}\nmodel_warmup [ {warmup} ]\n")
    return plan_model(model, model_io)


def test_each_kind_of_data_is_read_and_a_batch_of_zero_is_skipped(tmp_path):
    (tmp_path / "cnn" / "warmup").mkdir(parents=True)
    (tmp_path / "cnn" / "warmup" / "row.bin").write_bytes(np.full((3, 32, 32), 0.5, np.float32).tobytes() + b"more")
    plan = cnn_with(tmp_path, f'''
        {{ name: "z" batch_size: 2 count: 3 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} zero_data: true }} }} }},
        {{ name: "r" batch_size: 1 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} random_data: true }} }} }},
        {{ name: "f" batch_size: 4 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} input_data_file: "row.bin" }} }} }},
        {{ name: "none" batch_size: 0 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} zero_data: true }} }} }}''')
    samples = plan.serving["warmup"]
    check_serving(plan.serving)
    assert [(s["name"], s["batch_size"], s["count"]) for s in samples] == [("z", 2, 3), ("r", 1, 1), ("f", 4, 1)]
    assert plan.not_honoured == []
    [zeros] = sample_requests(samples[0], max_batch=4)   # one request of batch_size rows
    assert zeros["input"].shape == (2, 3, 32, 32) and not zeros["input"].any()
    [noise] = sample_requests(samples[1], max_batch=4)
    assert noise["input"].dtype == np.float32 and noise["input"].shape == (1, 3, 32, 32)
    np.testing.assert_array_equal(noise["input"], sample_requests(samples[1], max_batch=4)[0]["input"])  # seeded
    [rows] = sample_requests(samples[2], max_batch=4)    # the file's one row, four times (its extra bytes unused)
    assert rows["input"].shape == (4, 3, 32, 32) and (rows["input"] == 0.5).all()
    # without batching: batch_size requests of the dims as given (Triton adds no batch dimension)
    alone = sample_requests({**samples[0], "inputs": {"input": {"dtype": "float32", "dims": [1, 3, 32, 32],
                                                                "fill": "zero"}}}, max_batch=0)
    assert len(alone) == 2 and alone[0]["input"].shape == (1, 3, 32, 32)


def test_strings_and_reshapes_are_made_as_the_model_takes_them():
    strings = {"name": "s", "batch_size": 2, "count": 1,
               "inputs": {"text": {"dtype": "object", "dims": [3], "fill": "zero"},
                          "flat": {"dtype": "int64", "dims": [6], "fill": "zero", "reshape": [2, 3]}}}
    check_serving({"warmup": [strings]})
    [feeds] = sample_requests(strings, max_batch=8)
    assert feeds["text"].shape == (2, 3) and feeds["text"].dtype == object and set(feeds["text"].ravel()) == {""}
    assert feeds["flat"].shape == (2, 2, 3)


def test_a_files_strings_are_read_at_import_and_made_into_the_requests(tmp_path):
    """TYPE_STRING from input_data_file: length-prefixed elements, as Triton reads them; kept decoded."""
    import struct

    from google.protobuf import text_format

    from modelcache.triton_protos import model_config_pb2 as mc
    from modelcache.triton_repo.warmup import samples
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "words").write_bytes(b"".join(struct.pack("<I", len(w)) + w for w in (b"hello", b"")))
    config = text_format.Parse('max_batch_size: 4 input [ { name: "text" data_type: TYPE_STRING dims: [ 2 ] } ] '
                               'model_warmup [ { name: "w" batch_size: 3 inputs { key: "text" value { '
                               'data_type: TYPE_STRING dims: [ 2 ] input_data_file: "words" } } } ]', mc.ModelConfig())
    [sample] = samples(config, tmp_path)
    assert sample["inputs"]["text"]["strings"] == ["hello", ""]
    check_serving({"warmup": [sample]})
    [feeds] = sample_requests(sample, max_batch=4)
    assert feeds["text"].shape == (3, 2) and feeds["text"].tolist() == [["hello", ""]] * 3
    (tmp_path / "warmup" / "words").write_bytes(struct.pack("<I", 5) + b"hello")   # one string for two
    with pytest.raises(InputError, match="ends after 1 of 2 elements"):
        samples(config, tmp_path)


@pytest.mark.parametrize("warmup, words", [
    ('{ name: "w" batch_size: 1 inputs { key: "input" value { data_type: TYPE_FP32 dims: [ -1, 32, 32 ] '
     'zero_data: true } } }', "warmup setting expects all variable-size dimensions are specified for input 'input'"),
    (f'{{ name: "w" batch_size: 1 inputs {{ key: "image" value {{ data_type: TYPE_FP32 {ROW} zero_data: true }} }} }}',
     "input 'image' is not an input of the model's configuration"),
    (f'{{ name: "w" batch_size: 1 inputs {{ key: "input" value {{ data_type: TYPE_INT32 {ROW} zero_data: true }} }} }}',
     "input 'input' is TYPE_INT32, the model's is TYPE_FP32"),
    ('{ name: "w" batch_size: 1 inputs { key: "input" value { data_type: TYPE_FP32 dims: [ 3, 16, 16 ] '
     'zero_data: true } } }', r"has dims \[3, 16, 16\]; the model's configuration says \[3, 32, 32\]"),
    (f'{{ name: "w" batch_size: 8 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} zero_data: true }} }} }}',
     "batch_size 8 is more than max_batch_size 4"),
    (f'{{ name: "w" batch_size: 1 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} }} }} }}',
     "warmup setting expects input 'input' to have input_data_type set"),
    (f'{{ name: "w" batch_size: 1 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} '
     'input_data_file: "absent.bin" } } }', "cannot read"),
    (f'{{ name: "w" batch_size: 1 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} '
     'input_data_file: "../config.pbtxt" } } }', "outside the model's warmup/ folder"),
    (f'{{ name: "w" batch_size: 1 inputs {{ key: "input" value {{ data_type: TYPE_FP32 {ROW} '
     'input_data_file: "short.bin" } } }', "warmup setting expects 12288 bytes, but the data provided from "
                                          "short.bin only has 8 bytes"),
    ('{ name: "w" batch_size: 1 }', "no data for input 'input'"),
])
def test_a_warmup_triton_would_refuse_or_the_model_cannot_take_is_refused_at_import(tmp_path, warmup, words):
    (tmp_path / "cnn" / "warmup").mkdir(parents=True)
    (tmp_path / "cnn" / "warmup" / "short.bin").write_bytes(b"\0" * 8)
    with pytest.raises(InputError, match=words):
        cnn_with(tmp_path, warmup)


def test_a_stateful_models_warmup_is_listed_not_run(tmp_path):
    from test_sequence_serving import RNN_CONFIG, rnn
    (tmp_path / "rnn" / "1").mkdir(parents=True)
    onnx.save(rnn(True), str(tmp_path / "rnn" / "1" / "model.onnx"))
    (tmp_path / "rnn" / "config.pbtxt").write_text(RNN_CONFIG + 'model_warmup [ { name: "w" batch_size: 1 inputs { '
                                                   'key: "x" value { data_type: TYPE_FP32 dims: [ 4 ] zero_data: true '
                                                   '} } } ]')
    plan = plan_model(tmp_path / "rnn", model_io)
    assert "warmup" not in plan.serving and plan.not_honoured == ["model_warmup"]


@pytest.mark.parametrize("warmup, words", [
    ("zeros", "warmup must be a list"),
    ([{"name": "w", "batch_size": 0, "count": 1, "inputs": {}}], "batch_size must be 1 to"),
    ([{"name": "w", "batch_size": 1, "count": 1, "inputs": {"x": {"dtype": "float32", "dims": [-1], "fill": "zero"}}}],
     "must give its dtype, dims"),
    ([{"name": "w", "batch_size": 1, "count": 1, "inputs": {"x": {"dtype": "float32", "dims": [1 << 20, 1 << 10],
                                                                  "fill": "zero"}}}], "more than 256 MiB"),
])
def test_check_serving_refuses_a_malformed_or_huge_warmup(warmup, words):
    with pytest.raises(ValueError, match=words):
        check_serving({"warmup": warmup})
