"""benchmarks/responsecache/run.py --quick: the real daemon (and Triton where its peer is built), one short round."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.systems.triton import peer_paths

RUN = Path(__file__).resolve().parents[1] / "responsecache" / "run.py"


def test_every_system_answers_and_the_caches_hit(tmp_path):
    r = subprocess.run([sys.executable, str(RUN), "--quick", "--out", str(tmp_path)], capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    triton = peer_paths() is not None
    expected = {"modelcache-on", "modelcache-off"} | ({"triton-on", "triton-off"} if triton else set())
    assert set(results["systems"]) == expected
    assert results["failure"] is None and results["checks"]["tiny-cnn"]["answers"] > 0
    windows = {(w["system"], w["distinct"]): w for w in results["windows"]}
    assert set(windows) == {(s, k) for s in expected for k in (64, 0)}
    for (system, k), w in windows.items():
        assert w["requests"] > 0 and w["p50_ms"] > 0 and w["p99_ms"] >= w["p50_ms"], (system, k, w)
        assert w["server_cpu_ms_per_request"] > 0, (system, k)
        if system.endswith("-off"):
            assert w["cache_hits"] == w["cache_misses"] == 0, (system, k, w)
        elif k == 0:            # fresh inputs: every request a miss
            assert w["cache_hits"] == 0, (system, w)
    for system in {"triton-on", "modelcache-on"} & expected:
        w = windows[(system, 64)]
        assert w["cache_hits"] > 0 and 0 < w["cache_misses"] <= 2 * 64, (system, w)   # the pool (twice: 2 clients)
        assert windows[(system, 0)]["cache_misses"] > 0
    assert all(results["memory_mib"]["tiny-cnn"][s] > 0 for s in expected)
    report = (tmp_path / "report.txt").read_text()
    assert report.startswith("$ python benchmarks/responsecache/run.py --quick")
    assert all(s in report for s in expected) and "wrong answers: 0" in report
    if not triton:
        assert "Triton systems skipped" in report
