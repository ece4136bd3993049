"""Triton's perf_analyzer, the load generator every Triton user measures with, against both fronts unchanged
(issue 44, part 7): a fixed-shape model, a model with a free dimension given by --shape, a stateful model
(sequence batching, implicit state) driven with --sequence-length, and the free-dimension model again with its
tensors in system shared memory (--shared-memory system). The binary comes
from `.ci/perf_analyzer.sh DIR` (CI runs it and sets MODELCACHE_PERF_ANALYZER); skipped with one line without it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from conftest import stop_cleanly
from test_triton_examples import sequence_model
from test_triton_repo import put_model, start_importing

BINARY = os.environ.get("MODELCACHE_PERF_ANALYZER", "")
pytestmark = pytest.mark.skipif(not (BINARY and os.access(BINARY, os.X_OK)),
                                reason="no perf_analyzer: `bash .ci/perf_analyzer.sh DIR`, then "
                                       "MODELCACHE_PERF_ANALYZER=DIR/perf_analyzer")


def fixed_model(path: Path) -> str:
    """Identity over a [1, 4] tensor: every dimension fixed."""
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "fixed",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    return str(path)


def perf_analyzer(*args: str) -> str:
    # (it measures nothing here: any three windows count as stable, on a machine other tests keep busy)
    r = subprocess.run([BINARY, *args, "--concurrency-range", "2", "--measurement-mode", "count_windows",
                        "--measurement-request-count", "50", "--stability-percentage", "999", "--max-trials", "6"],
                       env={**os.environ, "LD_LIBRARY_PATH": str(Path(BINARY).parent)}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_perf_analyzer_drives_both_fronts(tmp_path, zoo_file):
    repo = tmp_path / "models"   # a stateful model: a running sum kept by the server (implicit state), CORRID
    model, config = sequence_model("simple_string_dyna_sequence")
    # (perf_analyzer sends uint64 sequence ids: a uint64 CORRID)
    next(i for i in model.graph.input if i.name == "CORRID").type.tensor_type.elem_type = TensorProto.UINT64
    put_model(repo, "seq", model, config.replace("TYPE_STRING", "TYPE_UINT64"))
    d, grpc_at, http_at = start_importing(tmp_path, repo, {"MODELCACHE_CLIENT_SHARED_MEMORY": "1"})
    urls = {"grpc": grpc_at, "http": http_at}
    try:
        assert "1 versions imported" in d.log_path.read_text()
        with d.client() as c:
            c.add(fixed_model(tmp_path / "fixed.onnx"), "fixed")
            c.add(zoo_file("tiny-cnn"), "cnn")      # input [batch, 3, 32, 32]: its batch dim given by --shape
        for protocol in ("grpc", "http"):
            for model, extra in (("fixed", []), ("cnn", ["--shape", "input:2,3,32,32"]),
                                 ("seq", ["--sequence-length", "8"]),
                                 # its tensors in system shared memory: regions it makes, registers and names
                                 ("cnn", ["--shape", "input:2,3,32,32", "--shared-memory", "system",
                                          "--output-shared-memory-size", "65536"])):
                out = perf_analyzer("-m", model, "-u", urls[protocol], "-i", protocol, *extra)
                rate = re.search(r"Concurrency: 2, throughput: ([\d.]+) infer/sec, latency (\d+) usec", out)
                assert rate and float(rate.group(1)) > 0, out
                print(f"perf_analyzer -i {protocol} -m {model} {' '.join(extra)}: {rate.group(1)} infer/s, "
                      f"latency {int(rate.group(2)) / 1000:.2f} ms (concurrency 2)")
        with d.client() as c:
            served = c.stats().executor["served"]
        assert served >= 8 * 50                       # every window's requests reached the daemon's engine
        assert "must specify" not in d.log_path.read_text()   # every sequence started and ended as Triton's
    finally:
        stop_cleanly(d)
