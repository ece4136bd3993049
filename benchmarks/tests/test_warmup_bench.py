"""benchmarks/warmup/run.py on tiny-cnn, one round: the real daemon (and Triton where its peer is built)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from benchmarks.systems.triton import peer_paths

RUN = Path(__file__).resolve().parents[1] / "warmup" / "run.py"


def test_every_system_answers_and_modelcache_says_its_warmup_ended(tmp_path):
    r = subprocess.run([sys.executable, str(RUN), "--model", "tiny-cnn", "--rounds", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())
    expected = {"modelcache", "modelcache-warmup"} | ({"triton", "triton-warmup"} if peer_paths() else set())
    assert {row["system"] for row in rows} == expected
    for row in rows:
        assert row["first_ms"] > 0 and row["second_ms"] > 0 and row["ready_s"] > 0, row
        assert (row["warmup_s"] is not None) == (row["system"] == "modelcache-warmup"), row
    report = (tmp_path / "report.txt").read_text()
    assert report.startswith("$ python benchmarks/warmup/run.py --model tiny-cnn") and "first request ms" in report
