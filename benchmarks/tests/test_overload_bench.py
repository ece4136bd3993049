"""benchmarks/overload/run.py, short: one round at three times the capacity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "overload" / "run.py"


def test_the_bounded_queue_refuses_what_the_unbounded_one_queues(tmp_path):
    r = subprocess.run([sys.executable, str(RUN), "--loads", "3", "--seconds", "1", "--rounds", "1",
                        "--max-queue", "2", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    points = {p["daemon"]: p for p in results["points"]}
    assert set(points) == {"0", "2"} and results["capacity"] > 0
    assert all(p["unanswered"] == 0 and p["served_per_s"] > 0 for p in points.values())
    assert points["0"]["refused_per_s"] == 0 and points["0"]["codes"] == []
    assert points["2"]["refused_per_s"] > 0 and points["2"]["codes"] == ["capacity"]
    assert points["2"]["p99_ms"] < points["0"]["p99_ms"]   # what the bound is for: the backlog's wait
    assert (tmp_path / "report.txt").read_text().startswith("$ python benchmarks/overload/run.py --loads 3")
