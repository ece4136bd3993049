"""The ONNX backend corpus through modelcache vs plain ORT (modelcache/bench/conformance.py).

CI runs a seeded sample and every case of the value kinds serve mode once got wrong (0-d
tensors, strings, sequences, optionals); `modelcache bench conformance` runs the whole corpus.
"""

from __future__ import annotations

import numpy as np
import pytest

from modelcache.bench import conformance as C
from modelcache.errors import ProtocolError
from modelcache.wire import tensors
from conftest import DaemonProcess, stop_cleanly

SAMPLE = 60
PARTS = 3
TRICKY = ("sequence", "optional", "string", "scalar", "strnorm", "if_opt", "loop16_seq_none")


@pytest.fixture(scope="module")
def conformance_client(tmp_path_factory):
    root = tmp_path_factory.mktemp("conformance")
    d = DaemonProcess(root, {"MODELCACHE_LOG_LEVEL": "warning"}).start()
    try:
        with d.client(timeout_s=60) as c:
            yield c, root
        stop_cleanly(d)
    finally:
        d.kill()


def _check(results):
    failures = [(r.case, r.detail) for r in results if r.outcome == "fail"]
    assert not failures, failures
    assert any(r.outcome == "pass" for r in results)


@pytest.mark.slow
def test_a_sample_of_the_onnx_backend_corpus_runs_as_in_plain_ort(conformance_client):
    client, root = conformance_client
    _check(C.run(client, C.load_cases(sample=SAMPLE, seed=2026), root))


# In parts, so that pytest-xdist's workers share the minute these cases take instead of one worker ending the run.
@pytest.mark.parametrize("part", range(PARTS))
def test_scalars_strings_sequences_and_optionals_run_as_in_plain_ort(conformance_client, part):
    client, root = conformance_client
    cases = [c for c in C.load_cases(("node", "simple")) if any(t in c.name for t in TRICKY)]
    assert len(cases) > 30
    _check(C.run(client, cases[part::PARTS], root))


def test_composite_values_round_trip_and_malformed_ones_are_refused():
    value = {"seq": [np.arange(3, dtype=np.int64), np.array(2.5, np.float32)], "none": None,
             "map": [{1: np.float32(0.5), 2: np.float32(0.25)}], "s": np.array(["a", "é"], object)}
    wire, files = tensors.encode(value)
    assert files == []
    back, _ = tensors.decode(wire)
    assert back["none"] is None and back["seq"][1].shape == () and back["s"].tolist() == ["a", "é"]
    assert [sorted(m) for m in back["map"]] == [[1, 2]] and float(back["map"][0][2]) == 0.25
    deep = {"name": "x", "seq": []}
    for _ in range(tensors.MAX_NESTING + 1):
        deep = {"seq": [deep]}
    for bad in ({"name": "x", "map": [[[1], {"none": True}]]},   # an unhashable key
                {"name": "x", "seq": "not a list"},
                {"name": "x", "seq": [{"dtype": "float32", "shape": [1], "shm": "/dev/shm/modelcache-io.x"}]},
                {"name": "x", "dtype": "object", "shape": [2], "strings": ["a", 1]},
                {"name": "x", "dtype": "object", "shape": [3], "strings": ["a"]},
                {**deep, "name": "x"}):
        with pytest.raises(ProtocolError):
            tensors.decode([bad])
