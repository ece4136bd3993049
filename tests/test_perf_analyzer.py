"""Triton's perf_analyzer, the load generator every Triton user measures with, against both fronts unchanged
(issue 44, part 7): a fixed-shape model, a model with a free dimension given by --shape, and a stateful model
(sequence batching, implicit state) driven with --sequence-length. The binary comes
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

from conftest import DaemonProcess, stop_cleanly, wait_until
from test_triton_examples import sequence_model
from test_triton_repo import IMPORT_DONE, free_port

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
    r = subprocess.run([BINARY, *args, "--concurrency-range", "2", "--measurement-mode", "count_windows",
                        "--measurement-request-count", "50", "--stability-percentage", "100", "--max-trials", "3"],
                       env={**os.environ, "LD_LIBRARY_PATH": str(Path(BINARY).parent)}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_perf_analyzer_drives_both_fronts(tmp_path, zoo_file):
    ports = {"grpc": free_port(), "http": free_port()}
    repo = tmp_path / "models"   # a stateful model: a running sum kept by the server (implicit state), CORRID
    model, config = sequence_model("simple_string_dyna_sequence")
    (repo / "seq" / "1").mkdir(parents=True)
    onnx.save(model, str(repo / "seq" / "1" / "model.onnx"))
    # (perf_analyzer sends uint64 sequence ids: a uint64 CORRID)
    (repo / "seq" / "config.pbtxt").write_text(config.replace("TYPE_STRING", "TYPE_UINT64"))
    g = model.graph
    next(i for i in g.input if i.name == "CORRID").type.tensor_type.elem_type = TensorProto.UINT64
    onnx.save(model, str(repo / "seq" / "1" / "model.onnx"))
    d = DaemonProcess(tmp_path, extra_env={"MODELCACHE_GRPC_PORT": str(ports["grpc"]),
                                           "MODELCACHE_HTTP_PORT": str(ports["http"]),
                                           "MODELCACHE_TRITON_REPOSITORY": str(repo)}).start()
    try:
        wait_until(lambda: IMPORT_DONE in d.log_path.read_text(), 120, "the import at start")
        assert "1 versions imported" in d.log_path.read_text()
        with d.client() as c:
            c.add(fixed_model(tmp_path / "fixed.onnx"), "fixed")
            c.add(zoo_file("tiny-cnn"), "cnn")      # input [batch, 3, 32, 32]: its batch dim given by --shape
        for protocol in ("grpc", "http"):
            for model, extra in (("fixed", []), ("cnn", ["--shape", "input:2,3,32,32"]),
                                 ("seq", ["--sequence-length", "8"])):
                out = perf_analyzer("-m", model, "-u", f"127.0.0.1:{ports[protocol]}", "-i", protocol, *extra)
                rate = re.search(r"Concurrency: 2, throughput: ([\d.]+) infer/sec", out)
                assert rate and float(rate.group(1)) > 0, out
        with d.client() as c:
            served = c.stats().executor["served"]
        assert served >= 6 * 50                       # every window's requests reached the daemon's engine
        assert "must specify" not in d.log_path.read_text()   # every sequence started and ended as Triton's
    finally:
        stop_cleanly(d)
