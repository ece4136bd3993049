"""benchmarks/grpc/run.py, short and without the KServe peer (its venv is the benchmark's own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[1] / "grpc" / "run.py"


def test_the_grpc_bench_alternates_servers_and_reports_ratios(tmp_path):
    """Both our fronts through tritonclient, with and without system shared memory, two rounds, and the ratio
    of each round."""
    pytest.importorskip("tritonclient.grpc")
    r = subprocess.run([sys.executable, str(RUN), "--models", "tiny-cnn", "--clients", "1", "--seconds", "1",
                        "--rounds", "2", "--shared-memory", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]["tiny-cnn"]["1"]
    assert list(runs) == ["modelcache-grpc", "modelcache.shm-grpc", "modelcache-http", "modelcache.shm-http"]
    assert all(len(v) == 2 and all(run["requests"] > 0 and run["p99_us"] >= run["p50_us"] for run in v)
               for v in runs.values())
    assert "modelcache-grpc / modelcache-http: requests/s x" in r.stdout
    assert "modelcache.shm-http / modelcache-http: requests/s x" in r.stdout
    # the CPU a request cost each process, over the clients' window: the front works; the daemon may not at all,
    # warm, where the front runs tiny-cnn itself (front_runs, docs/serve.md) and reports after the window
    assert all(run["client_cpu_us"] > 0 and set(run["server_cpu_us"]) == {"front", "daemon"}
               and run["server_cpu_us"]["front"] > 0 and run["server_cpu_us"]["daemon"] >= 0
               for v in runs.values() for run in v)
    assert "CPU a request, us" in r.stdout
    assert (tmp_path / "report.txt").read_text().startswith("$ python benchmarks/grpc/run.py --models tiny-cnn")
