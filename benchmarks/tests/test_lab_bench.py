"""The benchmarks in benchmarks/ that recorded a design decision keep working (on tiny models; the figures
themselves come from full runs). Run from the repository root: PYTHONPATH=. python -m pytest -q benchmarks/tests"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(script, *args, timeout=600):
    """PYTHONPATH=. python benchmarks/SCRIPT ARGS from the repository root, as benchmarks/README.md says."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, f"benchmarks/{script}", *args], capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_coldstart_breakdown_times_each_step_of_an_open_per_client_path(tmp_path):
    text = run("coldstart/breakdown.py", "--models", "tiny-cnn", "--runs", "2", "--out", str(tmp_path))
    rows = {line.split()[1]: line.split() for line in text.splitlines() if line.startswith("tiny-cnn ")
            and line.split()[1] in ("zmq", "lane", "tuned")}
    assert list(rows) == ["zmq", "lane", "tuned"]
    samples = json.loads((tmp_path / "breakdown.json").read_text())
    assert len(samples) == 2 * 3
    for s in samples:
        steps = [s[k] for k in ("modules", "connect", "open", "bind", "session")]
        assert all(v >= 0 for v in steps) and s["session"] > 0
        if s["path"] != "tuned":
            assert s["open"] > 0 and s["connect"] > 0     # a real round trip to the daemon, on either path
    assert "on the lane" in (tmp_path / "breakdown.txt").read_text()


def test_halfweights_bench_on_a_tiny_fp16_model(tmp_path):
    text = run("halfweights/run.py", "--models", "tiny-fp16", "--runs", "1", "--warm-runs", "2",
               "--out", str(tmp_path))
    assert "attach       :     0.02 MiB = 1.000x the fp16 bytes; CPU tensors float16" in text
    assert "attach-upcast:     0.04 MiB = 2.000x the fp16 bytes; CPU tensors float32" in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert {s["mode"] for s in results["samples"]} == {"ort", "attach", "attach-upcast", "fold-at-open"}
    assert all(d == 0 for d in results["warm"][0]["max_abs_diff_vs_ort"].values())


def test_transport_bench_compares_zeromq_and_the_lane(tmp_path):
    text = run("transport/run.py", "--calls", "50", "--out", str(tmp_path))
    assert "zmq" in text and "lane" in text
    results = json.loads((tmp_path / "results.json").read_text())
    assert all(results[k][t]["p50_us"] > 0 for k in ("zmq", "lane") for t in ("0", "1000"))
    assert "recv_chunk (reused 1 MiB buffer)" in results["reads"] and all(us > 0 for us in results["reads"].values())


def test_servepath_splits_a_served_call(tmp_path):
    text = run("servepath/run.py", "--calls", "50", "--profile", "--out", str(tmp_path))
    assert "client Python" in text and "daemon handling" in text
    res = json.loads((tmp_path / "results.json").read_text())
    assert 0 < res["ort_run_us"] < res["daemon_handling_us"] < res["served_us"]
    assert res["client_python_us"] > 0 and res["daemon_top"]
    assert any("_run_express" in row["where"] or "submit" in row["where"] for row in res["daemon_top"])


def test_keep_oracle_keeps_exactly_the_gaps_cheaper_than_its_price(monkeypatch):
    """Hand-built calls: a 1 GiB model called every 10 s and a 4 GiB one every 100 s. At 20 GiB*s a cold start
    the oracle keeps the small model's gaps (10 GiB*s each) and lets the large one go after each call
    (400 GiB*s a gap): cold starts are the two first calls and the large model's later ones; a price above
    every gap leaves only the first calls."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks" / "faas"))
    from keep_oracle import KeepIfCheap
    from benchmarks.faas.simulate import GIB, Costs, replay
    from benchmarks.faas.trace import Invocation
    calls = sorted([Invocation(10.0 * i, "f", "small") for i in range(30)] +
                   [Invocation(100.0 * i + 5, "g", "large") for i in range(3)])
    sizes = {"small": GIB, "large": 4 * GIB}
    cheap = replay(lambda clock: KeepIfCheap(clock, calls, sizes, 20.0), 5 * GIB, calls, sizes, Costs())
    assert cheap.disk_misses == 2 + 2
    everything = replay(lambda clock: KeepIfCheap(clock, calls, sizes, 1e6), 5 * GIB, calls, sizes, Costs())
    assert everything.disk_misses == 2 and everything.gib_s > cheap.gib_s


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="a private mount namespace needs root and unshare(1)")
def test_containers_bench_opens_from_another_mount_namespace(tmp_path):
    text = run("containers/run.py", "--models", "tiny-cnn", "--runs", "1", "--out", str(tmp_path))
    assert "ready in a container" in text
    samples = json.loads((tmp_path / "results.json").read_text())["samples"]
    assert sorted(s["mode"] for s in samples) == ["container", "container-mmap", "here"]
    assert all(s["ready_ms"] > 0 and s["first_run_ms"] > 0 for s in samples)
    assert (tmp_path / "report.txt").read_text().startswith("$ PYTHONPATH=. python benchmarks/containers/run.py")
