"""benchmarks/priority/run.py --quick: the real daemon (and Triton where its peer is built), one short round of
high- and low-priority clients on each system."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.systems.triton import peer_paths

RUN = Path(__file__).resolve().parents[1] / "priority" / "run.py"


def test_every_system_answers_both_classes(tmp_path):
    r = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    triton = peer_paths() is not None
    expected = {"modelcache-levels", "modelcache-fifo"} | ({"triton-levels", "triton-fifo"} if triton else set())
    assert set(results["systems"]) == expected and set(results["servers"]) == expected
    assert results["failure"] is None and results["checks"]["answers"] > 0
    assert results["checks"]["fresh_samples_checked"] > 0
    windows = {w["system"]: w for w in results["windows"]}
    assert set(windows) == expected
    for system, w in windows.items():
        for c in ("high", "low", "all"):
            assert w[f"{c}_requests"] > 0 and 0 < w[f"{c}_p50_ms"] <= w[f"{c}_p99_ms"], (system, c, w)
        assert w["all_requests"] == w["high_requests"] + w["low_requests"], (system, w)
        assert w["server_success"] >= w["all_requests"], (system, w)   # (each one ran: no cache here)
    assert "priority_levels: 2 default_priority_level: 2" in results["configs"]["levels"]
    assert "priority_levels" not in results["configs"]["fifo"]
    for label in {"modelcache-levels", "modelcache-fifo"}:     # each daemon imported its own repository
        env = results["servers"][label]["env"]
        assert env["MODELCACHE_TRITON_REPOSITORY"].endswith(f"repo-{label.split('-')[1]}"), env
    report = (tmp_path / "report.txt").read_text()
    assert report.startswith("$ python benchmarks/priority/run.py --quick")
    assert all(s in report for s in expected) and "wrong answers: 0" in report and "how each server was set" in report
    if not triton:
        assert "Triton systems skipped" in report
